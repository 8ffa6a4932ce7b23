"""Dataplane latency as users get it, side by side with the direct operation and jupyter_server.

Run: ``.venv/bin/python bench/dataplane_bench.py [--n 300] [--no-jupyter] [--no-stripped]``

Measures a real ``sandlot serve`` (``bench/served.py``: isolated sandboxes when
root, the broker in process, the shipped ``default`` template and its
``/bin/bash -l`` shells, file watching on), one sandbox from ``ensure``, through
the SDK (``sandlot.sdk.Sandbox``), through a stock httpx client and through a
minimal raw-socket client (the server's own latency). Beside it: the *stripped*
dataplane (standalone, unisolated, no watcher, ``/bin/sh``: the configuration
of earlier published figures) through the SDK, as a labelled column; the same
operation done directly in this process on the sandbox's own files; and
jupyter_server twice on loopback (stock, and with TCP_NODELAY forced on its
sockets; root directory = a copy of the same workspace, see
``bench/jupyter_peer.py``). HTTP operations are sampled in interleaved blocks
(``bench/measure.py``); shells are in ``bench/dataplane_shells.py``.

Every target is evaluated on ``sandlot serve`` through the SDK. Where one is
missed, what limits it is measured in the same run: the server's own time per
request (its ``/metrics``), the direct operation, the raw client, the stripped
dataplane.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dataplane_shells import Shells, memory_per_client, shell_rows
from jupyter_peer import JupyterServer
from measure import Row, checked, interleave, ms, ratio, stats, timed
from served import STRIPPED, STRIPPED_WHAT, Endpoint, Served, Standalone, metric_sums
from targets import report

#: What the direct operation of each HTTP row is (for "what limits it").
DIRECT = {
    "4 KiB read": "`read`",
    "4 KiB write, durable": "tmp + fsync + rename",
    "1 MiB read": "`read`",
    "list 1,000 files": "`scandir` + `stat`",
    "exec `true`": "`subprocess.run`",
}

#: Route of each HTTP row on the server's ``/metrics`` (its own time per request).
ROUTES = {
    "4 KiB read": ("GET", "/fs/read"),
    "4 KiB write, durable": ("PUT", "/fs/write"),
    "1 MiB read": ("GET", "/files/download"),
    "list 1,000 files": ("GET", "/fs/list"),
    "exec `true`": ("POST", "/exec"),
}


def print_table(rows: list[Row]) -> None:
    print(
        "| operation | sandlot (SDK) median | p99 | sandlot via httpx median | p99 "
        f"| sandlot, raw HTTP client median | {STRIPPED} (SDK) median "
        "| direct median | p99 | jupyter_server median | p99 | sandlot ÷ direct "
        "| sandlot ÷ jupyter |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def pair(samples: list[float]) -> list[str]:
        if not samples:
            return ["-", "-"]
        med, tail = stats(samples)
        return [ms(med), ms(tail)]

    for row in rows:
        am, _ = stats(row.sandlot)
        bm, _ = stats(row.direct)
        cells = [row.name, *pair(row.sandlot), *pair(row.httpx)]
        cells.append(ms(stats(row.raw)[0]) if row.raw else "-")
        cells.append(ms(stats(row.stripped)[0]) if row.stripped else "-")
        cells += [*pair(row.direct), *pair(row.jupyter)]
        cells.append(ratio(am, bm))
        cells.append(ratio(am, stats(row.jupyter)[0]) if row.jupyter else "-")
        print("| " + " | ".join(cells) + " |")


# --- the workspace -------------------------------------------------------------------------


def make_workspace(ws: Path) -> str:
    small = os.urandom(3072).hex()[:4096]
    (ws / "small.txt").write_text(small)
    (ws / "big.bin").write_bytes(os.urandom(1 << 20))
    (ws / "many").mkdir()
    for i in range(1000):
        (ws / "many" / f"f{i:04d}.txt").write_text("x")
    tree = ws / "tree"
    for i in range(1000):
        d = tree / f"d{i % 20}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.py").write_text(("def f():\n    return 1\n" * 200) + f"# needle {i}\n")
    return small


def place(src: Path, ws: Path) -> None:
    """Copy the workspace's files into a sandbox's ``/workspace`` (as its owner)."""
    shutil.copytree(src, ws, dirs_exist_ok=True)
    owner = ws.stat()
    for here, dirs, files in os.walk(ws):
        for name in [*dirs, *files]:
            os.chown(os.path.join(here, name), owner.st_uid, owner.st_gid)


# --- HTTP operations -----------------------------------------------------------------------


def http_rows(
    ep: Endpoint,
    stripped: Endpoint | None,
    small: str,
    n: int,
    jup: JupyterServer | None,
    jup_nd: JupyterServer | None,
    budget: float,
) -> tuple[list[Row], list[str], dict[str, float]]:
    """The HTTP rows, notes, and the server's own mean time per request of each row (ms)."""
    notes: list[str] = []
    sb, c, raw, base, ws_dir = ep.sandbox, ep.httpx(), ep.raw(), ep.base, ep.workspace
    ssb = stripped.sandbox if stripped else None
    jc = jup.client() if jup else None
    jnc = jup_nd.client() if jup_nd else None
    kernel = jup.start_kernel(jc) if jup and jc else None
    kernel_nd = jup_nd.start_kernel(jnc) if jup_nd and jnc else None

    def direct_write() -> None:
        tmpf = ws_dir / ".w.tmp"
        fd = os.open(tmpf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, small.encode())
        os.fsync(fd)
        os.close(fd)
        os.rename(tmpf, ws_dir / "w.txt")

    put_body = {"type": "file", "format": "text", "content": small}
    true_code = "import subprocess; subprocess.run(['true'])"
    write_body = json.dumps({"path": "w.txt", "content": small}).encode()
    # (name, SDK on a sandbox, httpx, raw client, direct, jupyter, jupyter NODELAY)
    ops: list[tuple[str, Callable[[Any], Any], Any, Any, Any, Any, Any]] = [
        (
            "4 KiB read (`/fs/read`; jupyter: contents GET)",
            lambda s: s.read("small.txt"),
            lambda: checked(c.get(f"{base}/fs/read", params={"path": "small.txt"})),
            lambda: raw.request("GET", "/fs/read?path=small.txt"),
            lambda: (ws_dir / "small.txt").read_text(),
            jc
            and (
                lambda: checked(
                    jc.get("/api/contents/small.txt", params={"type": "file", "format": "text"})
                )
            ),
            None,
        ),
        (
            "4 KiB write, durable (`/fs/write`; jupyter: contents PUT)",
            lambda s: s.write("w.txt", small),
            lambda: checked(c.put(f"{base}/fs/write", json={"path": "w.txt", "content": small})),
            lambda: raw.request("PUT", "/fs/write", write_body),
            direct_write,
            jc and (lambda: checked(jc.put("/api/contents/w.txt", json=put_body))),
            None,
        ),
        (
            "1 MiB read (`/files/download`; jupyter: contents GET, base64)",
            lambda s: s.download("big.bin"),
            lambda: checked(c.get(f"{base}/files/download", params={"path": "big.bin"})),
            lambda: raw.request("GET", "/files/download?path=big.bin"),
            lambda: (ws_dir / "big.bin").read_bytes(),
            jc
            and (
                lambda: checked(
                    jc.get("/api/contents/big.bin", params={"type": "file", "format": "base64"})
                )
            ),
            None,
        ),
        (
            "list 1,000 files (`/fs/list`; jupyter: contents GET of the directory)",
            lambda s: s.ls("many"),
            lambda: checked(c.get(f"{base}/fs/list", params={"path": "many"})),
            lambda: raw.request("GET", "/fs/list?path=many"),
            lambda: [e.stat() for e in os.scandir(ws_dir / "many")],
            jc and (lambda: checked(jc.get("/api/contents/many", params={"type": "directory"}))),
            None,
        ),
        (
            "exec `true` (`/exec`; jupyter: kernel runs `subprocess.run(['true'])`)",
            lambda s: s.exec(["true"]),
            lambda: checked(c.post(f"{base}/exec", json={"command": ["true"]})),
            lambda: raw.request("POST", "/exec", b'{"command": ["true"]}'),
            lambda: subprocess.run(["true"], check=True),
            kernel and (lambda: kernel.execute(true_code)),
            kernel_nd and (lambda: kernel_nd.execute(true_code)),
        ),
    ]
    rows = []
    rng = random.Random(20261123)
    served_time: dict[str, float] = {}
    for name, via, via_httpx, via_raw, direct, peer, peer_nd in ops:
        row = Row(name)
        contenders: list[tuple[list[float], Callable[[], Any], int]] = [
            (row.sandlot, lambda via=via: via(sb), 1),
            (row.httpx, via_httpx, 1),
            (row.raw, via_raw, 1),
            (row.direct, direct, 1),
        ]
        if ssb is not None:
            contenders.append((row.stripped, lambda via=via: via(ssb), 1))
        # The peer's share of the time budget decides how often it is sampled.
        if peer:
            warm = [timed(peer) for _ in range(3)][-1]
            if peer_nd:
                warm += [timed(peer_nd) for _ in range(3)][-1]
            every = max(1, math.ceil(n * warm / budget))
            if every > 1:
                notes.append(
                    f"{name}: jupyter sampled in 1 of every {every} rounds "
                    f"({math.ceil(n / 10 / every) * 10} samples) to bound the run time."
                )
            contenders.append((row.jupyter, peer, every))
            if peer_nd:
                contenders.append((row.jupyter_nodelay, peer_nd, every))
        method, route = ROUTES[row.short]
        labels = {"method": method, "route": route}
        url = base.split("/dp/")[0]
        before = metric_sums(url, "sandlot_dataplane_request_duration_seconds", labels)
        interleave(contenders, n, rng)
        after = metric_sums(url, "sandlot_dataplane_request_duration_seconds", labels)
        if after[1] > before[1]:
            served_time[row.short] = (after[0] - before[0]) / (after[1] - before[1]) * 1000
        rows.append(row)
    for k, kc in ((kernel, jc), (kernel_nd, jnc)):
        if k is not None and kc is not None:
            k.close(kc)
    for cl in (jc, jnc):
        if cl is not None:
            cl.close()
    ep.close()
    return rows, notes, served_time


# --- grep and transfers --------------------------------------------------------------------


def grep_row(ep: Endpoint, stripped: Endpoint | None, n: int) -> Row:
    from sandlot.dataplane.services.grep import ripgrep_path

    rg = ripgrep_path() or "rg"
    argv = [rg, "--no-heading", "-n", "--null", "--hidden", "--no-ignore", "-F", "needle"]
    argv.append(str(ep.workspace / "tree"))
    row = Row("grep a 1,000-file tree (`/fs/grep` vs `rg`)")
    sides: list[tuple[list[float], Callable[[], Any], int]] = [
        (row.sandlot, lambda: ep.sandbox.grep("needle", "tree"), 1),
        (row.direct, lambda: subprocess.run(argv, capture_output=True, check=True), 1),
    ]
    if stripped is not None:
        sides.append((row.stripped, lambda: stripped.sandbox.grep("needle", "tree"), 1))
    interleave(sides, n, random.Random(7), warm=3, block=1)
    return row


def transfer(sb: Any, scratch: Path) -> tuple[float, float, int]:
    blob = scratch / "blob.bin"
    size = 100 << 20
    with open(blob, "wb") as fh:
        fh.write(os.urandom(size))
    ups, downs = [], []
    for _ in range(3):
        ups.append(timed(lambda: sb.upload("blob.bin", str(blob))))
        downs.append(timed(lambda: sb.download("blob.bin")))
    sb.delete("blob.bin")
    blob.unlink()
    ups.sort()
    downs.sort()
    return ups[1], downs[1], size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300, help="samples per operation")
    parser.add_argument("--no-jupyter", action="store_true", help="skip the jupyter_server peer")
    parser.add_argument("--no-stripped", action="store_true", help="skip the stripped column")
    parser.add_argument("--crowd", type=int, default=50, help="other shells open, flooding")
    parser.add_argument("--active", type=int, default=50, help="shells driven at once")
    parser.add_argument("--active-rounds", type=int, default=5)
    parser.add_argument("--active-each", type=int, default=40, help="keystrokes per shell a round")
    parser.add_argument("--attached", type=int, default=50, help="clients on one shell (memory)")
    parser.add_argument(
        "--peer-budget", type=float, default=30.0, help="seconds of jupyter samples per operation"
    )
    args = parser.parse_args()
    n = args.n
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sandlot-dp-bench-") as tmp:
        root = Path(tmp)
        src = root / "content"
        src.mkdir()
        small = make_workspace(src)
        served = Served(root).start()
        stripped = stripped_cold = None
        jup = jup_nd = None
        try:
            ep = served.ensure("bench")
            place(src, ep.workspace)
            shell = ep.shell
            if not args.no_stripped:
                ws = root / "stripped-ws"
                shutil.copytree(src, ws)
                stripped = Standalone(ws)
                stripped_cold = Standalone(ws, spare_shells=False)
            if not args.no_jupyter:
                jroot = root / "jupyter-root"
                shutil.copytree(src, jroot)
                jup = JupyterServer(jroot, shell=shell).launch()
                jup_nd = JupyterServer(jroot, nodelay=True, shell=shell).launch()
                jup.wait_ready()
                jup_nd.wait_ready()
            sep = stripped.endpoint() if stripped else None
            scold = stripped_cold.endpoint() if stripped_cold else None
            time.sleep(1.0)  # the watcher has reported the files placed

            async def memory() -> list[str]:
                sh = Shells(served, ep, sep, scold, jup, jup_nd)
                try:
                    return await memory_per_client(sh, args.attached)
                finally:
                    await sh.aclose()

            async def shells() -> tuple[list[Row], list[str]]:
                sh = Shells(served, ep, sep, scold, jup, jup_nd)
                try:
                    return await shell_rows(
                        sh,
                        n,
                        crowd=args.crowd,
                        active=args.active,
                        active_rounds=args.active_rounds,
                        active_each=args.active_each,
                    )
                finally:
                    await sh.aclose()

            mem_notes = asyncio.run(memory())
            rows, notes, served_time = http_rows(ep, sep, small, n, jup, jup_nd, args.peer_budget)
            shell_list, shell_notes = asyncio.run(shells())
            grep = grep_row(ep, sep, max(10, n // 5))
            up, down, size = transfer(ep.sandbox, root)
            stripped_xfer = transfer(sep.sandbox, root) if sep else None
        finally:
            for s in (stripped, stripped_cold):
                if s is not None:
                    s.stop()
            for srv in (jup, jup_nd):
                if srv is not None:
                    srv.stop()
            mode = served.mode
            served.stop()
    rows = [*rows, grep, *shell_list]
    print(
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, n={n} "
        f"samples per operation, {time.monotonic() - started:.0f} s in all\n"
    )
    print_table(rows)
    print()
    print(
        f"sandlot: `sandlot serve` ({mode} sandboxes, the broker in process, the shipped "
        "`default` template: `/bin/bash -l` shells, file watching on), one sandbox from "
        "`ensure`; through the SDK (`sandlot.sdk.Sandbox`, its keep-alive HTTP/1.1 client), "
        "a stock httpx client and a minimal raw-socket client (the server's own latency); "
        "the `websockets` client for shells. "
        f"Stripped ({STRIPPED_WHAT}, `/bin/sh` shells: the configuration of earlier figures): "
        "through the SDK. jupyter_server gets httpx and the same WebSocket client, token "
        "auth, same files (a copy of the workspace), terminals running the same "
        f"`{' '.join(shell)}`. Direct: the same operation in this process on the sandbox's "
        "own files (`read`, tmp + fsync + rename, `scandir` + `stat`, `subprocess.run`, a "
        "local PTY running the same shell). A shell open takes the spare shell the "
        "dataplane started in the background after the previous open (`spare_shells`); "
        "the row after it is the first shell of a sandbox (served: a new sandbox each "
        "time; stripped: a second dataplane with spares off).\n"
    )
    if served_time:
        parts = [f"{k} {v:.3f} ms" for k, v in served_time.items()]
        print(
            "Server's own time per request (`sandlot serve`'s `/metrics`, mean over the "
            "SDK, httpx and raw samples, from the request to the end of the answer): "
            + "; ".join(parts)
            + ".\n"
        )
    jupyter_notes(rows)
    busy = next((r for r in rows if "all active" in r.name), None)
    if busy is not None:
        _, p99 = stats(busy.sandlot)
        verdict = "met" if p99 <= 30 else "missed"
        print(
            f"{args.active} shells all active: sandlot p99 {p99:.1f} ms "
            f"(target ≤ 30 ms: {verdict}).\n"
        )
    for line in notes + shell_notes + mem_notes:
        print(line + "\n")
    mb = size / 1e6
    line = f"100 MiB upload {mb / up:.0f} MB/s, download {mb / down:.0f} MB/s (median of 3)"
    if stripped_xfer:
        line += f"; stripped: {mb / stripped_xfer[0]:.0f} / {mb / stripped_xfer[1]:.0f} MB/s"
    print(line)
    stripped_mbs = (mb / stripped_xfer[0], mb / stripped_xfer[1]) if stripped_xfer else None
    report_targets(rows, mb / up, mb / down, served_time, stripped_mbs)


def jupyter_notes(rows: list[Row]) -> None:
    nd = [r for r in rows if r.jupyter_nodelay]
    if not nd:
        return
    parts = []
    for r in nd:
        sm, _ = stats(r.jupyter)
        nm, np_ = stats(r.jupyter_nodelay)
        stalls = sum(1 for x in r.jupyter if x > 0.030)
        stalls_nd = sum(1 for x in r.jupyter_nodelay if x > 0.030)
        parts.append(
            f"{r.short}: {nm:.2f} ms (p99 {np_:.2f}; {stalls_nd} of {len(r.jupyter_nodelay)} "
            f"samples over 30 ms), stock {sm:.2f} ms ({stalls} of {len(r.jupyter)} over 30 ms)"
        )
    print(
        "jupyter_server with TCP_NODELAY forced on its sockets (stock tornado leaves "
        "Nagle on for WebSockets, so a frame that follows another waits for the "
        "client's delayed ACK, ~40 ms; a client cannot change that): " + "; ".join(parts) + ".\n"
    )


def limit_of(row: Row, served_ms: float | None) -> str:
    """What the SDK's figure is made of, in this run's figures."""
    med, _ = stats(row.sandlot)
    parts = []
    if served_ms is not None:
        parts.append(f"the server's own time per request {ms(served_ms)} (mean, `/metrics`)")
    direct, _ = stats(row.direct)
    if row.short in DIRECT:
        parts.append(f"{DIRECT[row.short]} done directly on the sandbox's files {ms(direct)}")
    elif row.short.startswith("shell"):
        parts.append(f"a local PTY running the same shell {ms(direct)}")
    else:
        parts.append(f"the direct operation {ms(direct)}")
    if row.raw:
        raw, _ = stats(row.raw)
        verb = "adds" if med >= raw else "saves"
        parts.append(f"a raw-socket client {ms(raw)} (the SDK {verb} {ms(abs(med - raw))})")
    if row.stripped:
        parts.append(f"the stripped dataplane {ms(stats(row.stripped)[0])}")
    return "; ".join(parts)


def report_targets(
    rows: list[Row],
    up_mbs: float,
    down_mbs: float,
    served_time: dict[str, float],
    stripped_mbs: tuple[float, float] | None,
) -> None:
    """The dataplane targets of the issue, on ``sandlot serve`` through the SDK."""
    by = {r.short: r for r in rows}

    def latency(name: str, target: str, limit_ms: float, *, p99: bool = False) -> None:
        row = by[name]
        med, tail = stats(row.sandlot)
        got = tail if p99 else med
        text = f"{ms(got)}" + ("" if p99 else f" (p99 {ms(tail)})")
        if row.httpx:
            text += f"; httpx {ms(stats(row.httpx)[0])}"
        if row.stripped:
            text += f"; stripped {ms(stats(row.stripped)[0])}"
        report("dataplane", target, text, got <= limit_ms, limit_of(row, served_time.get(name)))

    latency("4 KiB read", "4 KiB read: ≤ 0.8 ms", 0.8)
    latency("4 KiB write, durable", "4 KiB write (fsync + rename): ≤ 1.2 ms", 1.2)
    latency("1 MiB read", "1 MiB read: ≤ 3 ms", 3.0)
    latency("list 1,000 files", "listing 1,000 files: ≤ 6 ms", 6.0)
    latency("exec `true`", "exec `true`: ≤ 2.5 ms", 2.5)
    latency("shell keystroke echo", "shell echo round trip: p50 ≤ 0.6 ms", 0.6)
    crowded = next(k for k in by if k.startswith("shell keystroke echo,") and "open" in k)
    latency(crowded, "shell echo with 50 shells open: p99 ≤ 5 ms", 5.0, p99=True)
    busy = next(k for k in by if "all active" in k)
    latency(busy, "shell echo with 50 shells all active: p99 ≤ 30 ms", 30.0, p99=True)
    opened, cold = by["shell open to first prompt"], by["shell open without a spare"]
    om, otail = stats(opened.sandlot)
    cm, ctail = stats(cold.sandlot)
    report(
        "dataplane",
        "shell open: ≤ 10 ms",
        f"{ms(om)} (p99 {ms(otail)}); the first shell of a sandbox, which has no spare "
        f"yet: {ms(cm)} (p99 {ms(ctail)})",
        om <= 10.0,
        limit_of(opened, None),
    )
    grep = by["grep a 1,000-file tree"]
    gm, _ = stats(grep.sandlot)
    rg, _ = stats(grep.direct)
    report(
        "dataplane",
        "grep: within 1.5\u00d7 of ripgrep run directly on the same tree",
        f"{gm / rg:.2f}\u00d7 ({ms(gm)} vs {ms(rg)})",
        gm / rg <= 1.5,
        "ripgrep runs inside the sandbox (its cgroup and namespaces) within the request; "
        f"the HTTP round trip and JSON add the rest; {limit_of(grep, None)}",
    )
    report(
        "dataplane",
        "upload and download of 100 MiB: ≥ 200 MB/s",
        f"{up_mbs:.0f} / {down_mbs:.0f} MB/s",
        min(up_mbs, down_mbs) >= 200,
        "loopback copy and the durable write"
        + (
            f"; the stripped dataplane: {stripped_mbs[0]:.0f} / {stripped_mbs[1]:.0f} MB/s"
            if stripped_mbs
            else ""
        ),
    )


if __name__ == "__main__":
    main()
