"""Control-plane wire models (PROTOCOL.md section 2)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field, model_validator

from sandlot.protocol.common import (
    PROTOCOL_VERSION,
    Actor,
    Capability,
    Name,
    Scope,
    ScopeType,
    Slug,
    WireModel,
)

# Templates and a sandbox's activity are what a dataplane needs of this section: they live
# in a module of their own (the dataplane in a container imports it, not the broker's
# models), named here as the section names them.
from sandlot.protocol.templates import NetworkMode as NetworkMode
from sandlot.protocol.templates import Resources as Resources
from sandlot.protocol.templates import SandboxActivity as SandboxActivity
from sandlot.protocol.templates import Template as Template
from sandlot.protocol.templates import VolumeMount as VolumeMount


class SessionMode(StrEnum):
    ENSURE = "ensure"
    ATTACH_ONLY = "attach_only"
    CREATE_ONLY = "create_only"
    GET = "get"

    @property
    def creates(self) -> bool:
        return self in (SessionMode.ENSURE, SessionMode.CREATE_ONLY)


class SessionRequest(WireModel):
    """Both shapes of 2.1: MVP ``{thread_id, mode}`` and the full shape with ``scope``.

    Sandlot's extension (docs/BROKER.md): ``{"sandbox_id": "sb_…", "mode": "attach_only"}``
    attaches to a sandbox by id instead of a scope; it never creates.
    """

    model_config = WireModel.model_config | {
        "json_schema_extra": {
            "anyOf": [
                {"required": ["thread_id"], "properties": {"thread_id": {"type": "string"}}},
                {"required": ["scope"], "properties": {"scope": {"type": "object"}}},
                {"required": ["sandbox_id"], "properties": {"sandbox_id": {"type": "string"}}},
            ]
        }
    }

    thread_id: Name | None = None
    scope: Scope | None = None
    #: Required, as in the MVP: a client always says whether it may create a sandbox.
    mode: SessionMode
    actor: Actor | None = None
    requested_capabilities: list[Capability] | None = None
    template: Slug | None = None
    sandbox_hint: Name | None = None
    provider_preference: str = "auto"
    assistant_id: Name | None = None
    #: Attach to this sandbox (its owner, an admin, or whoever may attach to the scope it
    #: serves) instead of a scope: ``attach_only``/``get`` only, without a scope.
    sandbox_id: Name | None = None

    @model_validator(mode="after")
    def _scope_given(self) -> SessionRequest:
        if self.sandbox_id is not None:
            if self.scope is not None or self.thread_id is not None:
                raise ValueError("sandbox_id names the sandbox: give no scope or thread_id")
            if self.mode.creates:
                raise ValueError("sandbox_id attaches only: mode must be attach_only or get")
            if self.sandbox_hint is not None or self.template is not None:
                raise ValueError("sandbox_id attaches only: no sandbox_hint or template")
            return self
        if self.scope is None and self.thread_id is None:
            raise ValueError("either scope, thread_id or sandbox_id is required")
        if self.scope is not None and self.scope.type is ScopeType.SANDBOX:
            raise ValueError("a sandbox is attached with sandbox_id, not a scope")
        if (
            self.scope is not None
            and self.thread_id is not None
            and (self.scope.type is not ScopeType.THREAD or self.scope.id != self.thread_id)
        ):
            raise ValueError("thread_id and scope disagree")
        return self

    def effective_scope(self) -> Scope:
        if self.scope is not None:
            return self.scope
        if self.sandbox_id is not None:
            return Scope(type=ScopeType.SANDBOX, id=self.sandbox_id)
        assert self.thread_id is not None
        return Scope(type=ScopeType.THREAD, id=self.thread_id)


class DataplaneCoordinates(WireModel):
    http_base_url: str
    ws_base_url: str


class SandboxRef(WireModel):
    id: str
    provider: str
    http_base_url: str
    ws_base_url: str


class BindingSnapshot(WireModel):
    id: str
    scope: Scope
    sandbox_id: str
    provider: str
    state: str
    created: bool = False
    lease_expires_at: str | None = None
    last_event_sequence: int = 0
    created_at: str | None = None
    owner_user_id: str | None = None


class Credentials(WireModel):
    token_type: str = "Bearer"
    access_token: str
    expires_at: str
    granted_capabilities: list[Capability]


class Policy(WireModel):
    idle_timeout_seconds: int
    hard_ttl_seconds: int
    token_ttl_seconds: int
    lease_ttl_seconds: int


class SessionGrant(WireModel):
    """The 2.1 response: MVP fields and full fields together (``session_id == binding.id``).

    This is also the bootstrap object of 2.10.
    """

    protocol_version: str = PROTOCOL_VERSION
    session_id: str
    thread_id: str | None = None
    sandbox: SandboxRef
    token: str
    expires_at: str
    binding: BindingSnapshot
    dataplane: DataplaneCoordinates
    credentials: Credentials
    policy: Policy
    refresh_url: str


class SessionSnapshot(WireModel):
    """2.2: the binding snapshot without a token."""

    session_id: str
    binding: BindingSnapshot
    sandbox: SandboxRef
    dataplane: DataplaneCoordinates
    policy: Policy


class RefreshResponse(WireModel):
    token: str
    expires_at: str
    credentials: Credentials


class HeartbeatResponse(WireModel):
    state: str
    lease_expires_at: str


class MemberRequest(WireModel):
    user_id: Name


class MembersResponse(WireModel):
    scope: Scope
    owner_user_id: str
    members: list[str]


# --- templates, volumes, pools, sandboxes (2.8) ---------------------------------


class Volume(WireModel):
    name: Slug
    created_at: str | None = None
    size_bytes: int | None = None


class VolumeCreate(WireModel):
    name: Slug


class Pool(WireModel):
    name: Slug
    template: Slug
    min_ready: int = Field(default=1, ge=0, le=1000)
    max_ready: int = Field(default=4, ge=0, le=1000)

    @model_validator(mode="after")
    def _bounds(self) -> Pool:
        if self.max_ready < self.min_ready:
            raise ValueError("max_ready must be >= min_ready")
        return self


class PoolSnapshot(Pool):
    ready: int = 0
    provisioning: int = 0


class SandboxCreate(WireModel):
    template: Slug = "default"
    name: Slug | None = None


class SandboxSnapshot(WireModel):
    id: str
    name: str | None
    template: str
    state: str
    provider: str
    dataplane: DataplaneCoordinates
    created_at: str
    last_event_sequence: int
    owner_user_id: str | None = None
    scope: str | None = None
    generation: int = 1


T = TypeVar("T")


class ListResponse(WireModel, Generic[T]):
    """``GET /v1/templates``, ``/v1/volumes``, ``/v1/pools``, ``/v1/sandboxes``."""

    items: list[T]


# --- aliases (2.9) ----------------------------------------------------------------


class AcquireRequest(WireModel):
    thread_id: Name
    assistant_id: Name | None = None


class AcquireResponse(WireModel):
    protocol_version: str = PROTOCOL_VERSION
    sandbox_id: str
    session_id: str
    token: str
    ws_url: str
    http_url: str
    expires_at: str
    scopes: list[Capability]
    refresh_url: str


class AliasRefreshRequest(WireModel):
    token: str = Field(min_length=1, max_length=8192)


class AliasRefreshResponse(RefreshResponse):
    sandbox_id: str | None
    session_id: str
    scopes: list[Capability]


class AliasReleaseRequest(WireModel):
    session_id: Name


# --- LangSmith-compatible boxes (3.9, control plane) -------------------------------


class BoxCreate(WireModel):
    """LangSmith's box creation. The template is named by any one of ``template_name``,
    ``snapshot``, ``snapshot_name`` or ``snapshot_id`` (none: the server's default)."""

    name: Slug | None = None
    template_name: Slug | None = None
    snapshot: Slug | None = None
    snapshot_name: Slug | None = None
    snapshot_id: Slug | None = None
    wait_for_ready: bool = False
    timeout: float = Field(default=60.0, gt=0, le=3600)


BoxState = Literal["provisioning", "ready", "failed", "stopped"]


class Box(WireModel):
    name: str
    id: str
    status: BoxState
    template_name: str
    dataplane_url: str
    created_at: str
    updated_at: str


class BoxList(WireModel):
    sandboxes: list[Box]


class BoxStatus(WireModel):
    status: BoxState


# --- operations -----------------------------------------------------------------------


class Health(WireModel):
    status: str
    server: str
    api_version: str


class Jwks(WireModel):
    keys: list[dict[str, Any]]


class AuditEntry(WireModel):
    """One action of the audit log: who did it (``actor``: the principal, or the agent it
    named), when, with what outcome, to which scope, binding and sandbox."""

    id: int
    timestamp: str
    request_id: str | None
    action: str
    outcome: str
    principal_id: str | None
    user_id: str | None
    actor: Actor | None
    scope: str | None
    session_id: str | None
    sandbox_id: str | None
    details: dict[str, Any]


class AuditPage(WireModel):
    """``GET /v1/audit``: entries in id order; ``next_after`` is the cursor of the next page."""

    items: list[AuditEntry]
    next_after: int
