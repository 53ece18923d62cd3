"""tl.GroupedLinear's training options, as tl.Linear's: delay_wgrad_compute (backward_dw), fuse_wgrad_accumulation
(weight.main_grad), the is_first_microbatch FP8 weight cache, and FP8 saved activations; for every recipe the
grouped GEMMs take and without one."""

from __future__ import annotations

import functools

import pytest
import torch
from grouped_cases import routing
from recipe_tables import ONE_PER_CLASS

import transformer_linear as tl
from transformer_linear import reference

# Stochastic rounding draws its seeds from torch's generator when it quantizes, which these tests' twin
# modules reach in different orders: rounding to nearest (where a recipe has the option), so that the twins
# agree bitwise.
NEAREST = {"nvfp4": {"disable_stochastic_rounding": True}}
RECIPES = {"none": None, **{
    name: functools.partial(tl.recipe.from_name, name, **NEAREST.get(name, {})) for name in ONE_PER_CLASS
}}
FP8_RECIPES = [name for name in RECIPES if name != "none"]
G, K, N, T = 4, 64, 48, 96


def _module(name, seed=0, **options):
    torch.manual_seed(seed)
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    return tl.GroupedLinear(G, K, N, bias=True, recipe=recipe, **options)


def _step(module, x, m_splits, grad, **kwargs):
    """One forward and backward: (out, dgrad)."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x, m_splits, **kwargs)
    out.backward(grad)
    return out.detach(), x.grad


def _data(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=gen), torch.randn(T, N, generator=gen)


def _splits(pattern):
    return torch.tensor(routing(pattern, T, G))


@pytest.mark.parametrize("name", list(RECIPES))
def test_delay_wgrad_compute_defers_to_backward_dw(name):
    """Backward leaves weight.grad and bias.grad alone; backward_dw adds what two backwards queued, bitwise
    what an immediate backward gives."""
    base, delayed = _module(name), _module(name, delay_wgrad_compute=True)
    x, grad = _data()
    for pattern in ("skewed", "empty_groups"):
        want = _step(base, x, _splits(pattern), grad)
        got = _step(delayed, x, _splits(pattern), grad)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pattern
        assert delayed.weight.grad is None and delayed.bias.grad is None
    delayed.backward_dw()
    assert torch.equal(delayed.weight.grad, base.weight.grad)
    assert torch.equal(delayed.bias.grad, base.bias.grad)
    delayed.backward_dw()  # the queue was drained: nothing added twice
    assert torch.equal(delayed.weight.grad, base.weight.grad)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("delay", [False, True])
def test_fuse_wgrad_accumulation_adds_into_main_grad(name, delay):
    base = _module(name)
    fused = _module(name, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    fused.weight.main_grad = torch.full((G, N, K), 0.5)
    x, grad = _data()
    _step(base, x, _splits("skewed"), grad)
    _step(fused, x, _splits("skewed"), grad)
    fused.backward_dw()
    assert fused.weight.grad is None
    # fp32 parameters: the fp32 weight gradient, added.
    assert torch.equal(fused.weight.main_grad, base.weight.grad + 0.5)
    assert torch.equal(fused.bias.grad, base.bias.grad)


def test_fuse_wgrad_accumulation_creates_main_grad():
    fused = _module("current", fuse_wgrad_accumulation=True)
    base = _module("current")
    x, grad = _data()
    for _ in range(2):
        _step(base, x, _splits("uniform"), grad)
        _step(fused, x, _splits("uniform"), grad)
    assert fused.weight.main_grad.dtype == torch.float32 and fused.weight.main_grad.shape == (G, N, K)
    assert torch.equal(fused.weight.main_grad, base.weight.grad)  # 0 + g + g, as weight.grad accumulates
    with torch.no_grad():  # no gradient: main_grad is left alone
        fused(x, _splits("uniform"))
    assert torch.equal(fused.weight.main_grad, base.weight.grad)


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_weight_cache_reuses_the_first_microbatch_fp8_weights(name):
    """is_first_microbatch=False runs on the FP8 weights of the group's first microbatch: after the weights
    change, it gives what a module that kept the old weights gives (delayed scaling's state included);
    None quantizes the new weights."""
    cached, unchanged = _module(name), _module(name)
    x, grad = _data()
    first = _step(cached, x, _splits("skewed"), grad, is_first_microbatch=True)
    assert all(torch.equal(a, b) for a, b in zip(first, _step(unchanged, x, _splits("skewed"), grad)))
    with torch.no_grad():
        cached.weight.mul_(3.0)
    for pattern in ("uniform", "empty_groups"):
        got = _step(cached, x, _splits(pattern), grad, is_first_microbatch=False)
        want = _step(unchanged, x, _splits(pattern), grad)
        assert torch.equal(got[0], want[0]), f"{pattern}: out"
        assert torch.equal(got[1], want[1]), f"{pattern}: dgrad"
    fresh = cached(x, _splits("uniform"))  # None: the new weights
    assert not torch.equal(fresh, unchanged(x, _splits("uniform")))
    cached.float()  # a dtype/device change drops the cache
    assert cached._weight_cache is None


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_weight_cache_without_grad_then_with(name):
    """A cache made with no input gradient has no columnwise weight: a later microbatch that needs dgrad
    quantizes the weight again instead of failing."""
    module, twin = _module(name), _module(name)
    x, grad = _data()
    with torch.no_grad():
        module(x, _splits("uniform"), is_first_microbatch=True)
        twin(x, _splits("uniform"))
    got = _step(module, x, _splits("skewed"), grad, is_first_microbatch=False)
    want = _step(twin, x, _splits("skewed"), grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("name", FP8_RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_activations_are_fp8(name, dtype):
    """Autograd keeps the FP8 input (grouped columnwise copy under block scales) and each expert's FP8
    columnwise weight, plus scales: one byte an element, never the high-precision input."""
    module = _module(name).to(dtype)
    saved = []
    x = torch.randn(T, K, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = module(x, _splits("skewed"))
    out.backward(torch.randn(T, N, dtype=dtype))
    # Block scales are float32 too, one per 32 elements at most.
    high_precision = [(tuple(t.shape), t.dtype) for t in saved if t.dtype in (torch.float32, dtype)
                      and t.numel() >= T * K // 8]
    assert high_precision == [], high_precision
    if name == "nvfp4":
        # Packed FP4 (half a byte an element): the experts' compact copies of the tokens masked to their
        # groups, each group's 16-token bands only, T + 16 (G - 1) tokens (ops.grouped_nvfp4), and every
        # expert's Wᵀ.
        data_bytes, data_dtypes = (K * (T + 16 * (G - 1)) + G * N * K) // 2, (torch.uint8,)
    else:
        data_bytes, data_dtypes = T * K + G * N * K, reference.FP8_DTYPES  # x and every expert's Wᵀ in FP8
    assert sum(t.nbytes for t in saved if t.dtype in data_dtypes) == data_bytes
    other_bytes = sum(t.nbytes for t in saved if t.dtype not in data_dtypes)
    assert other_bytes < data_bytes // 6, other_bytes  # scales and offs only


@pytest.mark.parametrize("option", ["delay_wgrad_compute", "fuse_wgrad_accumulation"])
def test_wgrad_options_refuse_torch_compile(option):
    module = _module("current", **{option: True})
    x, _ = _data()
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=f"{option} runs eagerly only"):
        compiled(x, _splits("uniform"))
