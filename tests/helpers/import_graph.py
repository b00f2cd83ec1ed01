"""The import graph of the project's packages, read from the source with `ast` (nothing is imported).

An edge `a -> b` means module `a` runs `import b` (or `from b import ...`, or `from pkg import b` where `b` is a
submodule) when it is imported. Only module-level imports count: imports inside functions run later, and
imports under `if TYPE_CHECKING:` never run. Importing `pkg.mod` also runs `pkg/__init__.py`; that implied edge is
left out, as every import linter does, since a package's `__init__` importing its own submodules is normal.
`deferred=True` adds the function-level and TYPE_CHECKING imports too.

The layer rule (`upward_imports`): the folders of `LAYERS`, bottom to top; a module belongs to the longest
folder of the list that contains it, and may import only modules of its own folder or of folders below it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGES = ("framework", "model_states", "samplers", "speculators")

# The layer folders, bottom to top. `framework` last: its loose modules and `__init__` (the public API) may import
# anything, and nothing below may import them.
LAYERS = (
    "framework.params",
    "framework.config",
    "framework.layers.kernels",
    "framework.layers.attention",
    "framework.layers.parallel",
    "framework.layers.quantization",
    "framework.models",
    "framework.batch",
    "framework.kv_transfer",
    "samplers",
    "model_states",
    "speculators",
    "framework.runner",
    "framework.executor",
    "framework.engine",
    "framework.entrypoints",
    "framework",
)


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (a package is its `__init__.py`)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list[ast.stmt], deferred: bool = False) -> Iterator[ast.stmt]:
    """Statements that run on import: into if/try/with/class bodies, not into functions or TYPE_CHECKING
    (unless `deferred`)."""
    for node in body:
        if not deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not deferred and isinstance(node, ast.If) and _is_type_checking(node):
            yield from _module_level(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _module_level(inner, deferred)


def _imported_names(node: ast.stmt, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: `from . import x` in package a.b is a.b.x; each extra dot goes one level up
        parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES, deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports at module level (and in functions, if `deferred`)."""
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _module_level(ast.parse(path.read_text(), str(path)).body, deferred):
            for target in _imported_names(node, package, modules):
                while target and target not in modules:  # `from a.b import func` -> a.b; outside modules -> ""
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph is a DAG (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return []


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> str | None:
    """The folder of `layers` that `module` belongs to (the longest one containing it), or None."""
    folders = [f for f in layers if module == f or module.startswith(f + ".")]
    return max(folders, key=len) if folders else None


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...] = LAYERS) -> list[tuple[str, str]]:
    """Sorted (importer, imported) edges where the imported module's folder is above the importer's in `layers`
    (or either module is in no folder of `layers`)."""
    rank = {folder: i for i, folder in enumerate(layers)}
    bad = []
    for importer, imported in graph.items():
        own = layer_of(importer, layers)
        for target in imported:
            theirs = layer_of(target, layers)
            if own is None or theirs is None or rank[theirs] > rank[own]:
                bad.append((importer, target))
    return sorted(bad)
