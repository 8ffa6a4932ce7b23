"""Shell figures of ``bench/dataplane_bench.py``: open, keystroke echo, command round trip,
crowds, many active shells, memory per attached client.

Contenders: ``sandlot serve`` (its ``default`` profile, ``/bin/bash -l``), the
stripped dataplane (``/bin/sh``), a local PTY running the served profile's
program (the physical limit), and jupyter_server's terminals running that
program too. A keystroke echo is ``stty raw -echo; cat`` answering one byte; a
command round trip is ``echo`` through the shell, to its output and the next
prompt, commands back to back.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import json
import os
import pty
import random
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

from jupyter_peer import JupyterServer
from measure import Row, checked
from served import Endpoint, Served, rss_mib
from targets import report

PROMPT = re.compile(r"[#$] $")


class Term:
    """A terminal a client types into and reads from."""

    async def send(self, data: str) -> None:
        raise NotImplementedError

    async def recv(self) -> str:
        """The next output chunk ("" for frames that carry none)."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def read_until(self, done: Callable[[str], bool], timeout: float = 15.0) -> str:
        seen = ""
        async with asyncio.timeout(timeout):
            while not done(seen):
                seen += await self.recv()
        return seen

    async def prompt(self) -> str:
        return await self.read_until(lambda s: PROMPT.search(s) is not None)

    async def drain(self, quiet: float = 0.2) -> None:
        with contextlib.suppress(TimeoutError):
            while True:
                await asyncio.wait_for(self.recv(), quiet)

    async def raw_cat(self) -> None:
        """Turn the terminal into a byte echo: every keystroke comes back as one chunk."""
        await self.send("stty raw -echo; cat\r")
        await asyncio.sleep(0.3)
        await self.drain()

    async def keystroke(self) -> float:
        t0 = time.perf_counter()
        await self.send("x")
        await self.read_until(lambda s: "x" in s)
        return time.perf_counter() - t0

    async def command(self, i: int) -> float:
        """``echo`` through the shell (line discipline echo on), until its output and the
        next prompt: how a tool that runs a command in a shell knows it finished."""
        want = f"a{i + 1}b\r\n"

        def finished(s: str) -> bool:
            at = s.find(want)
            return at >= 0 and PROMPT.search(s, at + len(want)) is not None

        t0 = time.perf_counter()
        await self.send(f"echo a$(({i}+1))b\r")
        await self.read_until(finished)
        return time.perf_counter() - t0


class SandlotTerm(Term):
    def __init__(self, ws: Any, ep: Endpoint, name: str) -> None:
        self.ws = ws
        self.ep = ep
        self.name = name

    @classmethod
    async def open(cls, ep: Endpoint, name: str, role: str = "driver") -> SandlotTerm:
        import websockets

        ws = await websockets.connect(
            f"{ep.ws_base}/shell/ws?session={name}&profile=default&role={role}",
            additional_headers=ep.headers,
            compression=None,
            max_size=None,
        )
        return cls(ws, ep, name)

    async def send(self, data: str) -> None:
        await self.ws.send(json.dumps({"type": "stdin", "data": data}))

    async def recv(self) -> str:
        msg = json.loads(await self.ws.recv())
        kind = msg.get("type")
        if kind in ("stdout", "history"):
            return str(msg.get("data", ""))
        if kind in ("exit", "error"):
            raise RuntimeError(f"shell: {msg}")
        return ""

    async def close(self) -> None:
        await self.ws.close()


class JupyterTerm(Term):
    def __init__(self, ws: Any, srv: JupyterServer, name: str) -> None:
        self.ws = ws
        self.srv = srv
        self.name = name

    @classmethod
    async def open(cls, srv: JupyterServer, name: str) -> JupyterTerm:
        return cls(await srv.terminal_socket(name), srv, name)

    async def send(self, data: str) -> None:
        await self.ws.send(json.dumps(["stdin", data]))

    async def recv(self) -> str:
        msg = json.loads(await self.ws.recv())
        if msg[0] == "stdout":
            return str(msg[1])
        if msg[0] == "disconnect":
            raise RuntimeError("terminal disconnected")
        return ""

    async def close(self) -> None:
        await self.ws.close()


#: An empty home for local shells: a login shell reads the system's profile only, as in
#: a sandbox (this host's root profile may run hooks at every prompt).
HOME = tempfile.mkdtemp(prefix="sandlot-bench-home-")
atexit.register(shutil.rmtree, HOME, True)
ENV = {"HOME": HOME, "TERM": "xterm", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


class LocalTerm(Term):
    """A PTY in this process running ``argv`` (with :data:`ENV`): the physical limit."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.execve(argv[0], argv, ENV)
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self.loop = asyncio.get_running_loop()
        self.chunks: list[str] = []
        self.wake = asyncio.Event()
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(self.fd)
            self.chunks.append("\x00EOF")
        else:
            self.chunks.append(data.decode(errors="replace"))
        self.wake.set()

    async def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    async def recv(self) -> str:
        while not self.chunks:
            self.wake.clear()
            await self.wake.wait()
        out = "".join(self.chunks)
        self.chunks.clear()
        if "\x00EOF" in out:
            raise RuntimeError("local pty closed")
        return out

    async def close(self) -> None:
        self.loop.remove_reader(self.fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)  # noqa: ASYNC222 (killed: reaped at once)
        os.close(self.fd)


async def wait_flooded(c: Any, ep: Endpoint, names: list[str], size: int) -> None:
    """Until every named shell has printed ``size`` bytes and the output stopped growing."""
    last: dict[str, int] = {}
    async with asyncio.timeout(120):
        while True:
            r = checked(await c.get(f"{ep.base}/shells"))
            now = {s["name"]: s["offset"] for s in r.json()["shells"] if s["name"] in names}
            if len(now) == len(names) and min(now.values()) >= size and now == last:
                return
            last = now
            await asyncio.sleep(0.5)


class Shells:
    """The contenders of the shell rows and how to open, drive and dispose of them."""

    def __init__(
        self,
        served: Served,
        ep: Endpoint,
        stripped: Endpoint | None,
        stripped_cold: Endpoint | None,
        jup: JupyterServer | None,
        jup_nd: JupyterServer | None,
    ) -> None:
        self.served, self.ep = served, ep
        self.stripped, self.stripped_cold = stripped, stripped_cold
        self.jup, self.jup_nd = jup, jup_nd
        #: An async httpx client per sandbox id.
        self.clients: dict[str, Any] = {}
        self.jc = jup.async_client() if jup else None
        self.jnc = jup_nd.async_client() if jup_nd else None

    def http(self, ep: Endpoint) -> Any:
        key = f"{ep.sandbox.id}@{ep.base}"
        if key not in self.clients:
            self.clients[key] = ep.async_httpx()
        return self.clients[key]

    async def dispose(self, t: Term) -> None:
        """Close the client and remove the shell or terminal itself."""
        await t.close()
        if isinstance(t, SandlotTerm):
            checked(await self.http(t.ep).delete(f"{t.ep.base}/shells/{t.name}"))
        elif isinstance(t, JupyterTerm):
            cl = self.jc if t.srv is self.jup else self.jnc
            assert cl is not None
            await t.srv.delete_terminal(cl, t.name)

    async def open_all(self, tag: str) -> list[tuple[str, Term]]:
        """One terminal of each kind, at its prompt: (the Row attribute its samples go to,
        terminal)."""
        out: list[tuple[str, Term]] = []
        for kind, ep in (("sandlot", self.ep), ("stripped", self.stripped)):
            if ep is not None:
                st = await SandlotTerm.open(ep, tag)
                await st.prompt()
                out.append((kind, st))
        lt = LocalTerm(self.ep.shell)
        await lt.prompt()
        out.append(("direct", lt))
        for kind, srv, cl in (
            ("jupyter", self.jup, self.jc),
            ("jupyter_nodelay", self.jup_nd, self.jnc),
        ):
            if srv is None or cl is None:
                continue
            jt = await JupyterTerm.open(srv, await srv.new_terminal(cl))
            await jt.prompt()
            out.append((kind, jt))
        return out

    async def aclose(self) -> None:
        for cl in (*self.clients.values(), self.jc, self.jnc):
            if cl is not None:
                await cl.aclose()


async def open_rows(sh: Shells, n: int, order: random.Random) -> list[Row]:
    """Open to first prompt, with the spare shell the dataplane keeps, and without one."""

    async def open_on(ep: Endpoint, i: int) -> float:
        t0 = time.perf_counter()
        st = await SandlotTerm.open(ep, f"open{i}")
        await st.prompt()
        took = time.perf_counter() - t0
        await sh.dispose(st)
        return took

    async def open_local(i: int) -> float:
        t0 = time.perf_counter()
        lt = LocalTerm(sh.ep.shell)
        await lt.prompt()
        took = time.perf_counter() - t0
        await lt.close()
        return took

    def open_jupyter(srv: JupyterServer, cl: Any) -> Callable[[int], Any]:
        async def run(i: int) -> float:
            t0 = time.perf_counter()
            name = await srv.new_terminal(cl)
            jt = await JupyterTerm.open(srv, name)
            await jt.prompt()
            took = time.perf_counter() - t0
            await jt.close()
            await srv.delete_terminal(cl, name)
            return took

        return run

    opens = Row("shell open to first prompt (`/shell/ws`; jupyter: POST /api/terminals + socket)")
    openers: list[tuple[list[float], Callable[[int], Any]]] = [
        (opens.sandlot, lambda i: open_on(sh.ep, i)),
        (opens.direct, open_local),
    ]
    if sh.stripped is not None:
        stripped = sh.stripped
        openers.append((opens.stripped, lambda i: open_on(stripped, i)))
    for srv, cl, out in (
        (sh.jup, sh.jc, opens.jupyter),
        (sh.jup_nd, sh.jnc, opens.jupyter_nodelay),
    ):
        if srv is not None and cl is not None:
            openers.append((out, open_jupyter(srv, cl)))
    for i in range(max(40, n // 5)):
        # A new order each round: a terminal's teardown lingers into whatever comes next.
        order.shuffle(openers)
        for samples, opener in openers:
            samples.append(await opener(i))

    # Without a spare: the first shell of a sandbox (served: a new sandbox each time, made
    # and terminated outside the timing; stripped: a second dataplane with spares off).
    cold = Row("shell open without a spare (the first shell of a sandbox)")

    async def first_shell(i: int) -> float:
        fresh = await asyncio.to_thread(sh.served.ensure, f"first-shell-{i}")
        try:
            return await open_on(fresh, i)
        finally:
            await asyncio.to_thread(sh.served.release, fresh)

    pair: list[tuple[list[float], Callable[[int], Any]]] = [
        (cold.sandlot, first_shell),
        (cold.direct, open_local),
    ]
    if sh.stripped_cold is not None:
        stripped_cold = sh.stripped_cold
        pair.append((cold.stripped, lambda i: open_on(stripped_cold, i)))
    for i in range(max(20, n // 10)):
        order.shuffle(pair)
        for samples, opener in pair:
            samples.append(await opener(i))
    return [opens, cold]


async def shell_rows(
    sh: Shells,
    n: int,
    *,
    crowd: int,
    active: int,
    active_rounds: int,
    active_each: int,
) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    rows += await open_rows(sh, n, random.Random(20261123))

    # Keystroke echo and command round trip, one session of each kind, interleaved.
    echo = Row("shell keystroke echo (`/shell/ws` vs local PTY; jupyter: terminal socket)")
    terms = await sh.open_all("echo")
    for _, t in terms:
        await t.raw_cat()
    for _ in range(n):
        for kind, t in terms:
            getattr(echo, kind).append(await t.keystroke())
    rows.append(echo)
    echo_terms = terms

    cmd = Row("shell command round trip (`echo`, to its output and the next prompt)")
    terms = await sh.open_all("cmd")
    for i in range(10):
        for _, t in terms:
            await t.command(100_000 + i)
    for i in range(n):
        for kind, t in terms:
            getattr(cmd, kind).append(await t.command(i))
    rows.append(cmd)
    for _, t in terms:
        await sh.dispose(t)

    # Keystroke echo on one shell while `crowd` other shells are open and flooding unread clients.
    ep = sh.ep
    notes.append(f"server RSS idle (`sandlot serve`, one sandbox): {rss_mib(ep.pid):.0f} MiB")
    if sh.stripped is not None:
        notes.append(f"server RSS idle (stripped dataplane): {rss_mib(sh.stripped.pid):.0f} MiB")
    crowded = Row(f"shell keystroke echo, {crowd} other shells open (flooding unread clients)")
    others = [await SandlotTerm.open(ep, f"crowd{i}") for i in range(crowd)]
    for t in others:
        await t.send("head -c 2000000 /dev/zero | tr '\\0' y\n")
    await wait_flooded(sh.http(ep), ep, [f"crowd{i}" for i in range(crowd)], 2_000_000)
    notes.append(
        f"server RSS with {crowd} shells flooding unread clients: {rss_mib(ep.pid):.0f} MiB"
    )
    st = next(t for kind, t in echo_terms if kind == "sandlot")
    lt = next(t for kind, t in echo_terms if kind == "direct")
    await st.drain(0.1)
    for _ in range(n):
        crowded.sandlot.append(await st.keystroke())
        crowded.direct.append(await lt.keystroke())
    rows.append(crowded)
    for t in others:
        await sh.dispose(t)
    for _, t in echo_terms:
        await sh.dispose(t)

    # `active` shells all driven at once, back to back, by `active` concurrent clients.
    busy = Row(f"shell keystroke echo, {active} shells all active ({active} concurrent clients)")
    groups: dict[str, list[Term]] = {"sandlot": [], "direct": [], "jupyter": []}
    for i in range(active):
        groups["sandlot"].append(await SandlotTerm.open(ep, f"active{i}"))
        groups["direct"].append(LocalTerm(ep.shell))
        if sh.jup is not None and sh.jc is not None:
            groups["jupyter"].append(
                await JupyterTerm.open(sh.jup, await sh.jup.new_terminal(sh.jc))
            )
    for group in groups.values():
        await asyncio.gather(*(t.prompt() for t in group))
        await asyncio.gather(*(t.raw_cat() for t in group))

    async def drive(t: Term, out: list[float]) -> None:
        for _ in range(active_each):
            out.append(await t.keystroke())

    walls: dict[str, list[float]] = {k: [] for k in groups}
    for _ in range(active_rounds):
        for kind, group in groups.items():
            if not group:
                continue
            t0 = time.perf_counter()
            await asyncio.gather(*(drive(t, getattr(busy, kind)) for t in group))
            walls[kind].append(time.perf_counter() - t0)
    rows.append(busy)
    for kind, group in groups.items():
        if group:
            total = active * active_each * active_rounds
            rate = total / sum(walls[kind])
            notes.append(
                f"{active} shells all active, {kind}: {total} keystrokes, "
                f"{rate:.0f} echoes/s in all"
            )
    for group in groups.values():
        for t in group:
            await sh.dispose(t)
    return rows, notes


async def memory_per_client(sh: Shells, attached: int) -> list[str]:
    """Server RSS delta / clients for ``attached`` clients on one shell.

    Runs first, on servers that have not served anything big yet, so that the
    allocator has no freed memory to hand out again and hide the cost.
    """
    notes: list[str] = []
    ep, jup, jc = sh.ep, sh.jup, sh.jc
    for kind in ("sandlot", "jupyter_server"):
        if kind == "jupyter_server" and (jup is None or jc is None):
            continue
        jname = ""
        if kind == "sandlot":
            owner: Term = await SandlotTerm.open(ep, "mem")
            pid = ep.pid
        else:
            assert jup is not None and jc is not None
            jname = await jup.new_terminal(jc)
            owner = await JupyterTerm.open(jup, jname)
            pid = jup.pid
        await owner.prompt()
        await asyncio.sleep(1)
        before = rss_mib(pid)
        clients: list[Term] = []
        for _ in range(attached):
            if kind == "sandlot":
                clients.append(await SandlotTerm.open(ep, "mem", role="observer"))
            else:
                assert jup is not None
                clients.append(await JupyterTerm.open(jup, jname))
        # Output reaches every client: each has read 49 KiB through its socket.
        await owner.send("seq 1 10000\r")
        await asyncio.gather(
            *(t.read_until(lambda s: "9999\r\n10000" in s) for t in [owner, *clients])
        )
        await asyncio.sleep(1)
        after = rss_mib(pid)
        if kind == "sandlot":
            per = (after - before) / attached
            report(
                "dataplane",
                f"memory bounded with {attached} clients attached to one shell",
                f"{per:.3f} MiB per client (RSS {before:.0f} → {after:.0f} MiB)",
                per <= 1.0,
                "per-client socket buffers",
            )
        notes.append(
            f"memory per attached client, {kind}: {(after - before) / attached:.3f} MiB "
            f"(server RSS {before:.1f} → {after:.1f} MiB with {attached} clients on one shell)"
        )
        for t in [owner, *clients]:
            await t.close()
        if kind == "sandlot":
            checked(await sh.http(ep).delete(f"{ep.base}/shells/mem"))
        else:
            assert jup is not None and jc is not None
            await jup.delete_terminal(jc, jname)
    return notes
