"""Build script: drives CMake (Ninja) to build the ``transformer_linear._C`` module.

Environment switches:
  TL_CUDA=auto|0|1       compile the CUDA kernels (auto: when nvcc and cuBLASLt are found).
  TL_CUDA_ARCHS="80;90-real" CUDA architectures (default chosen by cmake/cuda.cmake).
  TL_CUBLAS_ROOT=DIR     cuBLASLt's include/ and lib/ (default: the CUDA toolkit, then the
                         nvidia-cublas wheel of the building Python: use --no-build-isolation).
  TL_BUILD_TYPE=Release  CMake build type (Release unless asked).
  CMAKE_ARGS             extra arguments passed to CMake verbatim.
  CMAKE_BUILD_PARALLEL_LEVEL  parallel build jobs.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

# What a CMake build folder was configured with, written beside its CMakeCache.txt.
CONFIG_STAMP = "tl_build_config.json"
# Environment variables CMake reads only when it first configures a folder.
CONFIGURE_ENV = ("CC", "CXX", "CUDACXX", "CUDAHOSTCXX", "CUDA_HOME", "CUDA_PATH", "TL_CUBLAS_ROOT")
# Tools CMake finds on PATH when it first configures a folder.
CONFIGURE_TOOLS = ("cmake", "c++", "nvcc")


def build_config(cmake_args: list[str]) -> dict:
    """Everything a configured build folder depends on: the tools, the arguments, the environment.

    pip builds in the source tree, each time in a fresh, throw-away build
    environment: a CMakeCache.txt from an earlier install points at that
    environment's (deleted) ninja, pybind11 and Python. Comparing this record
    with the one a folder was configured with tells when the folder is stale.
    """
    return {
        "tools": {name: shutil.which(name) for name in CONFIGURE_TOOLS},
        "cmake_args": cmake_args,
        "environment": {name: os.environ.get(name) for name in CONFIGURE_ENV},
    }


def prepare_build_folder(build_temp: Path, config: dict) -> None:
    """Empty ``build_temp`` unless it was last configured successfully with exactly ``config``.

    A folder holding a CMake cache but no record (made by an older setup.py,
    by hand, or by a configure step that failed) is never reused blindly.
    """
    stamp = build_temp / CONFIG_STAMP
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        recorded = None
    if recorded != config and build_temp.exists():
        shutil.rmtree(build_temp)
    build_temp.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)  # rewritten once CMake has configured the folder


def configure(sourcedir: str, build_temp: Path, cmake_args: list[str]) -> None:
    """Run CMake's configure step in ``build_temp``, starting afresh when the folder is stale."""
    config = build_config(cmake_args)
    prepare_build_folder(build_temp, config)
    subprocess.run(["cmake", sourcedir, *cmake_args], cwd=build_temp, check=True)
    (build_temp / CONFIG_STAMP).write_text(json.dumps(config, indent=1, sort_keys=True))


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path = ROOT) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = os.fspath(sourcedir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        ext_fullpath = Path.cwd() / self.get_ext_fullpath(ext.name)
        extdir = ext_fullpath.parent.resolve()
        build_type = os.environ.get("TL_BUILD_TYPE", "Debug" if self.debug else "Release")
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DTL_CUDA={os.environ.get('TL_CUDA', 'auto')}",
            "-G",
            "Ninja",
        ]
        ninja = shutil.which("ninja")
        if ninja:
            cmake_args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        if "TL_CUDA_ARCHS" in os.environ:
            cmake_args.append(f"-DTL_CUDA_ARCHS={os.environ['TL_CUDA_ARCHS']}")
        cmake_args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        try:
            import pybind11

            cmake_args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass

        build_args = ["--config", build_type]
        if "CMAKE_BUILD_PARALLEL_LEVEL" not in os.environ:
            build_args += [f"-j{os.cpu_count() or 2}"]

        build_temp = Path(self.build_temp) / ext.name
        configure(ext.sourcedir, build_temp, cmake_args)
        subprocess.run(["cmake", "--build", ".", *build_args], cwd=build_temp, check=True)


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    setup(
        ext_modules=[CMakeExtension("transformer_linear._C")],
        cmdclass={"build_ext": CMakeBuild},
    )
