#!/usr/bin/env bash
# CI: build the extension with AddressSanitizer + UBSan (CMake TL_SANITIZE=ON)
# in a throw-away folder and run the kernel, op, descriptor and threading
# tests against that build.
#
# Tests run with the Python of the active virtualenv, else of the
# repository's .venv (which the README's test command, run by .ci/run,
# creates), else python3; it needs torch and pytest. The build tools go into a
# throw-away virtualenv, and the normal build and installed package are left
# untouched: the sanitized package is put first on PYTHONPATH.
#
#   TL_SANITIZE_TESTS   test files under tests/ (default: the subset below)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
if [ -n "${VIRTUAL_ENV:-}" ]; then
  python="$VIRTUAL_ENV/bin/python"
elif [ -x .venv/bin/python ]; then
  python="$repo/.venv/bin/python"
else
  python="$(command -v python3)"
fi
"$python" -c 'import torch, pytest' || {
  echo "sanitize.sh: $python has no torch or pytest; run the README's test command first" >&2
  exit 1
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS

echo "== sanitizer build (AddressSanitizer + UBSan) =="
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q --disable-pip-version-check "cmake>=3.24" ninja "pybind11>=2.12"
mkdir -p "$work/pkg"
cp -r transformer_linear "$work/pkg/"
find "$work/pkg" \( -name '_C*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
"$work/tools/bin/cmake" -S . -B "$work/build" -G Ninja \
  -DCMAKE_MAKE_PROGRAM="$work/tools/bin/ninja" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTL_SANITIZE=ON -DTL_CUDA=0 \
  -DPython_EXECUTABLE="$python" \
  -Dpybind11_DIR="$("$work/tools/bin/python" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$work/pkg/transformer_linear/" >/dev/null
"$work/tools/bin/cmake" --build "$work/build" -j "$(nproc)"
echo "build took $((SECONDS - start)) s"

echo "== tests under the sanitizers =="
# Python is not instrumented, so the ASan runtime must be loaded first, and
# libstdc++ with it (Python does not link it; ASan must see its __cxa_throw, or
# the first C++ exception aborts). Python leaks by design (detect_leaks=0); a
# failed huge allocation must come back as std::bad_alloc
# (allocator_may_return_null=1), which tests rely on.
cxx="$(grep -m1 '^CMAKE_CXX_COMPILER:' "$work/build/CMakeCache.txt" | cut -d= -f2)"
preload=()
for lib in libasan.so libstdc++.so.6; do
  path="$("$cxx" -print-file-name="$lib")"
  [ -f "$path" ] || { echo "sanitize.sh: $cxx has no $lib (GCC is needed)" >&2; exit 1; }
  preload+=("$path")
done
export LD_PRELOAD="${preload[*]}"
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:alloc_dealloc_mismatch=0:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
# Python runs from $work: the source tree's transformer_linear (first on
# sys.path if the current folder were the repository) must not shadow the build.
cd "$work"
"$python" - "$work/pkg" <<'EOF'
import sys, transformer_linear._C as C
assert C.__file__.startswith(sys.argv[1]), f"testing {C.__file__}, not the sanitized build"
print("testing", C.__file__)
EOF
start=$SECONDS
tests=()
for t in ${TL_SANITIZE_TESTS:-test_threads.py test_descriptors.py test_quantize.py test_ops.py test_gemm.py test_bad_input.py test_blockwise_quantize.py test_blockwise_gemm.py test_grouped_gemm.py test_grouped_quantize_cpu.py test_nvfp4.py test_quantize_gemm.py test_transpose.py test_bias_grad.py}; do
  tests+=("$repo/tests/$t")
done
"$python" -c 'import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))' -q -p no:cacheprovider "${tests[@]}"
echo "sanitizer tests took $((SECONDS - start)) s"
