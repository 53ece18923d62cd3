"""The scaling layer sits below the ops and their backends: what the low modules and the Triton kernels
may import from the package (read from the sources, so a function-local import counts too)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "transformer_linear"

# Module -> the package modules it may import. The dtypes, the argument checks, the GEMM scalings and
# the operand layouts are below everything; the Triton kernels use only those.
LOW_MODULES = {
    "dtypes.py": set(),
    "_checks.py": {"dtypes"},
    "layout.py": {"dtypes"},
    "block_scaling.py": {"_checks", "dtypes"},
    "grouped_scaling.py": {"_checks", "block_scaling", "dtypes"},
}
TRITON_MAY_IMPORT = {"_checks", "block_scaling", "dtypes", "grouped_scaling", "triton"}


def package_imports(path: pathlib.Path) -> set[str]:
    """The package modules ``path`` imports anywhere in its body, by their first name below the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "transformer_linear":
                names = [f"transformer_linear.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        else:
            continue
        found |= {name.split(".")[1] for name in names if name.startswith("transformer_linear.")}
    return found


@pytest.mark.parametrize("module", sorted(LOW_MODULES))
def test_low_modules_import_nothing_above_them(module):
    assert package_imports(PACKAGE / module) <= LOW_MODULES[module]


@pytest.mark.parametrize("module", sorted(p.name for p in (PACKAGE / "triton").glob("*.py")))
def test_triton_kernels_do_not_import_the_ops_or_the_oracle(module):
    """No circle through the ops that call them, and no production use of the test oracle."""
    assert package_imports(PACKAGE / "triton" / module) <= TRITON_MAY_IMPORT


@pytest.mark.parametrize("module", ["ops.py", "ops_blockwise.py", "ops_grouped.py", "_block_gemm_cuda.py", "recipe.py"])
def test_the_ops_and_recipes_do_not_import_the_oracle(module):
    assert "reference" not in package_imports(PACKAGE / module)
