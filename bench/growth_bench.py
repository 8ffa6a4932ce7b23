"""Cost growth: a few operations at 1, 10, 100 (1,000) times the work, sandlot and direct.

Run: ``.venv/bin/python bench/growth_bench.py [--quick] [--no-stripped] [--svg FILE]``

Measures a real ``sandlot serve`` (``bench/served.py``: isolated sandboxes when
root, the shipped ``default`` template, file watching on), one sandbox from
``ensure``, through the SDK and through a stock client (httpx; the
``websockets`` client for exec streams), beside the stripped standalone
dataplane (through the SDK) and the operation done directly in this process
on the sandbox's own files, one sample of each in turn:

- listing 10 / 100 / 1,000 / 10,000 files (``/fs/list`` vs ``scandir`` + ``stat``);
- reading 4 KiB / 40 KiB / 400 KiB / 4 MiB of text (``/fs/read``, JSON, vs
  ``read_text``) and the same files as bytes (``/files/download`` vs ``read_bytes``);
- grep over 100 / 1,000 / 10,000 files of 4.4 KiB, one match each (``/fs/grep`` vs ``rg``);
- a command printing 1 / 10 / 100 MiB, streamed (``/exec/ws`` to its ``exit``
  frame vs ``subprocess.run`` reading the pipe).

Prints a Markdown table (median, p95, ratio to direct, and how much each side
grew from the smallest size) and writes a log-log SVG plot, one line per
operation for sandlot through the SDK (solid) and direct (dashed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dataplane_bench import place
from measure import checked
from served import STRIPPED, STRIPPED_WHAT, Endpoint, Served, Standalone

ROOT = Path(__file__).resolve().parents[1]
KIB = 1024
MIB = 1024 * 1024


@dataclass
class Point:
    label: str
    work: float  # relative to the smallest size of the series
    #: ``sandlot serve`` through the SDK.
    sandlot: list[float] = field(default_factory=list)
    #: ``sandlot serve`` through a stock client (httpx, or ``websockets`` for streams).
    stock: list[float] = field(default_factory=list)
    #: The stripped dataplane through the SDK.
    stripped: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    #: Exec streams: bytes the client was told it lost (``gap`` frames), per SDK sample.
    lost: list[int] = field(default_factory=list)


@dataclass
class Series:
    name: str
    unit: str
    points: list[Point] = field(default_factory=list)


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.95))] * 1000


def size_label(n: int) -> str:
    if n >= MIB:
        return f"{n // MIB} MiB"
    return f"{n // KIB} KiB"


Op = Callable[[], Any]


def measure(
    point: Point,
    sides: list[tuple[list[float], Op | None]],
    *,
    reps: int,
    budget: float,
    warm: int = 2,
) -> None:
    """One sample of each side in turn until ``reps`` rounds or ``budget`` seconds (at
    least 3 rounds)."""
    live = [(samples, op) for samples, op in sides if op is not None]
    for _ in range(warm):
        for _, op in live:
            op()
    started = time.monotonic()
    while len(point.sandlot) < reps:
        for samples, op in live:
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
        if len(point.sandlot) >= 3 and time.monotonic() - started > budget:
            break


def make_listing(root: Path, n: int) -> Path:
    d = root / f"list{n}"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:05d}.txt").write_text("x")
    return d


def make_text(root: Path, size: int) -> Path:
    line = "0123456789abcdef" * 4
    line = line[:63] + "\n"
    p = root / f"text{size}.txt"
    p.write_text(line * (size // len(line)) + "x" * (size % len(line)))
    return p


def make_grep_tree(root: Path, n: int) -> Path:
    tree = root / f"grep{n}"
    body = "def f():\n    return 1\n" * 200
    for i in range(n):
        d = tree / f"d{i % 100}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.py").write_text(body + f"# needle {i}\n")
    return tree


async def stream_exec(ws_base: str, headers: dict[str, str], argv: list[str]) -> tuple[int, int]:
    """Run ``argv`` through ``/exec/ws`` with the stock ``websockets`` client and read every
    frame: (bytes received, bytes lost).

    A client that falls more than the stream buffer behind the command gets a
    ``gap`` frame for what it missed; it is counted, not hidden.
    """
    import websockets

    got = lost = 0
    async with websockets.connect(
        f"{ws_base}/exec/ws", additional_headers=headers, compression=None, max_size=None
    ) as ws:
        await ws.send(json.dumps({"type": "start", "command": argv}))
        while True:
            msg = json.loads(await ws.recv())
            kind = msg.get("type")
            if kind == "stdout":
                got += len(msg["data"])
            elif kind == "exit":
                if msg.get("exit_code") != 0:
                    raise RuntimeError(f"exec failed: {msg}")
                return got, lost
            elif kind == "gap":
                lost += msg["to"] - msg["from"]
            elif kind == "error":
                raise RuntimeError(f"exec stream: {msg}")


def sdk_stream(sb: Any, argv: list[str]) -> tuple[int, int]:
    """The same through the SDK (``Sandbox.stream``): (bytes received, bytes lost)."""
    got = lost = 0
    cmd = sb.stream(argv)
    for chunk in cmd:
        got += len(chunk.data)
        lost += chunk.lost or 0
    if cmd.exit_code != 0:
        raise RuntimeError(f"exec failed: {cmd.exit_code}")
    return got, lost


def run(args: argparse.Namespace) -> list[Series]:
    from sandlot.dataplane.services.grep import ripgrep_path

    reps, budget = (30, 2.0) if args.quick else (200, 10.0)
    out: list[Series] = []
    with tempfile.TemporaryDirectory(prefix="sandlot-growth-") as tmp:
        src = Path(tmp) / "content"
        src.mkdir()
        listings = [make_listing(src, n).name for n in (10, 100, 1000, 10_000)]
        texts = [make_text(src, s).name for s in (4 * KIB, 40 * KIB, 400 * KIB, 4 * MIB)]
        trees = [make_grep_tree(src, n).name for n in (100, 1000, 10_000)]
        served = Served(Path(tmp)).start()
        standalone = None
        loop = asyncio.new_event_loop()
        try:
            ep = served.ensure("growth")
            place(src, ep.workspace)
            stripped: Endpoint | None = None
            if not args.no_stripped:
                ws = Path(tmp) / "stripped-ws"
                shutil.copytree(src, ws)
                standalone = Standalone(ws)
                stripped = standalone.endpoint()
            ws_dir = ep.workspace
            sb = ep.sandbox
            ssb = stripped.sandbox if stripped else None
            c = ep.httpx(timeout=120)
            base = ep.base
            time.sleep(1.0)  # the watcher has reported the files placed

            def sides(
                pt: Point, via: Callable[[Any], Any], stock: Op, direct: Op
            ) -> list[tuple[list[float], Op | None]]:
                return [
                    (pt.sandlot, lambda: via(sb)),
                    (pt.stock, stock),
                    (pt.stripped, (lambda: via(ssb)) if ssb is not None else None),
                    (pt.direct, direct),
                ]

            s = Series("list files (`/fs/list`)", "files")
            for name in listings:
                d = ws_dir / name
                n = len(os.listdir(d))
                pt = Point(f"{n:,} files", n / 10)
                assert len(sb.ls(name)) == n, "listing incomplete"
                measure(
                    pt,
                    sides(
                        pt,
                        lambda b, name=name: b.ls(name),
                        lambda name=name: checked(c.get(f"{base}/fs/list", params={"path": name})),
                        lambda d=d: [e.stat() for e in os.scandir(d)],
                    ),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            s = Series("read text (`/fs/read`, JSON)", "bytes")
            for name in texts:
                p = ws_dir / name
                size = p.stat().st_size
                pt = Point(size_label(size), size / (4 * KIB))
                params = {"path": name, "limit": 1 << 24}
                assert len(sb.read(name, limit=1 << 24).content) == size, "read incomplete"
                measure(
                    pt,
                    sides(
                        pt,
                        lambda b, name=name: b.read(name, limit=1 << 24),
                        lambda params=params: checked(c.get(f"{base}/fs/read", params=params)),
                        lambda p=p: p.read_text(),
                    ),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            s = Series("read bytes (`/files/download`)", "bytes")
            for name in texts:
                p = ws_dir / name
                size = p.stat().st_size
                pt = Point(size_label(size), size / (4 * KIB))
                measure(
                    pt,
                    sides(
                        pt,
                        lambda b, name=name: b.download(name),
                        lambda name=name: checked(
                            c.get(f"{base}/files/download", params={"path": name})
                        ),
                        lambda p=p: p.read_bytes(),
                    ),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            rg = ripgrep_path() or "rg"
            s = Series("grep, one match per file (`/fs/grep` vs `rg`)", "files")
            for name in trees:
                tree = ws_dir / name
                n = sum(len(files) for _, _, files in os.walk(tree))
                pt = Point(f"{n:,} files", n / 100)
                found = sb.grep("needle", name)
                assert len(found) == n, f"grep found {len(found)} of {n}"
                req = {"pattern": "needle", "path": name}
                argv = [rg, "--no-heading", "-n", "--null", "--hidden", "--no-ignore", "-F"]
                argv += ["needle", str(tree)]
                measure(
                    pt,
                    sides(
                        pt,
                        lambda b, name=name: b.grep("needle", name),
                        lambda req=req: checked(c.post(f"{base}/fs/grep", json=req)),
                        lambda argv=argv: subprocess.run(argv, capture_output=True, check=True),
                    ),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            s = Series("exec output streamed (`/exec/ws` vs `subprocess.run`)", "bytes")
            for size in (MIB, 10 * MIB, 100 * MIB):
                argv = ["sh", "-c", f"head -c {size} /dev/zero | tr '\\0' y"]
                pt = Point(size_label(size), size / MIB)

                def via(b: Any, argv: list[str] = argv, pt: Point = pt, size: int = size) -> None:
                    got, lost = sdk_stream(b, argv)
                    assert got + lost == size, f"streamed {got} + lost {lost} of {size} bytes"
                    if b is sb:
                        pt.lost.append(lost)

                def stock(argv: list[str] = argv, size: int = size) -> None:
                    got, lost = loop.run_until_complete(stream_exec(ep.ws_base, ep.headers, argv))
                    assert got + lost == size, f"streamed {got} + lost {lost} of {size} bytes"

                measure(
                    pt,
                    sides(
                        pt,
                        via,
                        stock,
                        lambda argv=argv: subprocess.run(argv, capture_output=True, check=True),
                    ),
                    reps=reps,
                    budget=budget,
                    warm=1,
                )
                s.points.append(pt)
            out.append(s)
            ep.close()
        finally:
            loop.close()
            if standalone is not None:
                standalone.stop()
            served.stop()
    return out


# --- output ----------------------------------------------------------------------------------


def table(series: list[Series]) -> str:
    lines = [
        "| operation | work | sandlot (SDK) median | p95 | stock client median "
        f"| {STRIPPED} (SDK) median "
        "| direct median | p95 | sandlot ÷ direct | sandlot growth from the first size "
        "| direct growth |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in series:
        first_a = med(s.points[0].sandlot)
        first_b = med(s.points[0].direct)
        for i, pt in enumerate(s.points):
            a, b = med(pt.sandlot), med(pt.direct)
            name = s.name if i == 0 else ""
            stripped = fmt(med(pt.stripped)) if pt.stripped else "-"
            lines.append(
                f"| {name} | {pt.label} ({len(pt.sandlot)} samples) | {fmt(a)} | "
                f"{fmt(p95(pt.sandlot))} | {fmt(med(pt.stock))} | {stripped} | {fmt(b)} | "
                f"{fmt(p95(pt.direct))} | {a / b:.2f}\u00d7 "
                f"| {a / first_a:.1f}\u00d7 for {pt.work:g}\u00d7 the work "
                f"| {b / first_b:.1f}\u00d7 |"
            )
    return "\n".join(lines)


def fmt(v: float) -> str:
    return f"{v:.3f} ms" if v < 10 else f"{v:.1f} ms"


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def svg(series: list[Series]) -> str:
    """A log-log plot: x = work relative to the first size, y = median ms."""
    import math

    width, height = 940, 500
    left, right, top, bottom = 70, 400, 40, 60
    pw, ph = width - left - right, height - top - bottom
    xs = [pt.work for s in series for pt in s.points]
    ys = [med(v) for s in series for pt in s.points for v in (pt.sandlot, pt.direct)]
    # 1,024x is drawn inside the 1,000x decade, not in an empty one.
    x0, x1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)) - 0.05)
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    x1 = max(x1, x0 + 1)
    y1 = max(y1, y0 + 1)

    def X(v: float) -> float:
        return left + (math.log10(v) - x0) / (x1 - x0) * pw

    def Y(v: float) -> float:
        return top + ph - (math.log10(v) - y0) / (y1 - y0) * ph

    def esc(t: str) -> str:
        return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("`", "")

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">Cost growth: median '
        "latency vs work (log-log); solid = sandlot serve (SDK), dashed = direct</text>",
    ]
    for e in range(x0, x1 + 1):
        x = X(10**e)
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#ddd"/>'
            f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{10**e:g}\u00d7</text>'
        )
    for e in range(y0, y1 + 1):
        y = Y(10**e)
        label = f"{10**e:g} ms" if e >= -3 else f"1e{e} ms"
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>'
        )
    # Reference slope: cost proportional to the work, from the lowest first point.
    base = min(min(med(s.points[0].sandlot), med(s.points[0].direct)) for s in series)
    end = min(10**x1, 10**y1 / base)
    parts.append(
        f'<line x1="{X(1):.1f}" y1="{Y(base):.1f}" x2="{X(end):.1f}" y2="{Y(base * end):.1f}" '
        'stroke="#999" stroke-dasharray="1,3"/>'
    )
    mid = math.sqrt(end)
    angle = -math.degrees(math.atan((ph / (y1 - y0)) / (pw / (x1 - x0))))
    mx, my = X(mid), Y(base * mid)
    parts.append(
        f'<text x="{mx:.1f}" y="{my - 5:.1f}" text-anchor="middle" fill="#777" '
        f'transform="rotate({angle:.1f} {mx:.1f} {my:.1f})">cost \u221d work</text>'
    )
    parts.append(
        f'<text x="{left + pw / 2:.0f}" y="{height - 18}" text-anchor="middle">'
        "work, relative to the smallest size of each operation</text>"
    )
    parts.append(
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>'
    )
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        for side, dash in (("sandlot", ""), ("direct", ' stroke-dasharray="6,4"')):
            pts = [(X(pt.work), Y(med(getattr(pt, side)))) for pt in s.points]
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
            )
            for x, y in pts:
                if side == "sandlot":
                    parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
                else:
                    parts.append(
                        f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" '
                        f'fill="white" stroke="{color}"/>'
                    )
        ly = top + 10 + i * 44
        lx = left + pw + 16
        first, last = s.points[0].label, s.points[-1].label
        parts.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 28}" y2="{ly}" stroke="{color}" '
            f'stroke-width="2"/><text x="{lx + 34}" y="{ly + 4}">{esc(s.name)}</text>'
            f'<line x1="{lx}" y1="{ly + 16}" x2="{lx + 28}" y2="{ly + 16}" stroke="{color}" '
            f'stroke-width="2" stroke-dasharray="6,4"/>'
            f'<text x="{lx + 34}" y="{ly + 20}" fill="#555">direct; {esc(first)} \u2192 '
            f"{esc(last)}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="at most 30 samples or 2 s per point")
    ap.add_argument("--no-stripped", action="store_true", help="skip the stripped column")
    ap.add_argument("--svg", default=str(ROOT / "docs" / "cost-growth.svg"))
    args = ap.parse_args()
    started = time.monotonic()
    series = run(args)
    Path(args.svg).parent.mkdir(parents=True, exist_ok=True)
    Path(args.svg).write_text(svg(series))
    print(
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}; "
        f"{'quick: at most 30 samples or 2 s' if args.quick else 'at most 200 samples or 10 s'} "
        f"per point, one sample of each side in turn; {time.monotonic() - started:.0f} s in all\n"
    )
    print(table(series))
    print()
    print(
        "sandlot: `sandlot serve` (the shipped `default` template, file watching on), one "
        "sandbox from `ensure`, through the SDK; stock client: httpx (exec streams: the "
        f"`websockets` client); stripped: the {STRIPPED_WHAT}, through the SDK; direct: the "
        "operation "
        "in this process on the sandbox's own files.\n"
    )
    for s in series:
        for pt in s.points:
            if any(pt.lost):
                hit = sum(1 for x in pt.lost if x)
                print(
                    f"{s.name}, {pt.label}: the client, reading as fast as it could, was sent "
                    f"`gap` frames in {hit} of {len(pt.lost)} runs (largest loss "
                    f"{max(pt.lost) / MIB:.1f} MiB): the command's output is read at its own "
                    "pace, with no back-pressure from the attached client.\n"
                )
    print(f"![cost growth]({os.path.basename(args.svg)})")


if __name__ == "__main__":
    main()
