#!/usr/bin/env python3
"""The import graph of ``src/sandlot``: cycles and arrows that must not exist.

    python scripts/imports.py            # prints what is wrong; exit 1 if anything is
    python scripts/imports.py --graph    # also prints every package-level arrow

Every ``import`` counts, wherever it is written (inside a function or under
``TYPE_CHECKING`` too): an import moved into a function hides a cycle from
Python, not from the design. A cycle is a set of modules each reachable from the
others (a strongly connected component of more than one module). The packages'
arrows run one way (docs/ARCHITECTURE.md); the ones checked here:
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"

#: (from package, to package): arrows that must not exist.
FORBIDDEN = [
    ("dataplane", "providers"),
    ("dataplane", "broker"),
    ("runtime", "dataplane"),
    ("runtime", "broker"),
    ("protocol", "dataplane"),
    ("protocol", "broker"),
    ("protocol", "providers"),
    ("protocol", "runtime"),
    ("sdk", "dataplane"),
    ("sdk", "broker"),
    ("sdk", "providers"),
    ("sdk", "runtime"),
]
__doc__ = (__doc__ or "") + "".join(f"\n- no ``{a}`` → ``{b}``" for a, b in FORBIDDEN)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b`` imports the module a.b if there is one, else a name of a.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            # The longest known module the target names (a.b.c → a.b if c is a name).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("sandlot."):
                found.add(target)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print the package arrows")
    args = parser.parse_args()
    files = {module_name(p): p for p in sorted((ROOT / "sandlot").rglob("*.py"))}
    known = set(files)
    graph = {name: imports_of(path, name, known) for name, path in files.items()}
    problems = 0
    for component in strongly_connected(graph):
        problems += 1
        print(f"cycle: {' ↔ '.join(component)}")
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, targets in graph.items():
        for target in targets:
            a, b = package_of(name), package_of(target)
            if a and b and a != b:
                arrows[a, b].append(f"{name} → {target}")
    for forbidden in FORBIDDEN:
        for line in arrows.get(forbidden, []):
            problems += 1
            print(f"forbidden arrow {forbidden[0]} → {forbidden[1]}: {line}")
    if args.graph:
        for (a, b), lines in sorted(arrows.items()):
            print(f"{a} → {b} ({len(lines)} imports)")
    if problems:
        print(f"{problems} problem(s) in the import graph of src/sandlot", file=sys.stderr)
        return 1
    print(f"{len(files)} modules: no cycle, no forbidden arrow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
