"""The extension's process-wide settings: CPU paths (forced or measured) and threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from cpu_paths import ALL_ISAS
from transformer_linear import _C, ops

# /proc/cpuinfo flags each path needs (cpu_features.cpp asks CPUID for the same).
ISA_FLAGS = {
    "generic": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16"},
}
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    for line in CPUINFO.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# A new process loads the extension module alone: it does not need torch,
# which takes seconds to import. It prints cpu_isa_info() and cpu_isa().
LOAD_EXTENSION_ONLY = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("transformer_linear._C", {_C.__file__!r})
_C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_C)
print(json.dumps({{**_C.cpu_isa_info(), "cpu_isa": _C.cpu_isa()}}))
"""
# The same through the package, after one op has run.
IMPORT_PACKAGE = """
import json, torch
from transformer_linear import _C, ops
assert ops.amax(torch.tensor([1.0, -3.0])).item() == 3.0
print(json.dumps({**_C.cpu_isa_info(), "cpu_isa": _C.cpu_isa()}))
"""


def run_fresh(env_isa: str | None, code: str = LOAD_EXTENSION_ONLY) -> tuple[dict, str]:
    """cpu_isa_info() (plus 'cpu_isa') and stderr of a new process under TL_CPU_ISA=env_isa."""
    env = {k: v for k, v in os.environ.items() if k != "TL_CPU_ISA"}
    if env_isa is not None:
        env["TL_CPU_ISA"] = env_isa
    # Not from the repository root: `python -c` puts the current directory first on sys.path, where the
    # source tree's transformer_linear (no built extension) would shadow the installed package.
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.fixture
def auto_isa():
    """Leave the process on the automatic choice whatever the test forced."""
    yield
    _C.set_cpu_isa("auto")


@pytest.mark.skipif(not CPUINFO.exists(), reason="needs /proc/cpuinfo (Linux)")
def test_supported_paths_match_cpu_flags():
    """What the extension reports supported is what the CPU's flags say (so a skip is genuine)."""
    flags = cpu_flags()
    expected = [isa for isa in ALL_ISAS if ISA_FLAGS[isa] <= flags]
    assert _C.cpu_isa_info()["supported"] == expected
    assert [_C.cpu_isa_supported(isa) for isa in ALL_ISAS] == [isa in expected for isa in ALL_ISAS]


def test_automatic_choice_is_measured_and_fastest():
    info, stderr = run_fresh(None)
    assert "RuntimeWarning" not in stderr
    assert info["isa"] == info["cpu_isa"] and info["isa"] in info["supported"]
    if len(info["supported"]) == 1:
        assert info["source"] == "only_supported" and info["probe_seconds"] == {}
        return
    assert info["source"] == "measured"
    seconds = info["probe_seconds"]
    assert sorted(seconds) == sorted(info["supported"]) and all(s > 0 for s in seconds.values())
    assert seconds[info["isa"]] == min(seconds.values())
    assert info["probe_shape"] in info["reason"]
    for isa in info["supported"]:
        assert isa in info["reason"]


def test_first_use_from_many_threads_measures_once():
    """Threads that all need the path at once wait for one measurement and get the same answer."""
    code = LOAD_EXTENSION_ONLY.replace(
        "print(",
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    infos = list(pool.map(lambda _: _C.cpu_isa_info(), range(8)))\n"
        "assert all(info == infos[0] for info in infos), infos\n"
        "print(",
    )
    info, _ = run_fresh(None, code)
    assert info["isa"] in info["supported"]


def test_measurement_is_cached(auto_isa):
    _C.set_cpu_isa("auto")
    first = _C.cpu_isa_info()
    _C.set_cpu_isa("generic")
    _C.set_cpu_isa("auto")
    again = _C.cpu_isa_info()
    assert again == first  # same timings: measured once per process


@pytest.mark.parametrize("spelling", [str.upper, str.title, lambda s: f" {s} "], ids=["upper", "title", "blanks"])
@pytest.mark.parametrize("isa", ALL_ISAS)
def test_set_cpu_isa_forces_any_case(auto_isa, isa, spelling):
    if not _C.cpu_isa_supported(isa):
        with pytest.raises(ValueError, match="does not support"):
            _C.set_cpu_isa(spelling(isa))
        return
    _C.set_cpu_isa(spelling(isa))
    info = _C.cpu_isa_info()
    assert _C.cpu_isa() == info["isa"] == isa
    assert info["source"] == "forced" and "set_cpu_isa" in info["reason"]


@pytest.mark.parametrize("value", ["GENERIC", "Avx2", "Avx512_BF16"])
def test_environment_forces_any_case(value):
    if not _C.cpu_isa_supported(value):
        pytest.skip(f"this CPU does not support {value}")
    info, stderr = run_fresh(value)
    assert "RuntimeWarning" not in stderr
    assert info["cpu_isa"] == value.lower()
    assert info["source"] == "forced" and f"TL_CPU_ISA='{value}'" in info["reason"]


@pytest.mark.parametrize("value,code", [("foo", IMPORT_PACKAGE), ("avx1024", LOAD_EXTENSION_ONLY)], ids=["package", "extension"])
def test_unknown_environment_value_warns_once_and_falls_back(value, code):
    """The ops work (no error on every call) and the import warned once."""
    info, stderr = run_fresh(value, code)
    assert stderr.count("RuntimeWarning") == 1 and f"TL_CPU_ISA='{value}' is not an instruction set" in stderr
    assert info["source"] in ("measured", "only_supported")
    assert info["reason"].startswith(f"TL_CPU_ISA='{value}' is not an instruction set")


@pytest.mark.skipif(not CPUINFO.exists(), reason="needs /proc/cpuinfo (Linux)")
def test_unsupported_environment_value_warns_and_falls_back():
    missing = [isa for isa in ALL_ISAS if not ISA_FLAGS[isa] <= cpu_flags()]
    if not missing:
        pytest.skip("this CPU supports every path")
    info, stderr = run_fresh(missing[0])
    assert stderr.count("RuntimeWarning") == 1 and "does not support it" in stderr
    assert info["isa"] in info["supported"]


@pytest.mark.parametrize("function", ["set_cpu_isa", "cpu_isa_supported"])
def test_unknown_isa_is_a_value_error(function):
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        getattr(_C, function)("sse9")


def test_thread_count_follows_torch():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ops.amax(torch.ones(4))
        assert _C.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    ops.amax(torch.ones(4))
    assert _C.get_num_threads() == before


def test_bad_thread_count_is_a_value_error():
    with pytest.raises(ValueError, match="thread count"):
        _C.set_num_threads(0)
