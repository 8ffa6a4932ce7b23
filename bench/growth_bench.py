"""Cost growth: a few operations at 1, 10, 100 (1,000) times the work, dataplane and direct.

Run: ``.venv/bin/python bench/growth_bench.py [--quick] [--svg docs/cost-growth.svg]``

Starts a dataplane (uvicorn, one sandbox, direct runtime; the same server as
``bench/dataplane_bench.py``) and times each operation at each size through
the dataplane and directly in this process, interleaved sample by sample:

- listing 10 / 100 / 1,000 / 10,000 files (``/fs/list`` vs ``scandir`` + ``stat``);
- reading 4 KiB / 40 KiB / 400 KiB / 4 MiB of text (``/fs/read``, JSON, vs
  ``read_text``) and the same files as bytes (``/files/download`` vs ``read_bytes``);
- grep over 100 / 1,000 / 10,000 files of 4.4 KiB, one match each (``/fs/grep`` vs ``rg``);
- a command printing 1 / 10 / 100 MiB, streamed (``/exec/ws`` to its ``exit``
  frame vs ``subprocess.run`` reading the pipe).

Prints a Markdown table (median, p95, ratio to direct, and how much each side
grew from the smallest size) and writes a log-log SVG plot, one line per
operation for the dataplane (solid) and direct (dashed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

from dataplane_bench import Dataplane, checked

ROOT = Path(__file__).resolve().parents[1]
KIB = 1024
MIB = 1024 * 1024


@dataclass
class Point:
    label: str
    work: float  # relative to the smallest size of the series
    sandlot: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    #: Exec streams: bytes the client was told it lost (``gap`` frames), per sample.
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


def measure(
    point: Point,
    via: Callable[[], Any],
    direct: Callable[[], Any],
    *,
    reps: int,
    budget: float,
    warm: int = 2,
) -> None:
    """Interleaved samples until ``reps`` pairs or ``budget`` seconds (at least 3 pairs)."""
    for _ in range(warm):
        via()
        direct()
    started = time.monotonic()
    while len(point.sandlot) < reps:
        t0 = time.perf_counter()
        via()
        t1 = time.perf_counter()
        direct()
        t2 = time.perf_counter()
        point.sandlot.append(t1 - t0)
        point.direct.append(t2 - t1)
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
    """Run ``argv`` through ``/exec/ws`` and read every frame: (bytes received, bytes lost).

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


def run(args: argparse.Namespace) -> list[Series]:
    import httpx

    from sandlot.dataplane.grep import ripgrep_path

    reps, budget = (30, 2.0) if args.quick else (200, 10.0)
    out: list[Series] = []
    with tempfile.TemporaryDirectory(prefix="sandlot-growth-") as tmp:
        ws_dir = Path(tmp) / "ws"
        ws_dir.mkdir()
        listings = [make_listing(ws_dir, n) for n in (10, 100, 1000, 10_000)]
        texts = [make_text(ws_dir, s) for s in (4 * KIB, 40 * KIB, 400 * KIB, 4 * MIB)]
        trees = [make_grep_tree(ws_dir, n) for n in (100, 1000, 10_000)]
        dp = Dataplane(ws_dir)
        loop = asyncio.new_event_loop()
        try:
            c = httpx.Client(headers=dp.headers, timeout=120)
            checked(c.get(f"{dp.base}/healthz"))

            s = Series("list files (`/fs/list`)", "files")
            for d in listings:
                n = len(os.listdir(d))
                pt = Point(f"{n:,} files", n / 10)
                body = checked(c.get(f"{dp.base}/fs/list", params={"path": d.name})).json()
                assert len(body["entries"]) == n and not body["truncated"], "listing incomplete"
                measure(
                    pt,
                    lambda d=d: checked(c.get(f"{dp.base}/fs/list", params={"path": d.name})),
                    lambda d=d: [e.stat() for e in os.scandir(d)],
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            s = Series("read text (`/fs/read`, JSON)", "bytes")
            for p in texts:
                size = p.stat().st_size
                pt = Point(size_label(size), size / (4 * KIB))
                params = {"path": p.name, "limit": 1 << 24}
                body = checked(c.get(f"{dp.base}/fs/read", params=params)).json()
                assert len(body["content"]) == size, "read incomplete"
                measure(
                    pt,
                    lambda params=params: checked(c.get(f"{dp.base}/fs/read", params=params)),
                    lambda p=p: p.read_text(),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            s = Series("read bytes (`/files/download`)", "bytes")
            for p in texts:
                size = p.stat().st_size
                pt = Point(size_label(size), size / (4 * KIB))
                params = {"path": p.name}
                measure(
                    pt,
                    lambda params=params: checked(
                        c.get(f"{dp.base}/files/download", params=params)
                    ),
                    lambda p=p: p.read_bytes(),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            rg = ripgrep_path() or "rg"
            s = Series("grep, one match per file (`/fs/grep` vs `rg`)", "files")
            for tree in trees:
                n = sum(len(files) for _, _, files in os.walk(tree))
                pt = Point(f"{n:,} files", n / 100)
                req = {"pattern": "needle", "path": tree.name}
                body = checked(c.post(f"{dp.base}/fs/grep", json=req)).json()
                matches = body.get("matches", [])
                assert len(matches) == n, f"grep found {len(matches)} of {n}"
                argv = [rg, "--no-heading", "-n", "--null", "--hidden", "--no-ignore", "-F"]
                argv += ["needle", str(tree)]
                measure(
                    pt,
                    lambda req=req: checked(c.post(f"{dp.base}/fs/grep", json=req)),
                    lambda argv=argv: subprocess.run(argv, capture_output=True, check=True),
                    reps=reps,
                    budget=budget,
                )
                s.points.append(pt)
            out.append(s)

            s = Series("exec output streamed (`/exec/ws` vs `subprocess.run`)", "bytes")
            for size in (MIB, 10 * MIB, 100 * MIB):
                argv = ["sh", "-c", f"head -c {size} /dev/zero | tr '\\0' y"]
                pt = Point(size_label(size), size / MIB)

                def via(argv: list[str] = argv, pt: Point = pt, size: int = size) -> None:
                    got, lost = loop.run_until_complete(stream_exec(dp.ws_base, dp.headers, argv))
                    assert got + lost == size, f"streamed {got} + lost {lost} of {size} bytes"
                    pt.lost.append(lost)

                measure(
                    pt,
                    via,
                    lambda argv=argv: subprocess.run(argv, capture_output=True, check=True),
                    reps=reps,
                    budget=budget,
                    warm=1,
                )
                s.points.append(pt)
            out.append(s)
            c.close()
        finally:
            loop.close()
            dp.stop()
    return out


# --- output ----------------------------------------------------------------------------------


def table(series: list[Series]) -> str:
    lines = [
        "| operation | work | sandlot median | p95 | direct median | p95 | sandlot ÷ direct "
        "| sandlot growth from the first size | direct growth |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in series:
        first_a = med(s.points[0].sandlot)
        first_b = med(s.points[0].direct)
        for i, pt in enumerate(s.points):
            a, b = med(pt.sandlot), med(pt.direct)
            name = s.name if i == 0 else ""
            lines.append(
                f"| {name} | {pt.label} ({len(pt.sandlot)} samples) | {fmt(a)} | "
                f"{fmt(p95(pt.sandlot))} | {fmt(b)} | {fmt(p95(pt.direct))} | {a / b:.2f}\u00d7 "
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
        "latency vs work (log-log); solid = sandlot dataplane, dashed = direct</text>",
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
    ap.add_argument("--svg", default=str(ROOT / "docs" / "cost-growth.svg"))
    args = ap.parse_args()
    started = time.monotonic()
    series = run(args)
    Path(args.svg).parent.mkdir(parents=True, exist_ok=True)
    Path(args.svg).write_text(svg(series))
    print(
        f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}; "
        f"{'quick: at most 30 samples or 2 s' if args.quick else 'at most 200 samples or 10 s'} "
        f"per point, interleaved with the direct operation; "
        f"{time.monotonic() - started:.0f} s in all\n"
    )
    print(table(series))
    print()
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
