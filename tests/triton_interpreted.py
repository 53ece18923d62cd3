"""Runs a test module's Triton tests under Triton's interpreter, in a fresh Python.

TRITON_INTERPRET=1 must be set before triton is first imported, so each Triton test module holds, in a
normal run, one test that runs the module again in a subprocess with the variable set (where its real
tests are defined) and fails with that run's output if any of them fails.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import transformer_linear


def run_interpreted(test_file: str, tmp_path: pathlib.Path) -> None:
    """Run ``test_file`` with TRITON_INTERPRET=1; fails unless its tests pass and none is skipped."""
    pytest.importorskip("triton", reason="triton is in the 'test' extra")
    # From an empty folder (`python -m` puts the current directory first on sys.path, and from the
    # repository root the source tree's transformer_linear, without a built extension, would shadow an
    # installed package), with the package under test (the one imported here) first on the path.
    package_root = str(pathlib.Path(transformer_linear.__file__).resolve().parent.parent)
    path = os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-x"],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"interpreted Triton tests failed:\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
