"""The build: a second install in one checkout never reuses a stale CMake cache; the wheel holds every package.

pip builds in the source tree, each time in a fresh build environment that is
deleted afterwards; a CMakeCache.txt from the first install points at that
environment's ninja. These tests drive setup.py's configure step (CMake's
configure only, a couple of seconds) the way two installs in a row do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_setup():
    spec = importlib.util.spec_from_file_location("tl_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the helpers, does not call setup()
    return module


setup_py = _load_setup()


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    assert path, f"{name} is a test dependency (pip install '.[test]') and was not found"
    return path


def _cmake_args(ninja: str) -> list[str]:
    import pybind11  # a test dependency, like cmake and ninja

    return [
        "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}", "-DTL_CUDA=0",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}",
    ]


def _throwaway_ninja(folder: Path) -> str:
    """A copy of ninja in a folder that is deleted later, like pip's build-isolation environment."""
    folder.mkdir(parents=True)
    return str(shutil.copy2(_tool("ninja"), folder / "ninja"))


def test_second_configure_after_the_first_build_environment_is_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(_tool("cmake")) + os.pathsep + os.environ["PATH"])
    build = tmp_path / "build" / "temp" / "transformer_linear._C"
    first_env = tmp_path / "pip-build-env-1"
    setup_py.configure(str(ROOT), build, _cmake_args(_throwaway_ninja(first_env)))
    assert (build / "CMakeCache.txt").exists()
    shutil.rmtree(first_env)

    # Plain CMake would re-run the deleted ninja from the cache and fail here.
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(["cmake", str(ROOT), "-G", "Ninja"], cwd=build, check=True, capture_output=True)
    setup_py.configure(str(ROOT), build, _cmake_args(_throwaway_ninja(tmp_path / "pip-build-env-2")))
    cache = (build / "CMakeCache.txt").read_text()
    assert "pip-build-env-2" in cache and "pip-build-env-1" not in cache


def _configured_folder(tmp_path: Path, config: dict) -> Path:
    build = tmp_path / "build"
    setup_py.prepare_build_folder(build, config)
    (build / "CMakeCache.txt").write_text("cache")
    (build / setup_py.CONFIG_STAMP).write_text(json.dumps(config, indent=1, sort_keys=True))
    return build


def test_same_configuration_keeps_the_folder(tmp_path):
    config = setup_py.build_config(["-DTL_CUDA=0"])
    build = _configured_folder(tmp_path, config)
    setup_py.prepare_build_folder(build, setup_py.build_config(["-DTL_CUDA=0"]))
    assert (build / "CMakeCache.txt").exists(), "an up-to-date folder must be reused (incremental builds)"


@pytest.mark.parametrize(
    "change",
    ["cuda_switch", "python", "generator", "compiler_env", "missing_record", "corrupt_record"],
)
def test_changed_configuration_starts_afresh(tmp_path, monkeypatch, change):
    args = ["-G", "Ninja", "-DTL_CUDA=0", f"-DPython_EXECUTABLE={sys.executable}"]
    build = _configured_folder(tmp_path, setup_py.build_config(args))
    if change == "cuda_switch":
        args = [a.replace("TL_CUDA=0", "TL_CUDA=1") for a in args]
    elif change == "python":
        args = args[:-1] + ["-DPython_EXECUTABLE=/other/venv/bin/python3"]
    elif change == "generator":
        args = ["-G", "Unix Makefiles"] + args[2:]
    elif change == "compiler_env":
        monkeypatch.setenv("CXX", "/opt/other/g++")
    elif change == "missing_record":
        (build / setup_py.CONFIG_STAMP).unlink()
    else:
        (build / setup_py.CONFIG_STAMP).write_text("{not json")
    setup_py.prepare_build_folder(build, setup_py.build_config(args))
    assert build.is_dir() and not (build / "CMakeCache.txt").exists(), f"stale cache reused after {change}"


def test_the_wheel_lists_every_subpackage():
    """pyproject.toml names the packages a wheel holds: a subpackage missing there installs without it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    package_root = ROOT / "transformer_linear"
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in package_root.rglob("__init__.py")
    }
    assert listed == found
