import pytest

from sandlot.protocol import errors as E


def test_every_row_maps_code_status_and_class_consistently() -> None:
    for code, row in E.ERROR_TABLE.items():
        assert row.status == row.exception.status
        assert 400 <= row.status < 600
        assert E.exception_for(code) is row.exception


@pytest.mark.parametrize("code", sorted(E.ERROR_TABLE))
def test_wire_round_trip(code: str) -> None:
    row = E.ERROR_TABLE[code]
    err = row.exception("boom", metadata={"k": 1}, code=code)
    wire = err.to_wire("req_1")
    assert wire["error"]["code"] == code
    assert wire["error"]["request_id"] == "req_1"
    assert wire["error"]["retryable"] is row.retryable
    back = E.error_from_wire(wire, row.status)
    assert type(back) is row.exception
    assert back.wire_code == code and back.metadata == {"k": 1}


def test_aliases_map_to_the_same_class() -> None:
    assert E.exception_for("BINDING_NOT_FOUND") is E.SessionNotFound
    assert E.exception_for("BINDING_CONFLICT") is E.SessionConflict
    assert E.exception_for("BACKEND_UNAVAILABLE") is E.ProviderUnavailable


def test_unknown_code_falls_back_on_status() -> None:
    assert E.exception_for("WHATEVER", 404) is E.ResourceNotFound
    assert isinstance(E.error_from_wire("not json", 503), E.ProviderUnavailable)
