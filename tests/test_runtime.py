"""The extension's process-wide settings: CPU paths and threads."""

import pytest
import torch

from transformer_linear import _C, ops


def test_cpu_isa_is_known_and_settable():
    assert _C.cpu_isa() in ("generic", "avx512", "avx512_bf16")
    best = _C.cpu_isa()
    try:
        _C.set_cpu_isa("generic")
        assert _C.cpu_isa() == "generic"
    finally:
        _C.set_cpu_isa("auto")
    assert _C.cpu_isa() == best


def test_unknown_isa_is_a_value_error():
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        _C.set_cpu_isa("sse9")


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
