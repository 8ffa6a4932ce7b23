"""A sandlot session in A2A (the Agent2Agent protocol) messages and tasks, and back.

An agent that works in a sandbox hands it to another agent over A2A: the other agent
reads which sandbox, scope and files the message names, and attaches with its own key
(:meth:`AsyncSandlot.attach_sandbox <sandlot.sdk.AsyncSandlot.attach_sandbox>`). The
mapping (docs/INTEGRATIONS.md has it as a table):

- the session (a :class:`~sandlot.sdk.Grant`) → ``metadata["sandlot/environment"]``
  of a Message or a Task (:data:`METADATA_KEY`, :func:`environment_metadata`);
- the sandbox → the shared context: ``contextId`` is ``sandlot://{sandbox_id}``
  (:func:`context_id`), so every agent working in one sandbox is in one context;
- a file of the sandbox → a Part whose ``url`` is ``sandlot://{sandbox_id}/{path}``
  (:func:`file_part`, :func:`file_artifact`): the URI form of
  :mod:`sandlot.protocol.uris`, which the MCP server's resources use too;
- the dataplane → its base URLs in the metadata, as a reference: never a token unless
  asked for (``include_token``), since A2A messages travel to other agents, and are
  logged and stored by them.

The shapes are A2A 1.0's JSON (camelCase, as ``a2a-sdk`` 1.x serializes its protobuf
types). The functions that return dicts need nothing beyond this SDK; the ``new_*``
ones return ``a2a-sdk`` objects (``pip install 'sandlot[a2a]'``), importing it when
called. :func:`environment_of` and :func:`files_of` read a dict, an ``a2a-sdk`` 1.x
object or a 0.3 one (pydantic; its file parts are ``{"file": {"uri": …}}``).
"""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sandlot.protocol.uris import SCHEME, parse_sandbox_uri, sandbox_uri
from sandlot.protocol.version import PROTOCOL_VERSION
from sandlot.sdk.types import Grant, Scope, parse_time

if TYPE_CHECKING:
    from a2a.types import Artifact, Message, Part

#: The key of the environment object in an A2A ``metadata`` map.
METADATA_KEY = "sandlot/environment"

Json = dict[str, Any]
GrantLike = Grant | Mapping[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class SandboxFile:
    """A file of a sandbox that an A2A part names (absolute ``path``)."""

    sandbox_id: str
    path: str
    media_type: str | None = None

    @property
    def uri(self) -> str:
        """``sandlot://{sandbox_id}/{path}``."""
        return sandbox_uri(self.sandbox_id, self.path)


@dataclass(frozen=True, kw_only=True)
class Environment:
    """The sandbox an A2A message or task names (:func:`environment_of`).

    Attach with your own key: ``attach_sandbox(env.sandbox_id)`` joins ``session_id``
    (the binding of ``scope``, one for every agent attached to it) with a token of
    your own. ``capabilities`` are the sender's. ``token`` is set only when the
    sender chose to include its own (:meth:`grant`).
    """

    sandbox_id: str
    scope: Scope | None = None
    session_id: str | None = None
    capabilities: tuple[str, ...] = ()
    http_base_url: str | None = None
    ws_base_url: str | None = None
    broker_url: str | None = None
    protocol_version: str | None = None
    token: str | None = field(default=None, repr=False)
    expires_at: str | None = None

    @property
    def context_id(self) -> str:
        """The A2A context of this sandbox (:func:`context_id`)."""
        return context_id(self.sandbox_id)

    def grant(self) -> Grant:
        """The sender's token as a grant in hand (``AsyncSandbox(env.grant())``), usable
        until it expires and never refreshed; :class:`ValueError` when no token came."""
        if self.token is None or self.http_base_url is None:
            raise ValueError(
                f"no token came with sandbox {self.sandbox_id}: attach with your own key "
                "(attach_sandbox)"
            )
        return Grant(
            sandbox_id=self.sandbox_id,
            http_base_url=self.http_base_url,
            ws_base_url=self.ws_base_url or "ws" + self.http_base_url.removeprefix("http"),
            token=self.token,
            expires_at=parse_time(self.expires_at),
            session_id=self.session_id,
            capabilities=self.capabilities,
            scope={"type": self.scope.type, "id": self.scope.id} if self.scope else None,
            protocol_version=self.protocol_version,
        )


# --- sandlot → A2A (plain dicts) ------------------------------------------------------


def context_id(sandbox_id: str) -> str:
    """The A2A ``contextId`` of a sandbox: ``sandlot://{sandbox_id}``."""
    return sandbox_uri(sandbox_id)


def environment_metadata(
    grant: GrantLike, *, include_token: bool = False, broker_url: str | None = None
) -> Json:
    """``{"sandlot/environment": {…}}``: the session, for an A2A ``metadata`` map.

    The object holds ``sandbox_id``, ``scope``, ``session_id``, ``capabilities``,
    ``dataplane`` (``http_base_url``, ``ws_base_url``), ``protocol_version`` and
    ``broker_url`` when given: where the sandbox is, never what opens it.

    ``include_token=True`` adds the sandbox ``token`` and its ``expires_at``. Only
    for a receiver that cannot attach itself: whoever sees the message (the other
    agent, its logs, its task store, any agent it forwards to) can then act in the
    sandbox with the token's capabilities, as the token's actor, until it expires or
    the sender releases the session (which revokes it).
    """
    grant = Grant.from_response(grant)
    env: Json = {"sandbox_id": grant.sandbox_id}
    if grant.scope is not None:
        env["scope"] = {"type": grant.scope["type"], "id": grant.scope["id"]}
    if grant.session_id is not None:
        env["session_id"] = grant.session_id
    env["capabilities"] = list(grant.capabilities)
    env["dataplane"] = {"http_base_url": grant.http_base_url, "ws_base_url": grant.ws_base_url}
    env["protocol_version"] = grant.protocol_version or PROTOCOL_VERSION
    if broker_url is not None:
        env["broker_url"] = broker_url
    if include_token:
        env["token"] = grant.token
        if grant.expires_at is not None:
            expires_at = datetime.fromtimestamp(grant.expires_at, UTC)
            env["expires_at"] = expires_at.isoformat().replace("+00:00", "Z")
    return {METADATA_KEY: env}


def file_part(sandbox_id: str, path: str, *, media_type: str | None = None) -> Json:
    """An A2A Part naming a sandbox file: ``{"url": "sandlot://…", "filename": …}``.

    ``path`` is absolute; a ``..`` segment is a :class:`ValueError`.
    """
    part: Json = {"url": sandbox_uri(sandbox_id, path)}
    name = posixpath.basename(path)
    if name:
        part["filename"] = name
    if media_type is not None:
        part["mediaType"] = media_type
    return part


def file_artifact(
    sandbox_id: str,
    paths: Iterable[str],
    *,
    name: str,
    description: str | None = None,
    artifact_id: str | None = None,
) -> Json:
    """An A2A Artifact of sandbox files (one part per path), the files staying in the sandbox."""
    artifact: Json = {
        "artifactId": artifact_id or str(uuid.uuid4()),
        "name": name,
        "parts": [file_part(sandbox_id, path) for path in paths],
    }
    if description is not None:
        artifact["description"] = description
    return artifact


def message(
    grant: GrantLike,
    *,
    text: str | None = None,
    files: Iterable[str] = (),
    role: Literal["user", "agent"] = "user",
    message_id: str | None = None,
    task_id: str | None = None,
    include_token: bool = False,
    broker_url: str | None = None,
) -> Json:
    """An A2A Message about the grant's sandbox: in its context, with its environment
    metadata, a text part and a part per file (absolute paths).

    ``include_token`` and ``broker_url`` are :func:`environment_metadata`'s.
    """
    grant = Grant.from_response(grant)
    parts: list[Json] = [] if text is None else [{"text": text}]
    parts += [file_part(grant.sandbox_id, path) for path in files]
    if not parts:
        raise ValueError("an A2A message needs a part: give text or files")
    body: Json = {
        "messageId": message_id or str(uuid.uuid4()),
        "contextId": context_id(grant.sandbox_id),
        "role": "ROLE_USER" if role == "user" else "ROLE_AGENT",
        "parts": parts,
        "metadata": environment_metadata(grant, include_token=include_token, broker_url=broker_url),
    }
    if task_id is not None:
        body["taskId"] = task_id
    return body


# --- sandlot → A2A (a2a-sdk objects) --------------------------------------------------


def new_file_part(sandbox_id: str, path: str, *, media_type: str | None = None) -> Part:
    """:func:`file_part` as an ``a2a.types.Part``."""
    from a2a.types import Part

    return _parsed(file_part(sandbox_id, path, media_type=media_type), Part())


def new_file_artifact(
    sandbox_id: str,
    paths: Iterable[str],
    *,
    name: str,
    description: str | None = None,
    artifact_id: str | None = None,
) -> Artifact:
    """:func:`file_artifact` as an ``a2a.types.Artifact``."""
    from a2a.types import Artifact

    data = file_artifact(
        sandbox_id, paths, name=name, description=description, artifact_id=artifact_id
    )
    return _parsed(data, Artifact())


def new_message(
    grant: GrantLike,
    *,
    text: str | None = None,
    files: Iterable[str] = (),
    role: Literal["user", "agent"] = "user",
    message_id: str | None = None,
    task_id: str | None = None,
    include_token: bool = False,
    broker_url: str | None = None,
) -> Message:
    """:func:`message` as an ``a2a.types.Message``."""
    from a2a.types import Message

    data = message(
        grant,
        text=text,
        files=files,
        role=role,
        message_id=message_id,
        task_id=task_id,
        include_token=include_token,
        broker_url=broker_url,
    )
    return _parsed(data, Message())


def _parsed(data: Json, into: T) -> T:
    """``data`` read into the protobuf message ``into`` by a2a-sdk's own JSON mapping."""
    from google.protobuf.json_format import ParseDict

    ParseDict(data, into)
    return into


# --- A2A → sandlot ----------------------------------------------------------------------


def environment_of(item: Any) -> Environment | None:
    """The sandbox an A2A Message, Task or Artifact names; ``None`` if it names none.

    Read from its ``metadata["sandlot/environment"]``, else from a ``contextId`` of the
    form ``sandlot://{sandbox_id}`` (another context id is the server's own, and is not
    sandlot's). A malformed environment, or one that names another sandbox than the
    context, is a :class:`ValueError`.
    """
    data = _as_dict(item)
    from_context = _sandbox_of_context(_get(data, "contextId", "context_id"))
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ValueError("A2A metadata is a JSON object")
    env = metadata.get(METADATA_KEY)
    if env is None:
        return None if from_context is None else Environment(sandbox_id=from_context)
    if not isinstance(env, Mapping):
        raise ValueError(f"metadata[{METADATA_KEY!r}] is not a JSON object")
    sandbox_id = _required(env, "sandbox_id")
    sandbox_uri(sandbox_id)  # an id a URI can carry, or ValueError
    if from_context is not None and from_context != sandbox_id:
        raise ValueError(
            f"the contextId names sandbox {from_context}, metadata[{METADATA_KEY!r}] {sandbox_id}"
        )
    scope = env.get("scope")
    dataplane = env.get("dataplane") or {}
    capabilities = env.get("capabilities") or []
    if not isinstance(dataplane, Mapping):
        raise ValueError(f"metadata[{METADATA_KEY!r}].dataplane is not a JSON object")
    if not (isinstance(capabilities, list) and all(isinstance(c, str) for c in capabilities)):
        raise ValueError(f"metadata[{METADATA_KEY!r}].capabilities is not a list of strings")
    return Environment(
        sandbox_id=sandbox_id,
        scope=None if scope is None else _scope(scope),
        session_id=_text(env, "session_id"),
        capabilities=tuple(capabilities),
        http_base_url=_text(dataplane, "http_base_url"),
        ws_base_url=_text(dataplane, "ws_base_url"),
        broker_url=_text(env, "broker_url"),
        protocol_version=_text(env, "protocol_version"),
        token=_text(env, "token"),
        expires_at=_text(env, "expires_at"),
    )


def files_of(item: Any) -> list[SandboxFile]:
    """The sandbox files an A2A Message, Task, Artifact or Part names, in order.

    A Task's are those of its artifacts, its history and its status message. Parts
    with another URL (``https:``, …) are not sandlot's and are skipped; a
    ``sandlot:`` URL that is malformed, or names no file, is a :class:`ValueError`.
    """
    found: list[SandboxFile] = []
    for part in _parts(_as_dict(item)):
        file = part.get("file")
        url = part.get("url") or (file.get("uri") if isinstance(file, Mapping) else None)
        if not (isinstance(url, str) and url[: len(SCHEME) + 1].lower() == SCHEME + ":"):
            continue
        media_type = _get(part, "mediaType", "media_type")
        if media_type is None and isinstance(file, Mapping):
            media_type = file.get("mimeType")
        found.append(parse_file_uri(url, media_type=media_type))
    return found


def parse_file_uri(uri: str, *, media_type: str | None = None) -> SandboxFile:
    """The sandbox file ``sandlot://{sandbox_id}/{path}`` names; :class:`ValueError` if it
    is malformed (a ``..`` segment included) or names no file."""
    parsed = parse_sandbox_uri(uri)
    if parsed.path is None or parsed.path == "/":
        raise ValueError(f"{uri!r} names a sandbox, not a file in it")
    return SandboxFile(parsed.id, parsed.path, media_type or None)


def _as_dict(item: Any) -> Mapping[str, Any]:
    """An A2A object as its JSON: a dict as is, an a2a-sdk 1.x (protobuf) or 0.3
    (pydantic) object serialized the way a2a-sdk does."""
    if isinstance(item, Mapping):
        return item
    if hasattr(item, "DESCRIPTOR"):
        from google.protobuf.json_format import MessageToDict

        return dict(MessageToDict(item))
    dump = getattr(item, "model_dump", None)
    if callable(dump):
        data = dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(data, Mapping):
            return data
    raise TypeError(f"not an A2A object: {type(item).__name__}")


def _parts(data: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The parts of a Message or Artifact, of every message and artifact of a Task, or a
    Part itself."""
    if "url" in data or "file" in data:
        yield data
    containers: list[Any] = [data]
    containers += _items(data.get("artifacts"))
    containers += _items(data.get("history"))
    status = data.get("status")
    if isinstance(status, Mapping) and isinstance(status.get("message"), Mapping):
        containers.append(status["message"])
    for container in containers:
        if isinstance(container, Mapping):
            yield from (p for p in _items(container.get("parts")) if isinstance(p, Mapping))


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _sandbox_of_context(value: Any) -> str | None:
    if not (isinstance(value, str) and value[: len(SCHEME) + 1].lower() == SCHEME + ":"):
        return None
    parsed = parse_sandbox_uri(value)
    if parsed.path is not None:
        raise ValueError(f"contextId {value!r}: a context is a sandbox, sandlot://{{sandbox_id}}")
    return parsed.id


def _scope(value: Any) -> Scope:
    if not isinstance(value, Mapping):
        raise ValueError(f"metadata[{METADATA_KEY!r}].scope is not a JSON object")
    return Scope(type=_required(value, "type"), id=_required(value, "id"))


def _text(data: Mapping[str, Any], key: str) -> str | None:
    return None if data.get(key) is None else _required(data, key)


def _required(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"metadata[{METADATA_KEY!r}]: {key} is not a non-empty string")
    return value


def _get(data: Mapping[str, Any], camel: str, snake: str) -> Any:
    """A member by its JSON name, or by its protobuf field name."""
    return data[camel] if camel in data else data.get(snake)
