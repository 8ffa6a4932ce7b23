"""``sandlot session|sandbox|template|pool|audit``: the control plane from a terminal."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import typer

from sandlot.cli.client import Target, print_json, print_mapping, print_table, run, target_of
from sandlot.cli.context import JsonOption, KeyOption, SandboxOption, UrlOption
from sandlot.cli.errors import fail
from sandlot.sdk import AsyncSandlot

session_app = typer.Typer(
    help="Negotiate, inspect and release a thread's session.", no_args_is_help=True
)
sandbox_app = typer.Typer(help="Your sandboxes, bound to a thread or not.", no_args_is_help=True)
template_app = typer.Typer(
    help="Sandbox templates (creating one needs an admin).", no_args_is_help=True
)
pool_app = typer.Typer(help="Warm pools of ready sandboxes (admins).", no_args_is_help=True)

ThreadArg = typer.Argument(
    ..., help="A thread id (or a session id ssn_… where a session is meant)."
)


def _grant_view(grant: dict[str, Any]) -> dict[str, Any]:
    binding = grant.get("binding") or {}
    return {
        "session_id": grant.get("session_id"),
        "scope": f"{binding.get('scope', {}).get('type')}:{binding.get('scope', {}).get('id')}",
        "sandbox_id": (grant.get("sandbox") or {}).get("id"),
        "state": binding.get("state"),
        "dataplane": (grant.get("dataplane") or {}).get("http_base_url"),
        "capabilities": ", ".join((grant.get("credentials") or {}).get("granted_capabilities", [])),
        "token_expires_at": grant.get("expires_at"),
        "lease_expires_at": binding.get("lease_expires_at"),
    }


OptionalThreadArg = typer.Argument(
    None,
    metavar="[THREAD]",
    help="A thread id or a session id ssn_… (or --sandbox ID).",
    show_default=False,
)


async def _session_id(client: AsyncSandlot, target: Target) -> str:
    """The session a command means: a session id as given, else the thread's or the
    sandbox's (attached, never created)."""
    if target.sandbox_id is not None:
        sandbox = await client.attach_sandbox(target.sandbox_id, wait=False)
    else:
        assert target.thread is not None
        if target.thread.startswith("ssn_"):
            return target.thread
        sandbox = await client.get(target.thread, wait=False)
    assert sandbox.grant.session_id is not None
    return sandbox.grant.session_id


@session_app.command("ensure", epilog="Example: sandlot session ensure thr_1 --json")
def session_ensure(
    thread: str = ThreadArg,
    template: str = typer.Option(None, help="Template of a new sandbox."),
    capability: list[str] = typer.Option(
        None, "--cap", help="Request this capability (repeatable)."
    ),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Return once the sandbox is active."),
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Attach to the thread's sandbox, creating it if needed, and print the grant."""

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        sandbox = await client.ensure(
            thread, template=template, capabilities=capability or None, wait=wait
        )
        return dict(sandbox.grant.raw)

    grant = run(url, api_key, body, auto_refresh=False)
    print_json(grant) if as_json else print_mapping(_grant_view(grant))


@session_app.command(
    "get",
    epilog=(
        "Example: sandlot session get thr_1   "
        "(a sandbox by id: sandlot session get --sandbox sb_123)"
    ),
)
def session_get(
    thread: str | None = typer.Argument(
        None, metavar="[THREAD]", help="A thread id (or --sandbox ID).", show_default=False
    ),
    sandbox_id: str | None = SandboxOption,
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Attach to the thread's existing sandbox, or a sandbox by id (never creates one), and
    print the grant."""
    target = target_of(thread, sandbox_id)

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        if target.sandbox_id is not None:
            return dict((await client.attach_sandbox(target.sandbox_id, wait=False)).grant.raw)
        assert target.thread is not None
        return dict((await client.get(target.thread, wait=False)).grant.raw)

    grant = run(url, api_key, body, auto_refresh=False)
    print_json(grant) if as_json else print_mapping(_grant_view(grant))


@session_app.command("refresh", epilog="Example: sandlot session refresh thr_1 --json")
def session_refresh(
    thread: str | None = OptionalThreadArg,
    sandbox_id: str | None = SandboxOption,
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Get a fresh token for the session."""
    target = target_of(thread, sandbox_id)

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        return (await client.refresh(await _session_id(client, target))).to_dict()

    data = run(url, api_key, body, auto_refresh=False)
    print_json(data) if as_json else print_mapping({"token_expires_at": data.get("expires_at")})


@session_app.command("heartbeat", epilog="Example: sandlot session heartbeat thr_1")
def session_heartbeat(
    thread: str | None = OptionalThreadArg,
    sandbox_id: str | None = SandboxOption,
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Extend your lease on the session (keeps the sandbox from going idle)."""
    target = target_of(thread, sandbox_id)

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        return (await client.heartbeat(await _session_id(client, target))).to_dict()

    data = run(url, api_key, body, auto_refresh=False)
    print_json(data) if as_json else print_mapping(data)


@session_app.command("release", epilog="Example: sandlot session release thr_1 --terminate")
def session_release(
    thread: str | None = OptionalThreadArg,
    sandbox_id: str | None = SandboxOption,
    terminate: bool = typer.Option(
        False, "--terminate", help="Tear the sandbox down for everyone (owner only)."
    ),
    wait: bool = typer.Option(
        True, "--wait/--no-wait", help="With --terminate: return once the sandbox is gone."
    ),
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Detach from the session (your tokens are revoked); --terminate ends the sandbox."""
    target = target_of(thread, sandbox_id)

    async def body(client: AsyncSandlot, _: Any) -> tuple[str, str]:
        sid = await _session_id(client, target)
        snap = await client.release(sid, terminate=terminate, wait=wait)
        if not terminate:
            return sid, "released"
        assert snap is not None  # a teardown always answers with the binding's snapshot
        return sid, snap.binding.state

    sid, state = run(url, api_key, body, auto_refresh=False)
    typer.echo(f"{state} {sid}")


SANDBOX_COLUMNS = ["id", "name", "template", "state", "scope", "created_at"]


@sandbox_app.command("list", epilog="Example: sandlot sandbox list --all")
def sandbox_list(
    include_ended: bool = typer.Option(False, "--all", help="Include terminated sandboxes."),
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """List your sandboxes."""

    async def body(client: AsyncSandlot, _: Any) -> list[dict[str, Any]]:
        return [s.to_dict() for s in await client.list_sandboxes(include_ended=include_ended)]

    rows = run(url, api_key, body)
    print_json(rows) if as_json else print_table(rows, SANDBOX_COLUMNS, empty="no sandboxes")


@sandbox_app.command(
    "create", epilog="Example: sandlot sandbox create --name scratch --template default"
)
def sandbox_create(
    name: str = typer.Option(None, help="A name (unique among your live sandboxes)."),
    template: str = typer.Option(None, help="Template (default: the server's default)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Return once it is active."),
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Create a sandbox that serves no thread."""

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        return (await client.create_sandbox(template=template, name=name, wait=wait)).to_dict()

    data = run(url, api_key, body)
    print_json(data) if as_json else print_mapping({k: data.get(k) for k in SANDBOX_COLUMNS})


def _sandbox_action(action: str, help_text: str) -> None:
    @sandbox_app.command(
        action, help=help_text, epilog=f"Example: sandlot sandbox {action} sb_0123abcd"
    )
    def command(
        sandbox_id: str = typer.Argument(..., help="The sandbox id (sb_…)."),
        as_json: bool = JsonOption,
        url: str = UrlOption,
        api_key: str = KeyOption,
    ) -> None:
        async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
            if action == "get":
                return (await client.get_sandbox(sandbox_id)).to_dict()
            if action == "suspend":
                return (await client.suspend_sandbox(sandbox_id)).to_dict()
            return (await client.resume_sandbox(sandbox_id)).to_dict()

        data = run(url, api_key, body)
        print_json(data) if as_json else print_mapping({k: data.get(k) for k in SANDBOX_COLUMNS})


@sandbox_app.command("delete", epilog="Example: sandlot sandbox delete sb_0123abcd --no-wait")
def sandbox_delete(
    sandbox_id: str = typer.Argument(..., help="The sandbox id (sb_…)."),
    wait: bool = typer.Option(
        True, "--wait/--no-wait", help="Return once it is gone, not once the teardown is accepted."
    ),
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Terminate a sandbox now (its processes are killed, its files removed)."""

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        return (await client.delete_sandbox(sandbox_id, wait=wait)).to_dict()

    data = run(url, api_key, body)
    if as_json:
        print_json(data)
        return
    done = data.get("state") == "terminated"
    typer.echo(f"{'deleted' if done else 'terminating'} {sandbox_id}")


for _action, _help in (
    ("get", "Show one sandbox."),
    ("suspend", "Freeze a sandbox's processes (files and processes are kept)."),
    ("resume", "Thaw a suspended sandbox."),
):
    _sandbox_action(_action, _help)


def _load_spec(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise fail(f"cannot read {path}: {exc.strerror}", 2) from None
    try:
        return dict(json.loads(text) if path.suffix == ".json" else tomllib.loads(text))
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise fail(
            f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}", 2
        ) from None


@template_app.command("list", epilog="Example: sandlot template list")
def template_list(
    as_json: bool = JsonOption, url: str = UrlOption, api_key: str = KeyOption
) -> None:
    """List templates."""

    async def body(client: AsyncSandlot, _: Any) -> list[dict[str, Any]]:
        return [t.to_dict() for t in await client.list_templates()]

    rows = run(url, api_key, body)
    if as_json:
        print_json(rows)
    else:
        for row in rows:
            res = row.get("resources") or {}
            row["limits"] = (
                f"cpu {res.get('cpu')}, {res.get('memory_mb')} MiB, {res.get('pids')} pids"
            )
        print_table(rows, ["name", "image", "network", "limits"], empty="no templates")


@template_app.command("get", epilog="Example: sandlot template get default")
def template_get(
    name: str = typer.Argument(...), url: str = UrlOption, api_key: str = KeyOption
) -> None:
    """Show a template as JSON."""

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        return (await client.get_template(name)).to_dict()

    print_json(run(url, api_key, body))


@template_app.command(
    "create", epilog="Example: sandlot template create py.toml   (keys as in [templates.NAME])"
)
def template_create(
    spec: Path = typer.Argument(
        ..., help="A TOML or JSON file with the template (name, image, resources, …)."
    ),
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Create a template from a file."""
    data = _load_spec(spec)

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        return (await client.create_template(data)).to_dict()

    print_json(run(url, api_key, body))


@template_app.command("delete", epilog="Example: sandlot template delete py")
def template_delete(
    name: str = typer.Argument(...), url: str = UrlOption, api_key: str = KeyOption
) -> None:
    """Delete a template (not one from the server's configuration)."""

    async def body(client: AsyncSandlot, _: Any) -> None:
        await client.delete_template(name)

    run(url, api_key, body)
    typer.echo(f"deleted template {name}")


@pool_app.command("list", epilog="Example: sandlot pool list")
def pool_list(as_json: bool = JsonOption, url: str = UrlOption, api_key: str = KeyOption) -> None:
    """List warm pools with their ready and provisioning counts."""

    async def body(client: AsyncSandlot, _: Any) -> list[dict[str, Any]]:
        return [p.to_dict() for p in await client.list_pools()]

    rows = run(url, api_key, body)
    print_json(rows) if as_json else print_table(
        rows,
        ["name", "template", "min_ready", "max_ready", "ready", "provisioning"],
        empty="no pools",
    )


@pool_app.command(
    "create", epilog="Example: sandlot pool create warm --template default --min-ready 2"
)
def pool_create(
    name: str = typer.Argument(...),
    template: str = typer.Option(..., help="The template the pool keeps ready."),
    min_ready: int = typer.Option(1, help="Sandboxes kept ready."),
    max_ready: int = typer.Option(4, help="At most this many ready."),
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Create a warm pool (admins)."""

    async def body(client: AsyncSandlot, _: Any) -> dict[str, Any]:
        pool = await client.create_pool(name, template, min_ready=min_ready, max_ready=max_ready)
        return pool.to_dict()

    print_json(run(url, api_key, body))


@pool_app.command("delete", epilog="Example: sandlot pool delete warm")
def pool_delete(
    name: str = typer.Argument(...), url: str = UrlOption, api_key: str = KeyOption
) -> None:
    """Delete a pool and its unclaimed sandboxes (admins)."""

    async def body(client: AsyncSandlot, _: Any) -> None:
        await client.delete_pool(name)

    run(url, api_key, body)
    typer.echo(f"deleted pool {name}")


def audit_command(
    scope: str = typer.Option(None, help="Only this scope, e.g. thread:thr_1."),
    actor: str = typer.Option(None, help="Only this principal id, e.g. agent:alice."),
    after: int = typer.Option(0, help="Only entries after this id."),
    limit: int = typer.Option(100, help="At most this many entries."),
    as_json: bool = JsonOption,
    url: str = UrlOption,
    api_key: str = KeyOption,
) -> None:
    """Who did what, when, to which sandbox (admins)."""

    async def body(client: AsyncSandlot, _: Any) -> list[dict[str, Any]]:
        entries = await client.audit(scope=scope, actor=actor, after=after, limit=limit)
        return [e.to_dict() for e in entries]

    rows = run(url, api_key, body)
    if as_json:
        print_json(rows)
        return
    for row in rows:
        row["who"] = (row.get("actor") or {}).get("id") or row.get("principal_id")
    print_table(
        rows,
        ["id", "timestamp", "who", "action", "outcome", "scope", "sandbox_id"],
        empty="no entries",
    )
