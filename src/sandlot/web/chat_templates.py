"""The agent programs ``/ws/claude-stream`` may start: server-owned command templates.

A browser never names a command. It names a template (boring-ui's ``provider``) and
gives values for the template's named parameters (``model``, ``mode``, tool lists…);
the server builds the argv from the template alone:

- ``argv`` is a list of elements. An element that is exactly ``{name}`` stands for the
  parameter ``name``: it becomes ``[flag, value]`` (or ``[value]`` without a flag), or
  nothing when the parameter was not given and has no default. Every other element is
  literal; nothing is ever substituted *inside* an element, and the command runs
  directly (never under ``sh -c``), so a value can only ever be one argument.
- Each parameter is checked before anything runs: against its ``pattern`` (a regular
  expression the whole value must match), or its ``choices`` (the browser's value →
  the argument passed, such as ``ask`` → ``default``). A ``list`` parameter takes a
  comma-separated list (or the repeated query parameter), checks each item, and passes
  them joined by commas as one argument. A value that does not pass refuses the whole
  request, and nothing starts.

The default set holds one template, ``claude``: Claude Code in stream-JSON mode
(``claude -p --input-format stream-json --output-format stream-json --verbose`` with
``--model``, ``--permission-mode`` from boring-ui's ``mode`` (ask → default, act →
acceptEdits, plan → plan), ``--allowedTools`` and ``--disallowedTools``). It runs when
``claude`` is installed in the workspace's image; otherwise the browser is told so.

Others are added in a TOML file (:func:`load_chat_templates`)::

    default = "claude"

    [templates.echo]
    argv = ["python3", "/opt/agents/echo.py", "{model}"]
    env = { NO_COLOR = "1" }

    [templates.echo.parameters.model]
    flag = "--model"
    pattern = "[a-z0-9.-]{1,40}"

A file's templates replace the built-in set (copy ``claude`` into it to keep it).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandlot.protocol.errors import InvalidRequest
from sandlot.web.settings import ConfigError

TEMPLATE_ID = re.compile(r"[a-z][a-z0-9_-]{0,31}")
PARAMETER_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_PLACEHOLDER = re.compile(r"\{([a-z][a-z0-9_]{0,31})\}")
#: The longest value one parameter (or one list item) may have.
MAX_VALUE_CHARS = 256
MAX_LIST_ITEMS = 64
#: Query names boring-ui uses for parameters spelled otherwise here.
QUERY_ALIASES = {"allowedTools": "allowed_tools", "disallowedTools": "disallowed_tools"}
#: Query names that are the route's own, never template parameters.
ROUTE_QUERY = frozenset({"session_id", "resume", "force_new", "provider"})
#: A chat's dataplane command id: ``webchat.<template>.<user digest>.<random>``.
COMMAND_PREFIX = "webchat"


@dataclass(frozen=True)
class Parameter:
    """One named parameter of a template."""

    name: str
    #: A regular expression the whole value (each item of a list) must match.
    pattern: str | None = None
    #: The browser's values and the argument each one passes (instead of a pattern).
    choices: Mapping[str, str] | None = None
    #: An argument put before the value (``--model``), only when there is a value.
    flag: str | None = None
    #: The value used when the browser gives none (``None``: the parameter is left out).
    default: str | None = None
    #: A comma-separated list, passed as one argument (items joined by commas); ``list``
    #: in a TOML file.
    is_list: bool = False
    _compiled: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not PARAMETER_NAME.fullmatch(self.name):
            raise ConfigError(f"parameter name {self.name!r} is not [a-z][a-z0-9_]*")
        if (self.pattern is None) == (self.choices is None):
            raise ConfigError(f"parameter {self.name}: give exactly one of pattern and choices")
        compiled = None
        if self.pattern is not None:
            try:
                compiled = re.compile(self.pattern)
            except re.error as exc:
                raise ConfigError(f"parameter {self.name}: bad pattern ({exc})") from None
        object.__setattr__(self, "_compiled", compiled)
        if self.default is not None:
            self.arguments([self.default])

    def arguments(self, values: list[str]) -> list[str]:
        """The argv elements for ``values`` (one value, or a list's items); raises
        :class:`~sandlot.protocol.errors.InvalidRequest` naming the parameter, never
        repeating the value."""
        items: list[str] = []
        for value in values:
            items += [v.strip() for v in value.split(",")] if self.is_list else [value]
        items = [v for v in items if v]
        if not items:
            return []
        if len(items) > (MAX_LIST_ITEMS if self.is_list else 1):
            raise InvalidRequest(f"parameter {self.name}: too many values")
        passed = [self._check(v) for v in items]
        value = ",".join(passed)
        return [self.flag, value] if self.flag else [value]

    def _check(self, value: str) -> str:
        refused = InvalidRequest(
            f"parameter {self.name}: value not accepted", metadata={"parameter": self.name}
        )
        if len(value) > MAX_VALUE_CHARS or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise refused
        if self.choices is not None:
            if value not in self.choices:
                raise refused
            return self.choices[value]
        assert self._compiled is not None
        if not self._compiled.fullmatch(value):
            raise refused
        return value


@dataclass(frozen=True)
class ChatTemplate:
    """An agent program the chat may start: ``argv`` with ``{name}`` placeholders."""

    id: str
    argv: tuple[str, ...]
    parameters: Mapping[str, Parameter] = field(default_factory=dict)
    #: Environment set for the program (literal values only).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Its working directory in the sandbox (default: the workspace).
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not TEMPLATE_ID.fullmatch(self.id):
            raise ConfigError(f"template id {self.id!r} is not [a-z][a-z0-9_-]*")
        if not self.argv or _PLACEHOLDER.fullmatch(self.argv[0]):
            raise ConfigError(f"template {self.id}: argv must start with a program")
        for element in self.argv:
            if not isinstance(element, str):
                raise ConfigError(f"template {self.id}: argv elements are strings")
            placeholder = _PLACEHOLDER.fullmatch(element)
            if placeholder and placeholder.group(1) not in self.parameters:
                raise ConfigError(f"template {self.id}: {element} names no parameter")
            if not placeholder and ("{" in element or "}" in element):
                # A value is never spliced into an element: say so rather than pass it on.
                raise ConfigError(
                    f"template {self.id}: {element!r}: a placeholder is a whole element"
                )
        for name, parameter in self.parameters.items():
            if name != parameter.name:
                raise ConfigError(f"template {self.id}: parameter {name} is named {parameter.name}")
        for key, value in self.env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"template {self.id}: env maps names to strings")

    def build(self, values: Mapping[str, list[str]]) -> list[str]:
        """The argv for the browser's ``values`` (query name → values given)."""
        argv: list[str] = []
        for element in self.argv:
            placeholder = _PLACEHOLDER.fullmatch(element)
            if placeholder is None:
                argv.append(element)
                continue
            parameter = self.parameters[placeholder.group(1)]
            given = values.get(parameter.name) or []
            if not any(v.strip() for v in given) and parameter.default is not None:
                given = [parameter.default]
            argv += parameter.arguments(given)
        return argv

    def settings(self, values: Mapping[str, list[str]]) -> dict[str, Any]:
        """What the ``connected`` frame reports of the values used (the browser's own
        spelling, checked; never the argv)."""
        shown: dict[str, Any] = {"template": self.id}
        for name, parameter in self.parameters.items():
            given = [v for v in values.get(name) or [] if v.strip()]
            if not given and parameter.default is not None:
                given = [parameter.default]
            if given:
                parameter.arguments(given)
                shown[name] = ",".join(given) if parameter.is_list else given[0]
        return shown


@dataclass(frozen=True)
class ChatTemplates:
    """The templates the chat may start, by id, and the one used when none is named."""

    templates: Mapping[str, ChatTemplate]
    default: str

    def __post_init__(self) -> None:
        if self.default not in self.templates:
            raise ConfigError(f"the default chat template {self.default!r} is not defined")

    def get(self, template_id: str | None) -> ChatTemplate | None:
        return self.templates.get(template_id or self.default)


_TOOL = r"[A-Za-z][A-Za-z0-9_-]{0,63}(\([A-Za-z0-9 _.:*/@=+-]{0,128}\))?"

CLAUDE = ChatTemplate(
    id="claude",
    argv=(
        "claude",
        "-p",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "{model}",
        "{mode}",
        "{allowed_tools}",
        "{disallowed_tools}",
    ),
    parameters={
        "model": Parameter("model", pattern=r"[A-Za-z0-9][A-Za-z0-9._\[\]-]{0,99}", flag="--model"),
        "mode": Parameter(
            "mode",
            choices={"ask": "default", "act": "acceptEdits", "plan": "plan"},
            flag="--permission-mode",
            default="ask",
        ),
        "allowed_tools": Parameter(
            "allowed_tools", pattern=_TOOL, flag="--allowedTools", is_list=True
        ),
        "disallowed_tools": Parameter(
            "disallowed_tools", pattern=_TOOL, flag="--disallowedTools", is_list=True
        ),
    },
    env={"NO_COLOR": "1", "FORCE_COLOR": "0"},
)

DEFAULT_TEMPLATES = ChatTemplates({"claude": CLAUDE}, "claude")


def query_values(items: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """The browser's query as parameter name → values (boring-ui's aliases folded in;
    the route's own names left out)."""
    values: dict[str, list[str]] = {}
    for key, value in items:
        name = QUERY_ALIASES.get(key, key)
        if name not in ROUTE_QUERY:
            values.setdefault(name, []).append(value)
    return values


def load_chat_templates(path: Path | None) -> ChatTemplates:
    """The templates of a TOML file (see the module's docstring), or the built-in set
    when ``path`` is ``None``; any mistake is a :class:`ConfigError` naming it."""
    if path is None:
        return DEFAULT_TEMPLATES
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the chat templates {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"chat templates {path}: {exc}") from None
    raw = data.get("templates")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"chat templates {path}: no [templates.<id>] table")
    templates: dict[str, ChatTemplate] = {}
    for template_id, spec in raw.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("argv"), list):
            raise ConfigError(f"chat template {template_id}: argv must be a list of strings")
        parameters = {}
        for name, p in (spec.get("parameters") or {}).items():
            if not isinstance(p, dict):
                raise ConfigError(f"chat template {template_id}: parameter {name} is a table")
            known = {"pattern", "choices", "flag", "default", "list"}
            if unknown := set(p) - known:
                raise ConfigError(
                    f"chat template {template_id}: parameter {name}: unknown {sorted(unknown)}"
                )
            options = {("is_list" if k == "list" else k): v for k, v in p.items()}
            parameters[name] = Parameter(name, **options)
        unknown = set(spec) - {"argv", "parameters", "env", "cwd"}
        if unknown:
            raise ConfigError(f"chat template {template_id}: unknown {sorted(unknown)}")
        templates[template_id] = ChatTemplate(
            id=template_id,
            argv=tuple(spec["argv"]),
            parameters=parameters,
            env=dict(spec.get("env") or {}),
            cwd=spec.get("cwd"),
        )
    default = data.get("default", next(iter(templates)))
    return ChatTemplates(templates, str(default))


def user_digest(user: str) -> str:
    """A short digest of a user id, to find their chats among a sandbox's commands."""
    return hashlib.sha256(user.encode()).hexdigest()[:12]


def new_command_id(template_id: str, user: str) -> str:
    """The dataplane command id of a new chat of ``user`` with ``template_id``."""
    return f"{COMMAND_PREFIX}.{template_id}.{user_digest(user)}.{secrets.token_hex(6)}"


def chat_of(command_id: str | None, user: str) -> str | None:
    """The template id of a chat command of ``user`` (``None``: not one of theirs)."""
    if not command_id:
        return None
    parts = command_id.split(".")
    if len(parts) != 4 or parts[0] != COMMAND_PREFIX or parts[2] != user_digest(user):
        return None
    return parts[1]
