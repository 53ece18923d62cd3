"""The package's layers, read from its sources: each module imports only its own layer and the ones below
it, no modules import each other in a circle, and no function imports the package's own modules.

The layers, bottom to top (the docs/architecture.md):

- ``formats``: dtypes, GEMM scalings and scale layouts, operand layouts, argument checks;
- ``reference``: the pure-PyTorch oracle of every numeric op;
- ``ops``: the custom ops and their backends (the C++ extension, CUDA routing, Triton kernels);
- ``recipe``: recipes, their quantizers and the delayed-scaling state;
- ``modules``: ``Linear`` and the ways to turn FP8 on;
- the tools on top: ``distributed``, ``numerics``, ``cli``, ``integrations`` and the package's ``__init__``.

``_handles`` and ``_compile_cache`` are utilities below every layer.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "transformer_linear"

LAYERS = ("_handles", "_compile_cache", "_C", "formats", "reference", "ops", "recipe", "modules")
TOP = ("distributed", "optim", "numerics", "cli", "integrations", "__init__", "__main__")

# Function-local imports of the package's own modules, each with its reason.
LOCAL_IMPORTS_ALLOWED = {
    ("ops/triton_route.py", "transformer_linear.ops.triton"): "triton is an optional dependency, imported on first "
    "GPU use",
}

MODULES = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["transformer_linear", *parts])


class _Imports(ast.NodeVisitor):
    """The package modules a source imports, split into module-level and function-local (imports under
    ``if TYPE_CHECKING:``, for annotations only, count as module-level: a layer's annotations name only its
    layer and those below too)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.top: set[str] = set()
        self.local: set[str] = set()
        self._depth = 0

    def _add(self, names: list[str]) -> None:
        found = {n for n in names if n == "transformer_linear" or n.startswith("transformer_linear.")}
        (self.local if self._depth else self.top).update(found)

    def _visit_scope(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_scope

    def visit_Import(self, node: ast.Import) -> None:
        self._add([alias.name for alias in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module if self.is_package else self.module.rsplit(".", 1)[0]
            package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{package}.{base}" if base else package
        # `from package import name` may import a submodule: count both, the existing one is kept below.
        self._add([base, *(f"{base}.{alias.name}" for alias in node.names)])


def _existing(name: str) -> str | None:
    """The package module ``name`` names (a dotted path to a module or subpackage), or None."""
    rel = name.split(".")[1:]
    if not rel:
        return "transformer_linear"
    path = PACKAGE.joinpath(*rel)
    if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
        return name
    return None


def imports_of(rel: str) -> tuple[set[str], set[str]]:
    """(module-level, function-local) package modules that ``rel`` imports (annotation-only ones included)."""
    visitor = _Imports(_module_name(rel), rel.endswith("__init__.py"))
    visitor.visit(ast.parse((PACKAGE / rel).read_text()))

    def resolve(names: set[str]) -> set[str]:
        found = {_existing(n) for n in names} - {None}
        # `from transformer_linear import ops` names the package and its submodule: keep the deepest.
        return {n for n in found if not any(o != n and o.startswith(n + ".") for o in found)} or found

    return resolve(visitor.top), resolve(visitor.local)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank(layer: str) -> int:
    return LAYERS.index(layer) if layer in LAYERS else len(LAYERS)


@pytest.mark.parametrize("rel", MODULES)
def test_each_module_imports_only_its_layer_and_the_layers_below(rel):
    module = _module_name(rel)
    own = layer_of(module)
    assert own in LAYERS or own in TOP, f"{rel}: not in a known layer; add it to LAYERS or TOP"
    top, _ = imports_of(rel)
    above = sorted(m for m in top if rank(layer_of(m)) > rank(own) and layer_of(m) != own)
    assert not above, f"{rel} ({own}) imports the layers above it: {above}"


def test_no_import_cycles():
    def with_packages(module: str, deps: set[str]) -> set[str]:
        """``deps`` and the packages above them whose __init__ importing them runs: not the root's (it imports
        everything) and not those of packages ``module`` is in (initialized before it)."""
        packages = {".".join(d.split(".")[:i]) for d in deps for i in range(2, d.count(".") + 1)}
        return deps | {p for p in packages if not (module == p or module.startswith(p + "."))}

    graph = {
        _module_name(rel): with_packages(_module_name(rel), imports_of(rel)[0] - {"transformer_linear"})
        for rel in MODULES
    }
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep == node:
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("rel", MODULES)
def test_no_function_local_imports_of_the_package(rel):
    _, local = imports_of(rel)
    unexplained = sorted(m for m in local if (rel, m) not in LOCAL_IMPORTS_ALLOWED)
    assert not unexplained, f"{rel} imports {unexplained} inside a function"


@pytest.mark.parametrize("rel", [r for r in MODULES if r.startswith("ops/triton/")])
def test_triton_kernels_import_only_the_formats(rel):
    """No circle through the ops that call them, and no production use of the test oracle: the formats, each
    other, and ops.library (where every op is registered; it imports nothing of the package)."""
    top, local = imports_of(rel)
    assert {layer_of(m) for m in top | local} <= {"formats", "ops"}
    ops_imports = [m for m in top | local if layer_of(m) == "ops"]
    assert all(m.startswith("transformer_linear.ops.triton") or m == "transformer_linear.ops.library"
               for m in ops_imports), ops_imports
    assert not [m for m in imports_of("ops/library.py")[0] if m.startswith("transformer_linear")]


@pytest.mark.parametrize(
    "rel",
    [
        "ops/__init__.py", "ops/block.py", "ops/nvfp4.py", "ops/nvfp4_quantize.py", "ops/nvfp4_gemm.py",
        "ops/nvfp4_packed_scales.py", "ops/nvfp4_checks.py", "ops/grouped.py", "ops/gemm_block_cuda.py",
        "recipe/__init__.py",
    ],
)
def test_the_ops_and_recipes_do_not_import_the_oracle(rel):
    top, local = imports_of(rel)
    assert not [m for m in top | local if layer_of(m) == "reference"]
