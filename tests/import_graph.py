"""The import graph of the project's packages, read from the source with `ast` (nothing is imported).

An edge `a -> b` means module `a` runs `import b` (or `from b import ...`, or `from pkg import b` where `b` is a
submodule) when it is imported. Only module-level imports count: imports inside functions run later, and
imports under `if TYPE_CHECKING:` never run. Importing `pkg.mod` also runs `pkg/__init__.py`; that implied edge is
left out, as every import linter does, since a package's `__init__` importing its own submodules is normal.
`deferred=True` adds the function-level and TYPE_CHECKING imports too.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGES = ("framework", "model_states", "samplers", "speculators")

# The bottom layer of `framework` that the samplers share with the runner: its kernels and the plain types the
# sampler states read (request parameters and their checks, what a new request brings, staged per-slot writes,
# request errors).
# Each imports only this layer, so nothing above it comes in through them.
KERNEL_PACKAGES = ("framework.layers.kernels",)
SHARED_PLAIN_TYPES = (
    "framework.params.encoder_input",
    "framework.params.pooling_params",
    "framework.params.request_errors",
    "framework.params.sampling_params",
    "framework.params.scheduler_output",
    "framework.batch.staged_writes",
    "framework.params.structured_outputs",
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


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def below_the_runner(module: str) -> bool:
    """Whether `module` is a kernel module or one of the shared plain types."""
    return module in SHARED_PLAIN_TYPES or any(_in_package(module, p) for p in KERNEL_PACKAGES)


def layer_violations(graph: dict[str, set[str]], package: str = "samplers") -> list[tuple[str, str]]:
    """Edges (a, b) that break "`package` imports nothing above the kernels and the shared plain types": a
    module of `package` importing a project module outside `package` and that bottom layer, or a bottom-layer
    module (one `package` may reach) importing something above the bottom layer."""
    bad = [
        (a, b)
        for a in sorted(graph)
        if _in_package(a, package)
        for b in sorted(graph[a])
        if not (_in_package(b, package) or below_the_runner(b))
    ]
    reached, todo = set(), [b for a in graph if _in_package(a, package) for b in graph[a] if below_the_runner(b)]
    while todo:  # the bottom-layer modules the package reaches, through each other
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += [b for b in graph.get(module, ()) if below_the_runner(b)]
    bad += [(a, b) for a in sorted(reached) for b in sorted(graph.get(a, ())) if not below_the_runner(b)]
    return bad


def is_under(module: str, packages: tuple[str, ...]) -> bool:
    """Whether `module` is one of `packages` (dotted names) or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def forbidden_imports(
    graph: dict[str, set[str]], importers: tuple[str, ...], targets: tuple[str, ...], allowed: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """Sorted (importer, imported) edges from a module under `importers` (not under `allowed`) to one under
    `targets`."""
    return sorted(
        (m, t)
        for m, imported in graph.items()
        if is_under(m, importers) and not is_under(m, allowed)
        for t in imported
        if is_under(t, targets)
    )


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start` imports, directly or through others (`start` excluded)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen and nxt != start:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def reached_upward(graph: dict[str, set[str]], lower: tuple[str, ...], upper: tuple[str, ...]) -> list[tuple[str, str]]:
    """Sorted (module under `lower`, module under `upper` it reaches): a lower layer depending on a higher one."""
    return sorted((m, t) for m in graph if is_under(m, lower) for t in reachable(graph, m) if is_under(t, upper))
