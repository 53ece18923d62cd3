#!/usr/bin/env bash
# The CPU test suite once more on every other instruction-set path this CPU
# runs (TL_CPU_ISA forces it), so each path's kernels are tested on every CI
# machine that can run them, not only on CPUs where the measurement picks
# them: on an AVX-512 machine the AVX2 and portable paths run the suite too.
# Uses the virtualenv and install that the README's commands made (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || { echo "isa_paths.sh: run the README's commands first (no .venv)" >&2; exit 1; }

# Read from a neutral folder: the source tree's transformer_linear (no built
# extension) must not shadow the installed one.
repo="$PWD"
read -r auto others < <(cd /tmp && "$repo/$python" -c '
import transformer_linear._C as C
info = C.cpu_isa_info()
print(info["isa"], ",".join(i for i in info["supported"] if i != info["isa"]))
')
echo "isa_paths.sh: the suite ran on $auto (measured); now on: ${others:-nothing else}"
# Left out of the reruns, as they gain nothing from another default path: the kernel test files that
# force every path themselves (they import tests/cpu_paths.py or take conftest.py's gemm_isa fixture, and
# ran every path in the first run), the
# multi-process tests (tests/dist_harness.py: gloo ranks running the kernels the single-process tests
# run; their time is process start-up), the AOTInductor packages (tests/test_aoti.py: compiling a package
# is their time; the kernels in it are the ones tested here), the Triton interpreter's runs (no CPU kernel)
# and the `slow` tests. What is left, the rest of the suite, runs on each path; on an AVX-512 machine that is three
# reruns, which the whole suite each time would push CI past its time limit.
mapfile -t per_path_files < <(grep -l -e "from cpu_paths import" -e "gemm_isa" -e "from dist_harness import" tests/test_*.py)
ignores=()
# test_triton_ops_traced.py traces the Triton ops' graphs (no CPU kernel runs in them).
per_path_files+=(tests/test_aoti.py tests/test_triton_ops_traced.py)
for f in "${per_path_files[@]}"; do ignores+=(--ignore "$f"); done
IFS=, read -r -a paths <<< "$others"
for isa in "${paths[@]}"; do
  [ -n "$isa" ] || continue
  start=$SECONDS
  echo "== TL_CPU_ISA=$isa pytest (without: ${per_path_files[*]}; the interpreted Triton runs; slow tests)"
  TL_CPU_ISA="$isa" .venv/bin/pytest -q -x -p no:cacheprovider -m "not slow and not cuda" -k "not interpreted" "${ignores[@]}"
  echo "== TL_CPU_ISA=$isa took $((SECONDS - start)) s"
done
