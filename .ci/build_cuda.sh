#!/usr/bin/env bash
# Compile-and-link check of the CUDA kernels; no GPU needed.
#
# Builds the extension with TL_CUDA=1 for the default architectures in a
# throw-away virtualenv and build folder (the CPU install that the tests use
# is left alone), against cuBLASLt from the nvidia-cublas wheel, then checks
# that the module loads with libcublasLt resolved, reports a CUDA build, and
# carries code for every architecture asked for: machine code (cubin) for each,
# and PTX for each one not marked -real. Exits non-zero on any compile, link
# or check failure.
#
#   TL_CUDA_ARCHS               architectures (default: the CMake default, 80;90-real;100-real)
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the cuBLASLt headers and library to build against (any CUDA 13
# libcublasLt.so.13, e.g. the one PyTorch's wheels install, serves at run
# time), and cuobjdump to list the embedded GPU code.
CUBLAS_VERSION=13.10.0.20
CUOBJDUMP_VERSION=13.2.86
ARCHS="${TL_CUDA_ARCHS:-80;90-real;100-real}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS

if ! command -v nvcc >/dev/null; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  else
    echo "build_cuda: nvcc not found (put the CUDA toolkit's bin/ on PATH)" >&2
    exit 1
  fi
fi
nvcc --version | tail -n 2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q "nvidia-cublas==$CUBLAS_VERSION" "nvidia-cuda-cuobjdump==$CUOBJDUMP_VERSION" \
  setuptools wheel "cmake>=3.24" ninja "pybind11>=2.12"
echo "build_cuda: tools installed after $((SECONDS - start)) s"

build_start=$SECONDS
TL_CUDA=1 TL_CUDA_ARCHS="$ARCHS" "$py" setup.py -q build_ext \
  --build-lib "$work/lib" --build-temp "$work/tmp"
echo "build_cuda: compiled and linked in $((SECONDS - build_start)) s"

so="$(ls "$work"/lib/transformer_linear/_C*.so)"
echo "build_cuda: checking $so"
if ldd "$so" | grep -q "not found"; then
  ldd "$so"
  echo "build_cuda: unresolved shared libraries" >&2
  exit 1
fi
ldd "$so" | grep libcublasLt
# Python resolves every symbol when it loads the module (RTLD_NOW); torch is
# not needed to load _C.
(cd "$work/lib/transformer_linear" && "$py" -c "
import _C, sys
info = _C.cuda_build_info()
if not _C.built_with_cuda() or info is None:
    sys.exit('built without CUDA')
print('build_cuda: runtime', info['runtime_version'], 'archs', info['archs'], 'driver here', info['driver_version'])
if info['archs'].replace(',', ';') != sys.argv[1]:
    sys.exit('archs compiled in (%s) differ from the requested %s' % (info['archs'], sys.argv[1]))
" "$ARCHS")

cuobjdump="$("$py" -c "import nvidia, os, glob; print(next(iter(glob.glob(os.path.join(nvidia.__path__[0], '*', 'bin', 'cuobjdump')))))")"
elfs="$("$cuobjdump" --list-elf "$so")"
ptxs="$("$cuobjdump" --list-ptx "$so" 2>/dev/null || true)"
IFS=';' read -r -a wanted <<< "$ARCHS"
for arch in "${wanted[@]}"; do
  number="${arch%%-*}"
  if ! grep -q "\.sm_${number}\.cubin" <<< "$elfs"; then
    echo "$elfs"
    echo "build_cuda: no sm_${number} code in the module" >&2
    exit 1
  fi
  if [[ "$arch" != *-real ]] && ! grep -q "\.sm_${number}\.ptx" <<< "$ptxs"; then
    echo "$ptxs"
    echo "build_cuda: no compute_${number} PTX in the module" >&2
    exit 1
  fi
done
echo "build_cuda: GPU code for: $(grep -o 'sm_[0-9a-z]*' <<< "$elfs" | sort -u | tr '\n' ' ')"
echo "build_cuda: PTX for: $(grep -o 'sm_[0-9a-z]*' <<< "$ptxs" | sort -u | tr '\n' ' ')"
echo "build_cuda: OK in $((SECONDS - start)) s"
