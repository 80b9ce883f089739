"""Fails when the product packages' Python modules import each other in a circle.

    python ci/check_imports.py [ROOT]

A circle (a imports b, b imports a — directly or through other modules) makes the import
order matter, hides which module is the lower layer and breaks as soon as one side uses the
other at import time. Every import counts, function-local ones included (they still tie the
two modules together); an import under `if TYPE_CHECKING:` never runs and does not count, nor
does a module importing its own parent packages (Python loads those first anyway).
Reads the sources with `ast`: nothing is imported, so it runs without torch.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SOURCE_ROOTS = ("packages/*/python", "packages/*/src")


def find_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Maps each dotted module name to (file, is_package) for the product packages."""
    modules: dict[str, tuple[Path, bool]] = {}
    for pattern in SOURCE_ROOTS:
        for base in root.glob(pattern):
            for path in base.rglob("*.py"):
                if "build" in path.relative_to(base).parts:
                    continue
                parts = list(path.relative_to(base).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                if is_package:
                    parts.pop()
                modules[".".join(parts)] = (path, is_package)
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        # `from pkg import name` may name a submodule: try both.
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            for target in _imported_names(node, package):
                while target and target not in modules:  # the deepest module it names
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
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
                    found.append(sorted(component))
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    modules = find_modules(root)
    if not modules:
        print(f"check_imports: no Python modules under {root}/{SOURCE_ROOTS}", file=sys.stderr)
        return 2
    graph = import_graph(modules)
    found = circles(graph)
    for component in found:
        members = set(component)
        print("import circle:")
        for name in component:
            print(
                f"  {modules[name][0].relative_to(root)}: imports {sorted(graph[name] & members)}"
            )
    print(f"check_imports: {len(modules)} modules, {len(found)} import circles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
