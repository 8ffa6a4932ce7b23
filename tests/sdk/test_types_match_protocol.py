"""The SDK's result types are light twins of the wire models (the SDK does without
pydantic): each one's fields are derived here from its model in ``sandlot.protocol`` and
compared, names, optionality and types, so that neither side gains, loses or retypes a
field unnoticed. Where a twin differs on purpose, the difference is listed with its reason."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel

from sandlot.protocol import common
from sandlot.protocol import dataplane as dp
from sandlot.protocol import events as ev
from sandlot.protocol import sessions as cp
from sandlot.sdk import AsyncSandbox, AsyncSandlot
from sandlot.sdk import types as sdk

#: Every SDK result type and the wire model it is the twin of.
TWINS: dict[type, type[BaseModel]] = {
    # dataplane (PROTOCOL.md 3)
    sdk.CommandResult: dp.ExecResult,
    sdk.ExecSnapshot: dp.ExecSnapshot,
    sdk.ShellSnapshot: dp.ShellSnapshot,
    sdk.FileEntry: dp.FsEntry,
    sdk.ReadResult: dp.ReadResponse,
    sdk.EditResult: dp.EditResponse,
    sdk.FileStat: dp.StatResponse,
    sdk.UploadResult: dp.UploadResponse,
    sdk.ArchiveResult: dp.ArchiveResponse,
    sdk.GrepMatch: dp.GrepMatch,
    sdk.GrepMatchDict: dp.GrepMatch,
    sdk.GrepAnswer: dp.GrepResponse,
    sdk.Event: ev.Event,
    # control plane (PROTOCOL.md 2)
    sdk.Actor: common.Actor,
    sdk.Scope: common.Scope,
    sdk.Binding: cp.BindingSnapshot,
    sdk.DataplaneCoordinates: cp.DataplaneCoordinates,
    sdk.SandboxRef: cp.SandboxRef,
    sdk.Policy: cp.Policy,
    sdk.Credentials: cp.Credentials,
    sdk.SessionSnapshot: cp.SessionSnapshot,
    sdk.RefreshResult: cp.RefreshResponse,
    sdk.HeartbeatResult: cp.HeartbeatResponse,
    sdk.SandboxSnapshot: cp.SandboxSnapshot,
    sdk.Resources: cp.Resources,
    sdk.VolumeMount: cp.VolumeMount,
    sdk.Template: cp.Template,
    sdk.Pool: cp.PoolSnapshot,
    sdk.Volume: cp.Volume,
    sdk.AuditEntry: cp.AuditEntry,
}

#: Result types of the SDK that are no one model's twin, and why.
NOT_TWINS = {
    sdk.Grant: "one view of three shapes: the 2.1 grant, the 2.9 alias, the 2.10 bootstrap",
    sdk.OutputChunk: "made from stream frames (stdout, stderr and gap), not a body",
}

#: Fields only the SDK has: the body as sent.
SDK_ONLY = {"raw"}

#: Model fields the SDK reads into a field of another name.
RENAMED = {
    (sdk.Event, "sandbox_state"): "state",  # one ``state`` for sandbox and binding logs
}

#: SDK fields that may be None where the model's may not, and why.
WIDENED = {
    (sdk.CommandResult, "exec_id"): "also made by a stream's wait(), before an id is known",
    (sdk.CommandResult, "duration_ms"): "a streamed command has no server-side duration",
    (sdk.Event, "event_id"): "fields added after the defaulted ones of a positional dataclass",
    (sdk.Event, "timestamp"): "fields added after the defaulted ones of a positional dataclass",
}

#: SDK fields kept as plain mappings where the model has an object, and why.
AS_MAPPING = {
    (sdk.Event, "actor"): "kept as it always was: event.actor['id'] is public",
    (sdk.Event, "details"): "one member, dispatched on by Event.kind",
}


def _model_of(tp: type) -> type[BaseModel] | None:
    if tp in TWINS:
        return TWINS[tp]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return None


def shape(tp: Any) -> tuple[str, bool]:
    """A type in words both sides share, and whether it admits None.

    Enums of strings and literals are ``str``, sequences ``list``, mappings ``dict``,
    and an SDK type is named by the model it is the twin of.
    """
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return shape(args[0])
    if origin in (Union, types.UnionType):
        parts = [shape(a) for a in args if a is not type(None)]
        words = " | ".join(sorted(w for w, _ in parts))
        return words, type(None) in args or any(opt for _, opt in parts)
    if origin is Literal:
        return ("str" if all(isinstance(a, str) for a in args) else repr(tp)), None in args
    if origin in (list, tuple, Sequence):
        return f"list[{shape(args[0])[0]}]", False
    if origin in (dict, Mapping):
        return f"dict[{shape(args[0])[0]}, {shape(args[1])[0]}]", False
    if tp is Any:
        return "Any", True
    model = _model_of(tp)
    if model is not None:
        return model.__qualname__, False
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and issubclass(tp, str):
        return "str", False
    if tp in (str, int, float, bool):
        return tp.__name__, False
    raise AssertionError(f"no words for {tp!r}")


def _plain(value: Any) -> Any:
    """A default as JSON-ready data, whichever side it comes from."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def sdk_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _plain(f.default_factory() if f.default is dataclasses.MISSING else f.default)  # type: ignore[misc]


def sdk_fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """An SDK type's fields: name → (type, required by its parser)."""
    hints = get_type_hints(cls)
    if dataclasses.is_dataclass(cls):
        out = {}
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            out[f.name] = (hints[f.name], required)
        return out
    if issubclass(cls, tuple):  # a named tuple
        defaults = cls._field_defaults  # type: ignore[attr-defined]
        return {name: (hints[name], name not in defaults) for name in cls._fields}  # type: ignore[attr-defined]
    if typing.is_typeddict(cls):
        return {name: (hints[name], name in cls.__required_keys__) for name in hints}  # type: ignore[attr-defined]
    raise AssertionError(f"{cls.__name__} is not a dataclass, named tuple or TypedDict")


def model_fields(model: type[BaseModel]) -> dict[str, tuple[Any, bool]]:
    """A wire model's fields: name → (type, required)."""
    return {name: (f.annotation, f.is_required()) for name, f in model.model_fields.items()}


@pytest.mark.parametrize("twin", list(TWINS), ids=lambda c: c.__name__)
def test_fields_match_the_model(twin: type) -> None:
    model = TWINS[twin]
    ours = {k: v for k, v in sdk_fields(twin).items() if k not in SDK_ONLY}
    theirs = {RENAMED.get((twin, k), k): v for k, v in model_fields(model).items()}
    where = f"{twin.__name__} vs {model.__module__}.{model.__qualname__}"
    assert sorted(ours) == sorted(theirs), f"{where}: field names differ"
    for name, (ours_type, ours_required) in ours.items():
        theirs_type, theirs_required = theirs[name]
        (ours_words, ours_optional), (theirs_words, theirs_optional) = (
            shape(ours_type),
            shape(theirs_type),
        )
        if (twin, name) in AS_MAPPING:
            assert ours_words.startswith("dict["), f"{where}.{name}: {ours_words}"
        else:
            assert ours_words == theirs_words, f"{where}.{name}: {ours_words} != {theirs_words}"
        if (twin, name) in WIDENED:
            assert ours_optional and not theirs_optional, f"{where}.{name}: no longer widened"
        else:
            assert ours_optional == theirs_optional, f"{where}.{name}: None allowed differs"
        # A member the server may leave out is not required by the SDK's parser either,
        # and means what it means to the model.
        if issubclass(twin, sdk.WireResult) and not theirs_required:
            assert not ours_required, f"{where}.{name}: optional on the wire, required here"
            default = _plain(model.model_fields[name].get_default(call_default_factory=True))
            assert sdk_default(twin, name) == default, f"{where}.{name}: defaults differ"


def test_every_result_type_has_a_twin() -> None:
    """Every dataclass, named tuple or TypedDict of ``sandlot.sdk.types`` is listed."""
    found = set()
    for _, obj in inspect.getmembers(sdk, inspect.isclass):
        if obj.__module__ != sdk.__name__:
            continue
        if dataclasses.is_dataclass(obj) or typing.is_typeddict(obj) or issubclass(obj, tuple):
            found.add(obj)
    assert found == set(TWINS) | set(NOT_TWINS)


def _untyped(tp: Any) -> bool:
    """Whether a return type hands out untyped JSON: ``Any`` or a ``dict`` of ``Any``."""
    if tp is Any:
        return True
    if get_origin(tp) in (dict, Mapping) and get_args(tp)[1:] == (Any,):
        return True
    return any(_untyped(a) for a in get_args(tp))


#: Methods whose answer is not the server's, and why.
NOT_ANSWERS = {
    "lease_stats": "the client's own counts of background refreshes and heartbeats",
}


@pytest.mark.parametrize("cls", [AsyncSandlot, AsyncSandbox], ids=lambda c: c.__name__)
def test_public_methods_return_typed_results(cls: type) -> None:
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in NOT_ANSWERS:
            continue
        returned = get_type_hints(member).get("return")
        assert not _untyped(returned), f"{cls.__name__}.{name} returns {returned}"


def test_parsing_keeps_the_body_and_ignores_new_members() -> None:
    body = {
        "name": "py",
        "image": "host",
        "resources": {"cpu": 2.0, "memory_mb": 512, "pids": 64, "disk_mb": None},
        "volume_mounts": [{"volume": "cache", "path": "/cache"}],
        "added_by_a_newer_server": True,
    }
    template = sdk.Template.from_wire(body)
    assert template.resources == sdk.Resources(cpu=2.0, memory_mb=512, pids=64)
    assert template.volume_mounts == [sdk.VolumeMount(volume="cache", path="/cache")]
    assert template.to_dict() == body  # what the CLI prints with --json
    # What the model itself makes of the body, field by field.
    wire = cp.Template.model_validate(body).model_dump(mode="json")
    assert {k: v for k, v in dataclasses.asdict(template).items() if k != "raw"} == wire
    with pytest.raises(ValueError, match="image"):
        sdk.Template.from_wire({"name": "py"})


def test_grep_answer_keys_are_the_wire_models() -> None:
    """``grep_raw`` hands out dicts on purpose: their keys are the models' fields."""
    assert set(sdk.GrepAnswer.__annotations__) == set(dp.GrepResponse.model_fields)
    assert set(sdk.GrepMatchDict.__annotations__) == set(dp.GrepMatch.model_fields)
    assert sdk.GrepAnswer.__required_keys__ == frozenset(sdk.GrepAnswer.__annotations__)
