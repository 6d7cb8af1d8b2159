"""The import graph of the five packages, read from the code (every `import`, module-level or inside a function).

    .venv/bin/python scripts/import_graph.py            # rooms, arrows between rooms, circles, upward arrows
    .venv/bin/python scripts/import_graph.py --edges    # also every module -> module arrow

Rooms, lowest first: common < buffer, actors, learner (side by side, no arrow between them) < cluster. An arrow
may only point down or within a room; a circle is a set of modules that reach each other (a strongly
connected component with more than one module). Exit status 1 when there is a circle or a forbidden arrow.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("common", "buffer", "actors", "learner", "cluster")
LEVEL = {"common": 0, "buffer": 1, "actors": 1, "learner": 1, "cluster": 2}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (a `from pkg import name` of a submodule counts as that module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
                break
    return out


def graph() -> dict[str, set[str]]:
    files = [p for room in ROOMS for p in (ROOT / room).rglob("*.py")]
    modules = {module_name(p) for p in files}
    g = {module_name(p): imports(p, modules) - {module_name(p)} for p in files}
    # a package's __init__ is reached by importing any of its modules; it is not an arrow of its own
    return {m: {d for d in deps if not (ROOMS.count(d) and m.startswith(d + "."))} for m, deps in g.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def forbidden(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows up a level, or sideways between buffer, actors and learner."""
    bad = []
    for m, deps in g.items():
        a = m.split(".")[0]
        for d in deps:
            b = d.split(".")[0]
            if a != b and LEVEL[b] >= LEVEL[a]:
                bad.append((m, d))
    return sorted(bad)


def main(argv: list[str]) -> int:
    g = graph()
    rooms = defaultdict(set)
    for m, deps in g.items():
        for d in deps:
            a, b = m.split(".")[0], d.split(".")[0]
            if a != b:
                rooms[a].add(b)
    print("arrows between rooms: " + "; ".join(f"{a} -> {', '.join(sorted(rooms[a]))}" for a in ROOMS if rooms[a]))
    cs, bad = circles(g), forbidden(g)
    print("circles: " + ("none" if not cs else " | ".join(" <-> ".join(c) for c in cs)))
    print("arrows up or sideways: " + ("none" if not bad else ", ".join(f"{a} -> {b}" for a, b in bad)))
    sizes = sorted(((len((ROOT / (m.replace(".", "/") + ".py")).read_text().splitlines()), m) for m in g
                    if (ROOT / (m.replace(".", "/") + ".py")).exists()), reverse=True)[:5]
    print("longest files: " + ", ".join(f"{m} {n}" for n, m in sizes))
    if "--edges" in argv:
        for m in sorted(g):
            print(f"  {m} -> {', '.join(sorted(g[m])) or '-'}")
    return 1 if cs or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
