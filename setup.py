"""Build script: drives CMake (Ninja) to build the ``transformer_linear._C`` module.

Environment switches:
  TL_CUDA=auto|0|1       compile the CUDA kernels (auto: when nvcc and cuBLASLt are found).
  TL_CUDA_ARCHS="89;90a" CUDA architectures (default chosen by cmake/cuda.cmake).
  TL_CUBLAS_ROOT=DIR     cuBLASLt's include/ and lib/ (default: the CUDA toolkit, then the
                         nvidia-cublas wheel of the building Python: use --no-build-isolation).
  TL_BUILD_TYPE=Release  CMake build type (Release unless asked).
  CMAKE_ARGS             extra arguments passed to CMake verbatim.
  CMAKE_BUILD_PARALLEL_LEVEL  parallel build jobs.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


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
        build_temp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", ext.sourcedir, *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", *build_args], cwd=build_temp, check=True)


setup(
    ext_modules=[CMakeExtension("transformer_linear._C")],
    cmdclass={"build_ext": CMakeBuild},
)
