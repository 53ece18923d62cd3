"""What one forward and backward of a tl.Linear costs besides its arithmetic, per recipe: kernel passes over
the data and reads of tensor values on the host.

Every recipe quantizes each of its three tensors (input, weight, grad_output) in one kernel pass, both
usages of a tensor coming out of that pass, and runs three GEMMs (forward, dgrad, wgrad): counted at the
extension's entry points. Where the input has one scale (delayed and current scaling), its cast runs inside
the forward GEMM, one call (``quantize_fp8_gemm``, counted as "quantize+gemm"): the FP8 copy is not read
back from memory in a pass of its own. NVFP4 also takes each tensor's global amaxes (of the tensor and of its
Hadamard-transformed copy) in a pass of its own first. A read
of a tensor's value on the host (``.item()``, ``.tolist()``, ``bool()``,
``nonzero``) is a device sync on a GPU. The only ones are the CPU kernels' checks of the scales they are
handed (formats/checks.py, which reads CPU tensors only and skips every other device) and delayed
scaling's just-in-time first step (``first_step_just_in_time=True``, the default): one read of the layer's
state in the forward for all three tensors, and one of grad_output's scale in the backward, on the CPU only
(elsewhere it selects its scales on the device, one amax pass per tensor on every step instead); and NVFP4's
stochastic rounding, whose CPU kernel takes its seed (drawn from the CPU generator, a CPU tensor) as an int:
one read per backward.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
from pathlib import Path

import pytest
import torch
from tolerances import assert_bitwise_equal

import transformer_linear as tl
from transformer_linear import _C, recipe
from transformer_linear.recipe import delayed_scaling
from transformer_linear.recipe.quantization import quantization_spec

PACKAGE = Path(tl.__file__).resolve().parent
M, K, N = 64, 256, 384

KERNEL_FAMILIES = {
    "amax": "amax",
    "quantize": "quantize",
    "quantize_blockwise": "quantize",
    "fp8_gemm": "gemm",
    "quantize_fp8_gemm": "quantize+gemm",
    "fp8_gemm_blockwise": "gemm",
    "quantize_nvfp4": "quantize",
    "nvfp4_amax": "amax",
    "nvfp4_gemm": "gemm",
    "dequantize": "dequantize",
}
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
CPU_SCALE_CHECKS = "formats/checks.py"

RECIPES = {name: recipe.from_name(name) for name in recipe.available_names()}
RECIPES["delayed, no just-in-time first step"] = recipe.DelayedScaling(first_step_just_in_time=False)


@dataclasses.dataclass
class Costs:
    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Kernel family -> calls into the extension."""
    reads: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Package module -> host reads of tensor values made there (the innermost package frame)."""
    cpu_only_reads: bool = True
    """Every read at the CPU scale checks was of a CPU tensor."""


@pytest.fixture
def costs(monkeypatch) -> Costs:
    """Counts kernel calls and host reads of tensor values while the test runs."""
    counted = Costs()
    for name, family in KERNEL_FAMILIES.items():
        kernel = getattr(_C, name)

        def counting_kernel(*args, _kernel=kernel, _family=family, **kwargs):
            counted.kernels[_family] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(_C, name, counting_kernel)
    for method in HOST_READS:
        original = getattr(torch.Tensor, method)

        def counting_read(self, *args, _original=original, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if Path(f.filename).resolve().is_relative_to(PACKAGE)]
            if frames:
                site = Path(frames[-1].filename).resolve().relative_to(PACKAGE).as_posix()
                counted.reads[site] += 1
                if site == CPU_SCALE_CHECKS and self.device.type != "cpu":
                    counted.cpu_only_reads = False
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting_read)
    return counted


def _steps(name: str, costs: Costs, steps: int = 3) -> list[Costs]:
    """The costs of ``steps`` forward+backward steps of one layer under the named recipe, step by step."""
    torch.manual_seed(0)
    layer = tl.Linear(K, N, recipe=RECIPES[name])
    x = torch.randn(M, K, requires_grad=True)
    per_step = []
    for _ in range(steps):
        costs.kernels.clear()
        costs.reads.clear()
        layer(x).sum().backward()
        per_step.append(Costs(collections.Counter(costs.kernels), collections.Counter(costs.reads)))
    return per_step


def _stochastic_rounding(name: str) -> bool:
    r = RECIPES[name]
    return isinstance(r, recipe.NVFP4BlockScaling) and not r.disable_stochastic_rounding


def _just_in_time(name: str) -> bool:
    r = RECIPES[name]
    return isinstance(r, recipe.DelayedScaling) and r.first_step_just_in_time


def _global_amax_pass(name: str) -> bool:
    return isinstance(RECIPES[name], recipe.NVFP4BlockScaling)


def _passes(name: str, **extra: int) -> dict[str, int]:
    """Kernel calls of one step: three quantize passes and three GEMMs, the input's pass inside the forward
    GEMM where it has one scale."""
    if quantization_spec(RECIPES[name]).input.records_amax:
        return {"quantize": 2, "gemm": 2, "quantize+gemm": 1, **extra}
    return {"quantize": 3, "gemm": 3, **extra}


@pytest.mark.parametrize("name", list(RECIPES))
def test_three_quantize_passes_and_three_gemms(name, costs):
    first, *later = _steps(name, costs)
    # NVFP4's global scale must be known before its block scales: each tensor's amax is a pass of its own
    # (one pass also gives the amax of a Hadamard-transformed copy).
    every_step = {"amax": 3} if _global_amax_pass(name) else {}
    for step in later:
        assert dict(step.kernels) == _passes(name, **every_step)
    # Delayed scaling's first step scales each tensor just in time: one amax pass each, before its cast.
    extra = {"amax": 3} if _just_in_time(name) else every_step
    assert dict(first.kernels) == _passes(name, **extra)


@pytest.mark.parametrize("name", list(RECIPES))
def test_host_reads_are_the_cpu_scale_checks_and_delayed_scalings_state(name, costs):
    for step in _steps(name, costs):
        elsewhere = {site: n for site, n in step.reads.items() if site != CPU_SCALE_CHECKS}
        expected = {"recipe/delayed_scaling.py": 2} if _just_in_time(name) else {}
        if _stochastic_rounding(name):
            expected["ops/nvfp4_quantize.py"] = 1
        assert elsewhere == expected
        # The counting sees reads where they happen (NVFP4's ops read no scale on the host: its seed read).
        assert step.reads[CPU_SCALE_CHECKS if not _stochastic_rounding(name) else "ops/nvfp4_quantize.py"] > 0
    assert costs.cpu_only_reads


def _train(name: str, steps: int = 3) -> list[torch.Tensor]:
    """Outputs, gradients and the delayed-scaling state after each of ``steps`` steps of one layer."""
    torch.manual_seed(0)
    layer = tl.Linear(K, N, recipe=RECIPES[name])
    x = torch.randn(M, K, requires_grad=True)
    seen = []
    for step in range(steps):
        out = layer(x * (step + 1))  # a growing amax: the delayed scales lag behind it
        out.square().sum().backward()
        seen += [out, x.grad, layer.weight.grad, *(b.clone() for n, b in layer.named_buffers() if "fp8" in n)]
        x.grad, layer.weight.grad = None, None
    return seen


@pytest.mark.parametrize("name", [n for n in RECIPES if _just_in_time(n)])
def test_off_the_cpu_the_just_in_time_rule_reads_no_state_on_the_host(name, costs, monkeypatch):
    """Where a host read is a device sync (a GPU), delayed scaling's first-step rule selects its scales on
    the device: no host read of the state, one amax pass per tensor on every step, and bitwise the outputs,
    gradients and state the CPU's host reads give."""
    on_host = _train(name)
    monkeypatch.setattr(delayed_scaling, "reads_state_on_host", lambda t: False)
    for step in _steps(name, costs):
        assert "recipe/delayed_scaling.py" not in step.reads
        assert dict(step.kernels) == _passes(name, amax=3)
    on_device = _train(name)
    assert len(on_device) == len(on_host)
    for i, (actual, expected) in enumerate(zip(on_device, on_host)):
        assert_bitwise_equal(actual, expected, what=f"tensor {i}")
