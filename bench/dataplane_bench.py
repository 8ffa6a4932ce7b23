"""Dataplane latency, side by side with the same operation done directly.

Run: ``/tmp/venv/bin/python bench/dataplane_bench.py [--n 300]``

Starts a dataplane (uvicorn, one sandbox, direct runtime) in a subprocess on
127.0.0.1, then interleaves each operation through the dataplane with the same
operation done directly in this process, and prints a Markdown table
(median / p99 in ms, and the ratio of medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def serve(workspace: str) -> None:
    import jwt
    import uvicorn
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from jwt.algorithms import OKPAlgorithm

    from sandlot.dataplane.auth import TokenVerifier
    from sandlot.dataplane.host import create_standalone_app
    from sandlot.dataplane.settings import DataplaneSettings
    from sandlot.protocol.sessions import Template
    from sandlot.runtime.direct import DirectRuntime

    key = Ed25519PrivateKey.generate()
    jwk = {**json.loads(OKPAlgorithm.to_jwk(key.public_key())), "kid": "k1", "alg": "EdDSA"}

    async def jwks() -> dict[str, Any]:
        return {"keys": [jwk]}

    now = int(time.time())
    token = jwt.encode(
        {
            "iss": "bench", "aud": "sandlot-dataplane", "typ": "sandbox+jwt", "sub": "p",
            "act": {"type": "agent", "id": "a"}, "sid": "s", "sandbox_id": "sb_bench",
            "scope": "thread:t", "caps": ["fs_read", "fs_write", "exec", "shell"], "gen": 1,
            "iat": now, "nbf": now, "exp": now + 3600, "jti": "j1",
        },
        key, algorithm="EdDSA", headers={"kid": "k1"},
    )  # fmt: skip
    template = Template(name="t", image="host", shells={"default": ["/bin/sh"]})
    runtime = DirectRuntime("sb_bench", 1, template, Path(workspace))
    app = create_standalone_app(
        runtime,
        verifier=TokenVerifier(jwks, issuer="bench"),
        settings=DataplaneSettings(watch_fs=False, max_shells=200),
    )
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    print(json.dumps({"port": port, "token": token}), flush=True)
    config = uvicorn.Config(app, log_level="warning", ws_per_message_deflate=False)
    uvicorn.Server(config).run(sockets=[sock])


class RawHttp:
    """A minimal keep-alive HTTP/1.1 client (TCP_NODELAY): the server's own latency,
    without the ~0.8 ms httpx adds per request on these cores."""

    def __init__(self, port: int, token: str) -> None:
        import socket

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.auth = f"Authorization: Bearer {token}\r\n"

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\n{self.auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self.sock.recv(1 << 20)
        header, _, rest = buf.partition(b"\r\n\r\n")
        length = 0
        for line in header.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        while len(rest) < length:
            rest += self.sock.recv(1 << 20)
        return rest


def stats(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1000, s[min(len(s) - 1, int(len(s) * 0.99))] * 1000


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def shell_rtt(
    ws_url: str,
    token: str,
    n: int,
    *,
    crowd: int = 0,
    pid: int = 0,
    report: list[str] | None = None,
) -> tuple[list[float], list[float]]:
    """Open times, and echo round trips on one shell while ``crowd`` other shells are open."""
    import websockets

    opens: list[float] = []
    rtts: list[float] = []
    others = []
    for i in range(crowd):
        ws = await websockets.connect(
            f"{ws_url}/shell/ws?session=crowd{i}&profile=default",
            additional_headers={"Authorization": f"Bearer {token}"},
            compression=None,
        )
        others.append(ws)
    if crowd and pid and report is not None:
        # Every crowd shell prints 2 MiB while its client does not read: memory stays bounded.
        for ws in others:
            await ws.send(
                json.dumps({"type": "stdin", "data": "head -c 2000000 /dev/zero | tr '\\0' y\n"})
            )
        await asyncio.sleep(3)
        report.append(
            f"server RSS with {crowd} shells flooding unread clients: {rss_mib(pid):.0f} MiB"
        )
    for i in range(20):
        t0 = time.perf_counter()
        async with websockets.connect(
            f"{ws_url}/shell/ws?session=open{i}&profile=default",
            additional_headers={"Authorization": f"Bearer {token}"},
            compression=None,
        ) as ws:
            await ws.recv()
            await ws.recv()
            opens.append(time.perf_counter() - t0)
    async with websockets.connect(
        f"{ws_url}/shell/ws?session=echo&profile=default",
        additional_headers={"Authorization": f"Bearer {token}"},
        compression=None,
    ) as ws:
        await ws.recv()
        await ws.recv()
        await ws.send(json.dumps({"type": "stdin", "data": "stty raw -echo; cat\n"}))
        await asyncio.sleep(0.3)
        while True:
            try:
                await asyncio.wait_for(ws.recv(), 0.2)
            except TimeoutError:
                break
        for _ in range(n):
            t0 = time.perf_counter()
            await ws.send('{"type":"stdin","data":"x"}')
            while "x" not in json.loads(await ws.recv()).get("data", ""):
                pass
            rtts.append(time.perf_counter() - t0)
    for ws in others:
        await ws.close()
    return opens, rtts


def local_pty_rtt(n: int) -> list[float]:
    pid, fd = pty.fork()
    if pid == 0:
        os.execv("/bin/sh", ["/bin/sh", "-c", "stty raw -echo; exec cat"])
    time.sleep(0.2)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        os.write(fd, b"x")
        while True:
            select.select([fd], [], [])
            if b"x" in os.read(fd, 100):
                break
        out.append(time.perf_counter() - t0)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return out


def grep_pair(c: Any, base: str, ws_dir: Path, n: int) -> tuple[list[float], list[float]]:
    from sandlot.dataplane.grep import ripgrep_path

    tree = ws_dir / "tree"
    if not tree.exists():
        for i in range(1000):
            d = tree / f"d{i % 20}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{i}.py").write_text(("def f():\n    return 1\n" * 200) + f"# needle {i}\n")
    rg = ripgrep_path() or "rg"
    argv = [
        rg,
        "--no-heading",
        "-n",
        "--null",
        "--hidden",
        "--no-ignore",
        "-F",
        "needle",
        str(tree),
    ]
    a, b = [], []
    for _ in range(n):
        a.append(
            timed(lambda: c.post(f"{base}/fs/grep", json={"pattern": "needle", "path": "tree"}))
        )
        b.append(timed(lambda: subprocess.run(argv, capture_output=True, check=True)))
    return a, b


def transfer(c: Any, base: str, ws_dir: Path) -> tuple[float, float, int]:
    blob = ws_dir.parent / "blob.bin"
    size = 100 << 20
    with open(blob, "wb") as fh:
        fh.write(os.urandom(size))
    ups, downs = [], []
    for _ in range(3):
        with open(blob, "rb") as fh:
            ups.append(
                timed(
                    lambda fh=fh: c.post(
                        f"{base}/files/upload", params={"path": "blob.bin"}, content=fh
                    )
                )
            )
        downs.append(timed(lambda: c.get(f"{base}/files/download", params={"path": "blob.bin"})))
    return statistics.median(ups), statistics.median(downs), size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--serve")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    import httpx

    n = args.n
    with tempfile.TemporaryDirectory() as tmp:
        ws_dir = Path(tmp) / "ws"
        ws_dir.mkdir()
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(ws_dir)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            info = json.loads(proc.stdout.readline())
            base = f"http://127.0.0.1:{info['port']}/v1"
            ws_base = f"ws://127.0.0.1:{info['port']}/v1"
            token = info["token"]
            small = os.urandom(3072).hex()[:4096]
            (ws_dir / "small.txt").write_text(small)
            (ws_dir / "big.bin").write_bytes(os.urandom(1 << 20))
            (ws_dir / "many").mkdir()
            for i in range(1000):
                (ws_dir / "many" / f"f{i:04d}.txt").write_text("x")
            rows: list[tuple[str, list[float], list[float]]] = []
            raw_rows: dict[str, list[float]] = {}
            raw = RawHttp(info["port"], token)
            q = "/v1"
            raw_ops: dict[str, Callable[[], Any]] = {
                "4 KiB read (`/fs/read`)": lambda: raw.request(
                    "GET", f"{q}/fs/read?path=small.txt"
                ),
                "4 KiB write, durable (`/fs/write`)": lambda: raw.request(
                    "PUT", f"{q}/fs/write", json.dumps({"path": "w.txt", "content": small}).encode()
                ),
                "1 MiB read (`/files/download`)": lambda: raw.request(
                    "GET", f"{q}/files/download?path=big.bin"
                ),
                "list 1,000 files (`/fs/list`)": lambda: raw.request(
                    "GET", f"{q}/fs/list?path=many"
                ),
                "exec `true` (`/exec`)": lambda: raw.request(
                    "POST", f"{q}/exec", b'{"command": ["true"]}'
                ),
            }
            with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as c:
                c.get(f"{base}/healthz")

                def direct_write() -> None:
                    tmpf = ws_dir / ".w.tmp"
                    fd = os.open(tmpf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.write(fd, small.encode())
                    os.fsync(fd)
                    os.close(fd)
                    os.rename(tmpf, ws_dir / "w.txt")

                ops: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
                    (
                        "4 KiB read (`/fs/read`)",
                        lambda: c.get(f"{base}/fs/read", params={"path": "small.txt"}),
                        lambda: (ws_dir / "small.txt").read_text(),
                    ),
                    (
                        "4 KiB write, durable (`/fs/write`)",
                        lambda: c.put(f"{base}/fs/write", json={"path": "w.txt", "content": small}),
                        direct_write,
                    ),
                    (
                        "1 MiB read (`/files/download`)",
                        lambda: c.get(f"{base}/files/download", params={"path": "big.bin"}),
                        lambda: (ws_dir / "big.bin").read_bytes(),
                    ),
                    (
                        "list 1,000 files (`/fs/list`)",
                        lambda: c.get(f"{base}/fs/list", params={"path": "many"}),
                        lambda: [e.stat() for e in os.scandir(ws_dir / "many")],
                    ),
                    (
                        "exec `true` (`/exec`)",
                        lambda: c.post(f"{base}/exec", json={"command": ["true"]}),
                        lambda: subprocess.run(["true"], check=True),
                    ),
                ]
                for name, via, direct in ops:
                    for _ in range(10):
                        via()
                        direct()
                    a, b, r = [], [], []
                    for _ in range(n):
                        a.append(timed(via))
                        b.append(timed(direct))
                        r.append(timed(raw_ops[name]))
                    rows.append((name, a, b))
                    raw_rows[name] = r
            opens, rtts = asyncio.run(shell_rtt(ws_base, token, n))
            report: list[str] = [f"server RSS idle: {rss_mib(proc.pid):.0f} MiB"]
            _, crowded = asyncio.run(
                shell_rtt(ws_base, token, n, crowd=50, pid=proc.pid, report=report)
            )
            rows.append(
                (
                    "grep a 1,000-file tree (`/fs/grep`)",
                    *grep_pair(
                        c2 := httpx.Client(headers={"Authorization": f"Bearer {token}"}),
                        base,
                        ws_dir,
                        n // 5,
                    ),
                )
            )
            up, down, size = transfer(c2, base, ws_dir)
            c2.close()
            local = local_pty_rtt(n)
            local_open = []
            for _ in range(20):
                t0 = time.perf_counter()
                pid, fd = pty.fork()
                if pid == 0:
                    os.execv("/bin/sh", ["/bin/sh"])
                select.select([fd], [], [])
                local_open.append(time.perf_counter() - t0)
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                os.close(fd)
            rows.append(("shell echo round trip (`/shell/ws`)", rtts, local))
            rows.append(("shell echo, 50 other shells open", crowded, local))
            rows.append(("shell open to first prompt (`/shell/ws`)", opens, local_open))
        finally:
            proc.terminate()
            proc.wait(5)
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, n={n}\n")
    for line in report:
        print(line + "\n")
    mb = size / 1e6
    print(f"100 MiB upload {mb / up:.0f} MB/s, download {mb / down:.0f} MB/s (median of 3)\n")
    print(
        "| operation | dataplane (httpx) median | p99 | dataplane (raw HTTP) median | p99 "
        "| direct median | p99 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, a, b in rows:
        am, ap = stats(a)
        bm, bp = stats(b)
        raw_cell = "| - | - |"
        if name in raw_rows:
            rm, rp = stats(raw_rows[name])
            raw_cell = f"| {rm:.3f} ms | {rp:.3f} ms |"
        print(f"| {name} | {am:.3f} ms | {ap:.3f} ms {raw_cell} {bm:.3f} ms | {bp:.3f} ms |")


if __name__ == "__main__":
    main()
