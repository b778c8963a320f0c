"""The import graph of the product's packages: who imports whom, the cycles, and how deep.

    python scripts/import_graph.py            # a summary per package
    python scripts/import_graph.py --cycles   # every import cycle (strongly connected set)

Imports are read from the source (`ast`), at any depth of a module: a function-local import
and one under `TYPE_CHECKING` are arrows too (a module that names another's types depends on
its design, run time or not). An arrow is an import of
one product module by another; a package's `__init__` counts as a module. A *floor* is a level
of the package's own import order: modules that import nothing of the package are on floor 1,
a module is one floor above the highest it imports (cycles collapse to one node first). A
*room* is a folder.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("refit_sidecar", "inference_ext", "trainer_svc", "trainer_refit", "megatron_hf")
GENERATED = ("trainer_refit/v1/",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if not any(relative.startswith(g) for g in GENERATED):
                found[module_name(path)] = path
    return found


def _imported(tree: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every product module and the product modules it imports."""
    modules = product_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {t for t in _imported(tree, name, path.name == "__init__.py") if t in modules}
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@dataclass(frozen=True)
class PackageSummary:
    package: str
    modules: int
    lines: int
    rooms: int
    """Direct sub-folders that hold modules."""
    floors: int
    arrows: int
    """Imports between the package's own modules."""


def _floors(graph: dict[str, set[str]]) -> int:
    component: dict[str, int] = {}
    for number, members in enumerate(cycles(graph)):
        for member in members:
            component[member] = number
    node = {m: f"cycle-{component[m]}" if m in component else m for m in graph}
    condensed: dict[str, set[str]] = {}
    for source, targets in graph.items():
        condensed.setdefault(node[source], set()).update(
            node[t] for t in targets if node[t] != node[source]
        )
    level: dict[str, int] = {}

    def height(name: str) -> int:
        if name not in level:
            level[name] = 1 + max((height(t) for t in condensed.get(name, ())), default=0)
        return level[name]

    return max((height(n) for n in condensed), default=0)


def summarize(package: str, graph: dict[str, set[str]], root: Path = ROOT) -> PackageSummary:
    own = {m for m in graph if m == package or m.startswith(package + ".")}
    inner = {m: graph[m] & own for m in own}
    paths = product_modules(root)
    rooms = {
        paths[m].relative_to(root / package).parts[0]
        for m in own
        if len(paths[m].relative_to(root / package).parts) > 1
    }
    return PackageSummary(
        package=package,
        modules=len(own),
        lines=sum(len(paths[m].read_text().splitlines()) for m in own),
        rooms=len(rooms),
        floors=_floors(inner),
        arrows=sum(len(t) for t in inner.values()),
    )


def longest_functions(root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, module:qualified name) of every function and method, longest first."""
    found: list[tuple[int, str]] = []
    for name, path in product_modules(root).items():
        tree = ast.parse(path.read_text(), str(path))

        def walk(node: ast.AST, prefix: str, module: str = name) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    qualified = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        lines = (child.end_lineno or child.lineno) - child.lineno + 1
                        found.append((lines, f"{module}:{qualified}"))
                    walk(child, qualified + ".")

        walk(tree, "")
    return sorted(found, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", action="store_true", help="list every import cycle")
    parser.add_argument(
        "--longest", type=int, metavar="N", help="the N longest modules and functions"
    )
    args = parser.parse_args(argv)
    graph = import_graph()
    found = cycles(graph)
    if args.cycles:
        for members in found:
            print(" <-> ".join(members))
        return 0
    if args.longest:
        paths = product_modules()
        sizes = sorted(
            ((len(p.read_text().splitlines()), m) for m, p in paths.items()), reverse=True
        )
        for lines, module in sizes[: args.longest]:
            print(f"{lines:>6}  {module}")
        for lines, function in longest_functions()[: args.longest]:
            print(f"{lines:>6}  {function}")
        return 0
    print(f"{'package':<16}{'modules':>8}{'lines':>8}{'rooms':>7}{'floors':>8}{'arrows':>8}")
    for package in PACKAGES:
        s = summarize(package, graph)
        print(f"{s.package:<16}{s.modules:>8}{s.lines:>8}{s.rooms:>7}{s.floors:>8}{s.arrows:>8}")
    print(f"import cycles in the whole product: {len(found)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
