"""The CPU kernels under concurrent callers and a changing torch thread count.

Each call reads torch.get_num_threads() once and sizes its per-thread scratch
from that value; another Python thread calling torch.set_num_threads() in the
middle of a call must change neither its memory safety nor its result.
"""

import threading
import time

import pytest
import torch
from tolerances import assert_bitwise_equal, assert_close_to_reference

from transformer_linear import _C, ops, reference
from transformer_linear.ops.descriptors import desc

E4M3 = torch.float8_e4m3fn
# Thread counts the flipping thread alternates between: one, and more than
# this machine has, as in the reported crash.
FLIP_COUNTS = (1, 64)
DURATION_S = 3.0


def _cases():
    """(name, call, check) triples; each call is large enough to run in parallel."""
    # The largest magnitude sits in the last chunk: a call that kept only the
    # first thread's partial maximum would return a smaller one.
    x = torch.rand(1 << 20) * 0.5
    x[-1] = -3.0
    amax_expected = reference.amax(x)

    g = torch.randn(256, 1024) * 4
    scale = torch.tensor([2.0])
    q_expected, scale_inv_expected = reference.quantize(g, scale, E4M3)
    q_t_expected = reference.transpose_2d(q_expected)

    a, a_scale_inv = ops.quantize(torch.randn(96, 256), torch.tensor([8.0]), E4M3)
    b, b_scale_inv = ops.quantize(torch.randn(160, 256), torch.tensor([16.0]), E4M3)
    gemm_expected = reference.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float64)

    def check_amax(r):
        assert_bitwise_equal(r, amax_expected.reshape(r.shape), "amax")

    def check_quantize(r):
        assert_bitwise_equal(r.data, q_expected, "quantize data")
        assert_bitwise_equal(r.data_t, q_t_expected, "quantize data_t")
        assert_bitwise_equal(r.scale_inv.reshape(1), scale_inv_expected, "quantize scale_inv")

    def check_gemm(r):
        assert_close_to_reference(r, gemm_expected, what="fp8_gemm")

    return [
        ("amax", lambda: ops.amax(x), check_amax),
        ("quantize", lambda: ops.quantize_fused(g, E4M3, scale, columnwise=True), check_quantize),
        ("fp8_gemm", lambda: ops.fp8_gemm(a, a_scale_inv, b, b_scale_inv, torch.float32), check_gemm),
    ]


def test_ops_are_exact_while_another_thread_changes_the_thread_count(restore_torch_threads):
    cases = _cases()
    stop = time.monotonic() + DURATION_S
    failures: list[str] = []
    calls = {name: 0 for name, _, _ in cases}

    def flipper():
        small = torch.ones(16)
        while time.monotonic() < stop and not failures:
            for n in FLIP_COUNTS:
                torch.set_num_threads(n)
                ops.amax(small)

    def worker(offset: int):
        i = offset
        while time.monotonic() < stop and not failures:
            name, call, check = cases[i % len(cases)]
            try:
                check(call())
            except Exception as e:  # reported on the main thread below
                failures.append(f"{name}: {type(e).__name__}: {e}")
            calls[name] += 1
            i += 1

    threads = [threading.Thread(target=flipper)] + [
        threading.Thread(target=worker, args=(k,)) for k in range(len(cases))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DURATION_S + 60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not failures, failures[0]
    assert all(n > 0 for n in calls.values()), calls


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_results_do_not_depend_on_the_thread_count(threads, restore_torch_threads):
    torch.set_num_threads(threads)
    for name, call, check in _cases():
        check(call())


def test_ops_set_no_thread_count_in_the_extension():
    """The Python layer passes torch's count with each call and sets nothing in
    the extension: once torch's count is restored, the extension reports the
    count it had before."""
    before = _C.get_num_threads()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        ops.amax(torch.ones(4))
    finally:
        torch.set_num_threads(saved)
    assert _C.get_num_threads() == before


def test_default_thread_count_for_raw_calls():
    saved = _C.get_num_threads()
    x = torch.rand(1 << 18)
    out = torch.empty(())
    try:
        for n in (1, 3):
            _C.set_num_threads(n)
            assert _C.get_num_threads() == n
            _C.amax(desc(x, "test", "x"), desc(out, "test", "amax"), 0)
            assert out.item() == x.max().item()
    finally:
        _C.set_num_threads(saved)

