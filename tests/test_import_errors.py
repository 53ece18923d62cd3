"""Importing the package from a source folder that has no built extension (Python run from a clone's root
after ``pip install .``: the clone's ``transformer_linear/`` shadows the installed package) says what
happened and what to do, instead of a circular-import error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import transformer_linear

# An editable install's finder would find the extension beside the real sources: the child drops it, as a
# non-editable install has none.
_IMPORT = """
import sys
sys.meta_path = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]
import transformer_linear
"""


def test_source_folder_without_the_extension(tmp_path):
    package = Path(transformer_linear.__file__).parent
    shutil.copytree(package, tmp_path / "transformer_linear",
                    ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    run = subprocess.run([sys.executable, "-c", _IMPORT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "the compiled extension (_C) is not in" in last and "pip install -e ." in last, run.stderr
    assert "circular import" not in last
