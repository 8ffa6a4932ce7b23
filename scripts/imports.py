#!/usr/bin/env python3
"""The import graph of ``src/sandlot``: cycles and arrows that must not exist.

    python scripts/imports.py            # prints what is wrong; exit 1 if anything is
    python scripts/imports.py --graph    # also prints every package-level arrow

Every ``import`` counts, wherever it is written (inside a function or under
``TYPE_CHECKING`` too): an import moved into a function hides a cycle from
Python, not from the design. A cycle is a set of modules each reachable from the
others (a strongly connected component of more than one module). Every package has
an ``__init__.py``. No module uses
another module's underscore names (``from m import _x``, ``m._x``). The packages'
arrows run one way (docs/ARCHITECTURE.md); the ones checked here (a package is
named from ``sandlot``, and covers its subpackages):
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"

#: Folders of scripts loaded by path, not imported (Alembic's migrations).
LOADED_BY_PATH = {"versions"}

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
    # The dataplane's services know nothing of HTTP.
    ("dataplane.services", "dataplane.http"),
    ("dataplane.services", "starlette"),
    ("dataplane.services", "fastapi"),
    ("dataplane.services", "uvicorn"),
    ("protocol", "starlette"),
    ("protocol", "fastapi"),
]
#: The web server's gateway to upstreams stands on the protocol alone (and httpx,
#: websockets, prometheus_client): no other package of sandlot, no web framework.
GATEWAY = ["web.allowlist", "web.breaker", "web.errors", "web.gateway", "web.metrics"]
GATEWAY += ["web.pinning", "web.relay"]
NOT_UNDER_GATEWAY = ["broker", "cli", "dataplane", "integrations", "providers", "runtime", "sdk"]
NOT_UNDER_GATEWAY += ["starlette", "fastapi", "uvicorn"]
FORBIDDEN += [(module, package) for module in GATEWAY for package in NOT_UNDER_GATEWAY]
__doc__ = (__doc__ or "") + "".join(f"\n- no ``{a}`` → ``{b}``" for a, b in FORBIDDEN)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class Imports:
    """What one module imports: sandlot modules, other top-level packages, and
    underscore names of other sandlot modules it uses."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.external: set[str] = set()
        self.private: list[str] = []


def imports_of(path: Path, name: str, known: set[str]) -> Imports:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = Imports()
    aliases: dict[str, str] = {}  # local name → sandlot module it is bound to

    def private(attr: str) -> bool:
        return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))

    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.append(alias.name)
                if alias.asname and alias.name in known:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b`` imports the module a.b if there is one, else a name of a.
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    targets.append(full)
                    aliases[alias.asname or alias.name] = full
                else:
                    targets.append(base)
                    if base in known and base != name and private(alias.name):
                        found.private.append(f"from {base} import {alias.name}")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != name
            and private(node.attr)
        ):
            found.private.append(f"{aliases[node.value.id]}.{node.attr}")
        for target in targets:
            if not target.startswith("sandlot.") and target != "sandlot":
                found.external.add(target.split(".")[0])
                continue
            # The longest known module the target names (a.b.c → a.b if c is a name).
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("sandlot."):
                found.modules.add(target)
    return found


def within(module: str, package: str) -> bool:
    """Whether ``module`` (``sandlot.a.b``, or a top-level ``starlette``) is in ``package``
    (``a``, ``a.b``, or a third-party ``starlette``)."""
    dotted = module.removeprefix("sandlot.")
    return dotted == package or dotted.startswith(package + ".")


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
    found = {name: imports_of(path, name, known) for name, path in files.items()}
    graph = {name: imp.modules for name, imp in found.items()}
    problems = 0
    for folder in sorted({path.parent for path in files.values()}):
        if not (folder / "__init__.py").exists() and folder.name not in LOADED_BY_PATH:
            # A namespace package: importlib.resources cannot read files beside its modules.
            problems += 1
            print(f"package without __init__.py: {folder.relative_to(ROOT)}")
    for component in strongly_connected(graph):
        problems += 1
        print(f"cycle: {' ↔ '.join(component)}")
    for name, imp in sorted(found.items()):
        for use in imp.private:
            problems += 1
            print(f"private name of another module: {name} uses {use}")
        targets = [*imp.modules, *imp.external]
        for a, b in FORBIDDEN:
            if within(name, a):
                for target in sorted(t for t in targets if within(t, b) and not within(t, a)):
                    problems += 1
                    print(f"forbidden arrow {a} → {b}: {name} → {target}")
    if args.graph:
        arrows: dict[tuple[str, str], int] = defaultdict(int)
        for name, targets in graph.items():
            for target in targets:
                a, b = package_of(name), package_of(target)
                if a and b and a != b:
                    arrows[a, b] += 1
        for (a, b), count in sorted(arrows.items()):
            print(f"{a} → {b} ({count} imports)")
    if problems:
        print(f"{problems} problem(s) in the import graph of src/sandlot", file=sys.stderr)
        return 1
    print(f"{len(files)} modules: no cycle, no forbidden arrow, no other module's private name")
    return 0


if __name__ == "__main__":
    sys.exit(main())
