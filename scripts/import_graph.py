"""The import graph of ``sgrld``: levels, circles and arrows running back up.

A module's level is 0 when it imports nothing of sgrld, else one more than the highest level it
imports. Every import counts: one inside a function (a lazy import hides a circle, it does not
remove it), one of the root package (``from sgrld import x``) and one under ``if TYPE_CHECKING:``
(a type-only circle is still two modules that need each other). Circles are the strongly
connected components of more than one module; an arrow up is an import into a module of the
same or a higher level (it can only exist inside a circle). ``--rooms`` draws the same graph
between packages (``sgrld.experiments.run`` …), a module belonging to the package that holds
it, a module at the top (``sgrld.chains``) a room of its own.

Usage: ``python scripts/import_graph.py [--rooms] [--root src/sgrld]``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package → the sgrld modules it imports (anywhere in its body)."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import mod`` names a module when pkg.mod is one
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Longest path down to a module importing nothing, with each circle taken as one node."""
    member = {v: tuple(c) for c in circles(graph) for v in c}
    level: dict[str, int] = {}

    def of(v: str) -> int:
        if v in level:
            return level[v]
        group = member.get(v, (v,))
        for u in group:
            level[u] = 0  # provisional: breaks recursion inside the circle
        below = [of(w) for u in group for w in graph[u] if w not in group]
        for u in group:
            level[u] = 1 + max(below, default=-1)
        return level[v]

    for v in graph:
        of(v)
    return level


def rooms(graph: dict[str, set[str]], packages: set[str], root: str) -> dict[str, set[str]]:
    """The graph between packages: a module belongs to the package that holds it, a module at
    the top (``sgrld.chains``) is a room of its own, as the root package (its ``__init__``) is."""

    def room(name: str) -> str:
        parent = name.rpartition(".")[0]
        return name if name in packages or parent == root else parent

    out: dict[str, set[str]] = defaultdict(set)
    for v, targets in graph.items():
        out[room(v)].update(room(w) for w in targets if room(w) != room(v))
    # a package importing its own sub-packages (its __init__ re-exporting them) is no arrow
    return {v: {w for w in ws if not w.startswith(v + ".")} for v, ws in out.items()}


def report(graph: dict[str, set[str]], title: str) -> int:
    level = levels(graph)
    found = circles(graph)
    up = [(v, w) for v in graph for w in graph[v] if level[w] >= level[v]]
    print(
        f"{title}: {len(graph)} nodes on {max(level.values()) + 1} levels, "
        f"{len(found)} circles, {len(up)} arrows up"
    )
    for c in found:
        print("  circle:", " ↔ ".join(c))
    for v, w in sorted(up):
        print(f"  arrow up: {v} → {w}")
    return len(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).parents[1] / "src" / "sgrld")
    parser.add_argument("--rooms", action="store_true", help="also the graph between packages")
    parser.add_argument("--levels", action="store_true", help="list every module by level")
    args = parser.parse_args()
    graph = imports(args.root)
    count = report(graph, "modules")
    if args.levels:
        level = levels(graph)
        for n in range(max(level.values()) + 1):
            print(f"  level {n}:", ", ".join(sorted(v for v in graph if level[v] == n)))
    if args.rooms:
        packages = {
            module_name(args.root, p.parent / "__init__.py") for p in args.root.rglob("__init__.py")
        }
        count += report(rooms(graph, packages, args.root.name), "rooms (packages)")
    return 1 if count else 0


if __name__ == "__main__":
    raise SystemExit(main())
