"""The Triton kernels are ``torch.library.triton_op`` ops: torch.compile traces into them (AOTAutograd's
graph holds the kernels, as ``triton_kernel_wrapper_functional`` nodes Inductor schedules, where a
custom op would be one opaque node), and the public ops take them for CUDA tensors (ops/triton_route.py).

The route (``triton_route.routes``) is forced to Triton for CPU tensors, so the public op calls a GPU
makes are traced here: the compiled graph holds the kernels and not the custom op (captured, not run:
a compiled Triton kernel needs a GPU). Under Triton's interpreter (a fresh interpreter, as in
test_blockwise_triton.py: there ``wrap_triton`` launches the interpreted kernel and traces nothing) the
routed eager calls run, and the quantize ops are bitwise the CPU kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from functorch.compile import make_boxed_func
from tolerances import assert_bitwise_equal
from torch._dynamo.backends.common import aot_autograd
from triton_interpreted import run_interpreted

from transformer_linear import ops, reference
from transformer_linear.ops import grouped, grouped_quantize, triton_route
from transformer_linear.ops import nvfp4 as nvfp4_ops
from transformer_linear.reference import nvfp4 as ref_nvfp4

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
KERNEL_NODE = "triton_kernel_wrapper_functional"


@pytest.fixture
def triton_for_cpu(monkeypatch):
    """The route a CUDA tensor takes, for CPU tensors."""
    monkeypatch.setattr(triton_route, "routes", lambda t: True)


def block_quantize(x, block, scale_dtype):
    return tuple(ops.quantize_blockwise_fused(x, E4M3, block, scale_dtype, rowwise=True, columnwise=True))


def nvfp4_quantize(x, amax):
    q = nvfp4_ops.quantize_nvfp4(x, amax, None, rowwise=True, columnwise=True)
    return q.data.view(torch.uint8), q.scale, q.global_scale, q.data_t.view(torch.uint8), q.scale_t


BLOCK_SCALINGS = {"1x128": ((1, 128), torch.float32), "128x128": ((128, 128), torch.float32), "mx": ((1, 32), E8M0)}

TRITON_OPS = ("fp8_gemm_block", "fp8_grouped_gemm", "fp8_grouped_gemm_wgrad", "fp8_grouped_gemm_wgrad_blockwise",
              "nvfp4_gemm", "quantize_blockwise", "quantize_nvfp4")
"""The ``transformer_linear::triton_*`` ops."""


def triton_op_args(name: str, device: str) -> tuple:
    """A valid call's arguments of the op ``triton_<name>`` on ``device`` (made on the CPU by the reference)."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)

    def fp8(shape, fmt=E4M3):
        return reference.quantize_current(torch.randn(*shape, generator=g), fmt)[:2]

    def nvfp4(rows):
        t = torch.randn(rows, 64, generator=g)
        q = ref_nvfp4.quantize_nvfp4(t, t.abs().amax())
        return q.data.view(torch.uint8), q.scale, q.global_scale

    if name == "fp8_gemm_block":
        a = reference.quantize_blockwise_ref(torch.randn(32, 256, generator=g), E4M3, (1, 128), torch.float32)
        b = reference.quantize_blockwise_ref(torch.randn(48, 256, generator=g), E4M3, (128, 128), torch.float32)
        args = (*a, *b, torch.float32, None, [1, 128], [128, 128])
    elif name == "fp8_grouped_gemm":
        (a, sa), (b, _) = fp8((48, 32)), fp8((3, 16, 32))
        args = (a, sa, b, torch.ones(3), offs, torch.float32, None, [0, 0], [0, 0])
    elif name == "fp8_grouped_gemm_wgrad":
        args = (*fp8((48, 16), E5M2), *fp8((48, 8)), offs, torch.float32)
    elif name == "fp8_grouped_gemm_wgrad_blockwise":
        gq = grouped_quantize.quantize_grouped_columnwise(torch.randn(48, 16, generator=g), offs, E4M3, 128)
        xq = grouped_quantize.quantize_grouped_columnwise(torch.randn(48, 8, generator=g), offs, E4M3, 128)
        args = (gq.data_t, gq.scale_inv_t, xq.data_t, xq.scale_inv_t, offs, torch.float32, 128)
    elif name == "nvfp4_gemm":
        args = (*nvfp4(32), *nvfp4(16), torch.float32, None)
    elif name == "quantize_blockwise":
        args = (torch.randn(64, 256, generator=g), E4M3, [1, 32], E8M0, False, True, True, False)
    else:
        x = torch.randn(32, 64, generator=g)
        args = (x, x.abs().amax(), None, True, True, False, False, False, 0, 0)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def triton_op(name: str):
    triton_route.kernels()  # registers the Triton ops (imported on first GPU use)
    return getattr(torch.ops.transformer_linear, f"triton_{name}").default



if not INTERPRETED:

    class _Captured(Exception):
        pass

    def traced_targets(fn, *args):
        """The call targets of AOTAutograd's forward graph of ``fn`` compiled with fullgraph (the graph is
        captured, not run: without a GPU, Triton has no driver to launch a compiled kernel)."""
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            raise _Captured

        torch._dynamo.reset()
        with pytest.raises(Exception) as raised:
            torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(*args)
        assert graphs, f"no graph reached the backend: {raised.value!r}"
        return [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]

    def assert_traced_into(targets, op_name, kernels=1):
        assert sum(KERNEL_NODE in t for t in targets) == kernels, f"Triton kernels in the graph: {targets}"
        assert not any(f"transformer_linear.{op_name}" in t for t in targets), f"the custom op is in: {targets}"

    def test_triton_ops_run_interpreted(tmp_path):
        run_interpreted(__file__, tmp_path)

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    @pytest.mark.parametrize("name", TRITON_OPS)
    def test_opcheck_triton_op(name):
        torch.library.opcheck(triton_op(name), triton_op_args(name, "cuda"))

    @pytest.mark.parametrize("name", TRITON_OPS)
    def test_triton_ops_refuse_cpu_tensors_outside_the_interpreter(name):
        """A Triton op called (through torch.ops) with CPU tensors where no interpreter runs them: a TypeError
        naming the first argument, not a failure inside Triton."""
        with pytest.raises(TypeError, match="must be a CUDA tensor .* for the Triton kernel, got one on cpu"):
            triton_op(name)(*triton_op_args(name, "cpu"))

    @pytest.mark.parametrize("scaling", list(BLOCK_SCALINGS))
    def test_quantize_blockwise(triton_for_cpu, scaling):
        x = torch.randn(64, 256, dtype=torch.bfloat16)
        targets = traced_targets(lambda x: block_quantize(x, *BLOCK_SCALINGS[scaling]), x)
        assert_traced_into(targets, "quantize_blockwise", kernels=2)  # the rowwise and the columnwise copy

    @pytest.mark.parametrize("scaling", ["1x128_x_128x128", "mx"])
    def test_fp8_gemm_block(triton_for_cpu, scaling):
        a_block, b_block, scale_dtype = {
            "1x128_x_128x128": ((1, 128), (128, 128), torch.float32),
            "mx": ((1, 32), (1, 32), E8M0),
        }[scaling]
        a, sa = reference.quantize_blockwise_ref(torch.randn(32, 256), E4M3, a_block, scale_dtype)
        b, sb = reference.quantize_blockwise_ref(torch.randn(48, 256), E4M3, b_block, scale_dtype)
        bias = torch.randn(48, dtype=torch.bfloat16)
        targets = traced_targets(lambda *t: ops.fp8_gemm(*t[:4], torch.bfloat16, t[4]), a, sa, b, sb, bias)
        assert_traced_into(targets, "fp8_gemm_blockwise")

    def test_grouped_gemms(triton_for_cpu):
        offs = torch.tensor([16, 16, 48], dtype=torch.int32)
        a, sa = reference.quantize_blockwise_ref(torch.randn(48, 256), E4M3, (1, 128), torch.float32)
        weights = [reference.quantize_blockwise_ref(torch.randn(32, 256), E4M3, (128, 128), torch.float32)
                   for _ in range(3)]
        b, sb = torch.stack([q for q, _ in weights]), torch.stack([s for _, s in weights])
        grad, s_grad = reference.quantize_current(torch.randn(48, 32), E5M2)[:2]
        x, s_x = reference.quantize_current(torch.randn(48, 64), E4M3)[:2]

        def run(a, sa, b, sb, offs, grad, s_grad, x, s_x):
            out = grouped.fp8_grouped_gemm(a, sa, b, sb, offs, torch.float32)
            return out, grouped.fp8_grouped_gemm_wgrad(grad, s_grad, x, s_x, offs, torch.float32)

        targets = traced_targets(run, a, sa, b, sb, offs, grad, s_grad, x, s_x)
        assert_traced_into(targets, "fp8_grouped_gemm", kernels=2)

    def test_quantize_nvfp4(triton_for_cpu):
        """The Triton op itself (the public ops.nvfp4.quantize_nvfp4 checks its amax's value on the host,
        a graph break, before it takes the route)."""
        x = torch.randn(32, 64, dtype=torch.bfloat16)

        def quantize(x, amax):
            return triton_route.kernels().quantize_nvfp4(x, amax, None, True, True, False, False, False, 0, 0)

        targets = traced_targets(quantize, x, x.abs().amax().float())
        assert_traced_into(targets, "quantize_nvfp4", kernels=2)

    def test_cpu_tensors_take_the_custom_ops():
        """Without the forced route, CPU tensors run the extension's kernels (one opaque op each)."""
        x = torch.randn(64, 256, dtype=torch.bfloat16)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        torch.compile(lambda x: block_quantize(x, *BLOCK_SCALINGS["mx"]), backend=aot_autograd(fw_compiler=capture),
                      fullgraph=True)(x)
        targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
        assert "transformer_linear.quantize_blockwise.default" in targets and KERNEL_NODE not in targets

else:

    @pytest.mark.parametrize("scaling", list(BLOCK_SCALINGS))
    def test_routed_block_quantize_is_the_cpu_kernel(triton_for_cpu, monkeypatch, scaling):
        """ops.quantize_blockwise_fused as a GPU runs it (the Triton op) is bitwise the CPU kernel."""
        x = torch.randn(64, 256, dtype=torch.bfloat16) * 3
        routed = block_quantize(x, *BLOCK_SCALINGS[scaling])
        monkeypatch.setattr(triton_route, "routes", lambda t: False)
        for i, (got, want) in enumerate(zip(routed, block_quantize(x, *BLOCK_SCALINGS[scaling]), strict=True)):
            assert_bitwise_equal(got, want, f"output {i}")

    def test_routed_nvfp4_quantize_is_the_cpu_kernel(triton_for_cpu, monkeypatch):
        x = torch.randn(32, 64, dtype=torch.bfloat16)
        amax = x.abs().amax().float()
        routed = nvfp4_quantize(x, amax)
        monkeypatch.setattr(triton_route, "routes", lambda t: False)
        for i, (got, want) in enumerate(zip(routed, nvfp4_quantize(x, amax), strict=True)):
            assert_bitwise_equal(got, want, f"output {i}")
