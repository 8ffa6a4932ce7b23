"""Shared vocabulary of the wire: actors, scopes, capabilities, ids, timestamps."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from enum import StrEnum
from types import ModuleType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Re-exported: the versions live in a module the SDK can load without pydantic.
from sandlot.protocol.version import API_VERSION as API_VERSION
from sandlot.protocol.version import PROTOCOL_VERSION as PROTOCOL_VERSION

#: Identifiers a client may choose (thread ids, scope ids, names): bounded, printable.
Name = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
]
#: Resource names that appear in URLs (templates, pools, volumes, sandboxes, shells).
Slug = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
]


#: Every wire model's validator and serializer are built on the model's first use, not
#: when its module is imported: a process pays only for the models it uses (the
#: dataplane in a container starts in a fraction of the time; docs/PROVIDERS.md).
DEFERRED = ConfigDict(defer_build=True)


def unbuilt_models(module: ModuleType) -> list[type[BaseModel]]:
    """The wire models ``module`` defines whose validators are not built yet."""
    return [
        value
        for value in list(vars(module).values())
        if isinstance(value, type)
        and issubclass(value, BaseModel)
        and value.__module__ == module.__name__
        and not value.__pydantic_complete__
    ]


def build_models(module: ModuleType) -> None:
    """Build now the validators of every wire model ``module`` defines (a server that must
    answer its first request as fast as its next ones)."""
    for model in unbuilt_models(module):
        model.model_rebuild()


class WireModel(BaseModel):
    """Base of every wire model: unknown fields are ignored, values are validated."""

    model_config = DEFERRED | ConfigDict(extra="ignore", populate_by_name=True)


class StrictWireModel(BaseModel):
    model_config = DEFERRED | ConfigDict(extra="forbid", populate_by_name=True)


class ActorType(StrEnum):
    HUMAN = "human"
    AGENT = "agent"


class PrincipalType(StrEnum):
    HUMAN = "human"
    AGENT = "agent"
    SERVICE = "service"


class ScopeType(StrEnum):
    THREAD = "thread"
    ASSISTANT = "assistant"
    WORKSPACE = "workspace"
    DEPLOYMENT = "deployment"
    USER = "user"
    RUN = "run"
    #: The binding a standalone sandbox gets when attached by id (``sandbox_id`` in 2.1):
    #: never named in a request's ``scope``.
    SANDBOX = "sandbox"


class Capability(StrEnum):
    FS_READ = "fs_read"
    FS_WRITE = "fs_write"
    EXEC = "exec"
    SHELL = "shell"
    SHELL_OBSERVE = "shell_observe"


ALL_CAPABILITIES: frozenset[Capability] = frozenset(Capability)


def expand_capabilities(caps: set[Capability] | frozenset[Capability]) -> frozenset[Capability]:
    """Capabilities with their implications applied (``shell`` implies ``shell_observe``)."""
    out = set(caps)
    if Capability.SHELL in out:
        out.add(Capability.SHELL_OBSERVE)
    return frozenset(out)


class Actor(WireModel):
    type: ActorType
    id: Name


class Scope(WireModel):
    type: ScopeType
    id: Name

    def key(self) -> str:
        """The scope as it appears in token claims and the store: ``thread:thr_123``."""
        return f"{self.type.value}:{self.id}"

    @classmethod
    def parse(cls, key: str) -> Scope:
        kind, _, ident = key.partition(":")
        return cls(type=ScopeType(kind), id=ident)


def new_id(prefix: str, nbytes: int = 12) -> str:
    """An opaque id with a type prefix (``ssn_``, ``sb_``, ``ex_``, ``key_``, ``req_``)."""
    return f"{prefix}_{secrets.token_hex(nbytes)}"


def json_bytes(obj: object) -> bytes:
    """The wire's JSON for plain data: compact, UTF-8."""
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # A file name that is not valid UTF-8 (lone surrogates): escape instead of failing.
        return json.dumps(obj, separators=(",", ":")).encode()


def utcnow() -> datetime:
    return datetime.now(UTC)


def rfc3339(ts: datetime | float | None) -> str | None:
    """RFC 3339 UTC with a ``Z`` suffix, second precision kept to milliseconds."""
    if ts is None:
        return None
    if isinstance(ts, (int, float)):
        ts = datetime.fromtimestamp(ts, UTC)
    ts = ts.astimezone(UTC)
    text = ts.isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


NonNegInt = Annotated[int, Field(ge=0)]
