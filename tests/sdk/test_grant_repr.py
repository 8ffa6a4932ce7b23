"""A grant's repr (what a log line or a traceback shows) never carries its token."""

from __future__ import annotations

from sandlot.sdk.types import Grant


def test_the_token_is_not_in_the_repr() -> None:
    grant = Grant.from_response(
        {
            "sandbox": {
                "id": "sb_1",
                "http_base_url": "http://127.0.0.1:1/dp/sb_1/v1",
                "ws_base_url": "ws://127.0.0.1:1/dp/sb_1/v1",
            },
            "token": "eyJ.secret-token-value.sig",
        }
    )
    assert grant.token == "eyJ.secret-token-value.sig"
    assert "secret-token-value" not in repr(grant)
    assert "sb_1" in repr(grant)
