"""Peak memory of a training step: FP8 primary weights (``tl.quantized_model_init``) or not, in one process
and under FSDP2 (gloo ranks on the CPU) with the weights all-gathered in FP8 or in high precision.

The model is an MLP stack of ``--layers`` square ``--width`` Linear layers on ``--tokens`` rows, or
(``--model gpt``, one process) the built-in GPT (``tl.numerics.model.TinyGPT``: ``--layers`` blocks of
width ``--width``, a 256-token vocabulary, one sequence of ``--tokens``), small enough a batch that the
weights, their gradients and AdamW's state dominate. FP8 primary weights (``quantized_model_init``) step
through ``tl.optim.MasterWeights`` (fp32 masters a stock AdamW updates) in one process; under FSDP2 the
shards are the masters. Every variant runs in a fresh
process (spawned), builds the model, takes one AdamW step (the optimizer state now exists), then the
measured step (forward, backward, ``opt.step()``, ``zero_grad``).

Method: a ``TorchDispatchMode`` active from before the model is built sees every tensor an op returns
(wrapper subclasses such as FSDP2's DTensor and the FP8 all-gather weight are opened to their inner
tensors) and counts each storage's bytes once, until the storage is freed (a weak reference to the storage's
Python object, which torch keeps as long as the storage lives); sizes are read after every op, as FSDP2
frees and refills its all-gather buffers by resizing their storages. Reported per rank, in MiB:

* ``params``: the bytes the model's parameters hold (an FP8 weight's data and scales; a rank's shards);
* ``resident``: live tensor bytes between steps (parameters, masters, AdamW's state, buffers);
* ``peak``: the most live tensor bytes at any point of the measured step.

Limits: a temporary allocated inside one op (a custom op's scratch, a GEMM's packing buffer) and freed
before the op returns is not seen, nor is memory that is not a tensor (gloo's buffers, the allocator's
caching and fragmentation, the interpreter). The ``rss peak`` column is the operating system's view as a
cross-check: the growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs)
over the measured step, with glibc's mmap threshold fixed at 64 KiB so that freed large blocks go back to
the system; it includes everything above but also pages touched by the allocator and libraries.

    python benchmarks/bench_memory.py                          # 8 x 1024, 32 rows, 2 FSDP2 ranks
    python benchmarks/bench_memory.py --layers 4 --width 2048
    python benchmarks/bench_memory.py --model gpt --layers 4 --width 1024   # the built-in GPT, one process
"""

from __future__ import annotations

import argparse
import os
import socket
import weakref
from typing import Any, NamedTuple, Optional

# Fixed before torch loads (and inherited by spawned ranks): freed blocks of 64 KiB or more leave the heap.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import transformer_linear as tl  # noqa: E402
from transformer_linear import recipe  # noqa: E402
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss  # noqa: E402

MIB = 1024.0 * 1024.0


class Variant(NamedTuple):
    """One row of the table."""

    label: str
    world: int  # 1: one process, no FSDP2
    recipe: Optional[str]  # None: nn.Linear
    quantized_init: bool = False
    gather: str = "fp32"  # FSDP2's all-gather: "fp32", "bf16" (MixedPrecisionPolicy) or "fp8"


VARIANTS = (
    Variant("nn.Linear", 1, None),
    Variant("tl current", 1, "current"),
    Variant("tl current, quantized_model_init", 1, "current", True),
    Variant("tl mxfp8", 1, "mxfp8"),
    Variant("tl mxfp8, quantized_model_init", 1, "mxfp8", True),
    Variant("fsdp2 nn.Linear, fp32 gather", 2, None),
    Variant("fsdp2 nn.Linear, bf16 gather", 2, None, gather="bf16"),
    Variant("fsdp2 tl current, fp32 gather", 2, "current"),
    Variant("fsdp2 tl current, bf16 gather", 2, "current", gather="bf16"),
    Variant("fsdp2 tl current, fp8 gather", 2, "current", gather="fp8"),
    Variant("fsdp2 tl current, fp8 gather, quantized_model_init", 2, "current", True, "fp8"),
    Variant("fsdp2 tl mxfp8, fp32 gather", 2, "mxfp8"),
    Variant("fsdp2 tl mxfp8, fp8 gather", 2, "mxfp8", gather="fp8"),
)

GPT_VARIANTS = (
    Variant("gpt nn.Linear", 1, None),
    Variant("gpt tl current", 1, "current"),
    Variant("gpt tl current, quantized_model_init", 1, "current", True),
    Variant("gpt tl block", 1, "block"),
    Variant("gpt tl block, quantized_model_init", 1, "block", True),
    Variant("gpt tl mxfp8", 1, "mxfp8"),
    Variant("gpt tl mxfp8, quantized_model_init", 1, "mxfp8", True),
)


class LiveTensorBytes(TorchDispatchMode):
    """Sums the bytes of the live storages that ops have returned; keeps the peak.

    Sizes are read at every op, not when a storage is first seen: FSDP2 frees and reallocates its
    all-gather buffers by resizing their storages in place.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def reset_peak(self) -> int:
        """Start a new peak at the live bytes now; returns them."""
        self.peak = 0
        return self._update()

    def _update(self) -> int:
        sizes = [ref() for ref in list(self._storages.values())]  # a finalizer may run meanwhile
        self.live = sum(s.nbytes() for s in sizes if s is not None)
        self.peak = max(self.peak, self.live)
        return self.live

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                self._track(getattr(t, name))
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage)
            weakref.finalize(storage, self._storages.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self._track(leaf)
        self._update()
        return out


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storages, a wrapper subclass (DTensor, an FP8 weight) opened to its inner tensors."""
    if not isinstance(t, torch.Tensor):
        return 0
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.untyped_storage().nbytes()


def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=args.tokens, d_model=args.width, n_heads=8, n_layers=args.layers)


def _build(v: Variant, args: argparse.Namespace) -> nn.Module:
    r = recipe.from_name(v.recipe) if v.recipe is not None else None
    torch.manual_seed(0)
    if args.model == "gpt":
        model = TinyGPT(_gpt_config(args))
        if r is None:
            return model
        with tl.quantized_model_init(enabled=v.quantized_init, recipe=r):
            return tl.convert_to_fp8(model, recipe=r)
    layers: list[nn.Module] = []
    with tl.quantized_model_init(enabled=v.quantized_init, recipe=r):
        for i in range(args.layers):
            if i:
                layers.append(nn.ReLU())
            linear = nn.Linear if r is None else tl.Linear
            kwargs = {} if r is None else {"recipe": r}
            layers.append(linear(args.width, args.width, **kwargs))
    model = nn.Sequential(*layers)
    if v.world == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    shard_kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (v.world,)), "fp8_all_gather": v.gather == "fp8"}
    if v.gather == "bf16":
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear | tl.Linear):
            tl.distributed.fully_shard(layer, **shard_kwargs)
    return tl.distributed.fully_shard(model, **shard_kwargs)


def _measure(v: Variant, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(params, resident, peak, rss peak growth) in MiB, on this rank."""
    torch.set_num_threads(1)
    mode = LiveTensorBytes()
    with mode:
        model = _build(v, args)
        params = sum(_tensor_bytes(p) for p in model.parameters())
        if v.quantized_init and v.world == 1:
            masters = tl.optim.MasterWeights(model)
            opt = torch.optim.AdamW(masters.parameters(), lr=1e-3)
            masters.attach(opt)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if args.model == "gpt":
            x = SyntheticText(_gpt_config(args), seed=0).batch(1)

            def loss() -> torch.Tensor:
                with tl.autocast(enabled=v.recipe is not None, recipe=recipe.from_name(v.recipe or "current")):
                    return lm_loss(model(x), x)
        else:
            x = torch.randn(args.tokens, args.width)

            def loss() -> torch.Tensor:
                return model(x).square().mean()

        def step() -> None:
            loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        resident = mode.reset_peak()
        rss_before = _rss_kib("VmRSS")
        _reset_rss_peak()
        step()
        rss_peak = _rss_kib("VmHWM") - rss_before
    return params / MIB, resident / MIB, mode.peak / MIB, rss_peak / 1024.0


def _rank(rank: int, world: int, port: int, v: Variant, args: argparse.Namespace, results: Any) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, _measure(v, args)))
    except BaseException as e:  # noqa: BLE001 - reported, not a hang of the parent
        results.put((rank, e))
        raise
    finally:
        if world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(v: Variant, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """The variant in fresh processes; the largest figure of any rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, v.world, port, v, args, results)) for r in range(v.world)]
    for p in procs:
        p.start()
    figures = [results.get(timeout=600)[1] for _ in procs]
    failed = [f for f in figures if isinstance(f, BaseException)]
    if failed:
        raise RuntimeError(f"{v.label}: a rank failed") from failed[0]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{v.label}: a rank exited with {p.exitcode}")
    return tuple(max(f[i] for f in figures) for i in range(4))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32, help="rows of the batch (per rank)")
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--only", default="", help="run the variants whose label contains this")
    args = parser.parse_args()
    if args.model == "gpt":
        n = sum(p.numel() for p in TinyGPT(_gpt_config(args)).parameters())
        print(f"built-in GPT: {args.layers} blocks, d_model {args.width}, {args.tokens} tokens; "
              f"{n / 1e6:.1f} M parameters, fp32 {n * 4 / MIB:.1f} MiB")
    else:
        weights = args.layers * args.width * args.width * 4 / MIB
        print(f"{args.layers} x Linear({args.width}, {args.width}), {args.tokens} rows; fp32 weights {weights:.1f} MiB")
    print("MiB per rank; peak: most live tensor bytes during a step; rss peak: VmHWM growth over the step\n")
    print(f"| {'variant':<52} |  params | resident |    peak | rss peak |")
    print(f"|{'-' * 54}|--------:|---------:|--------:|---------:|")
    for v in GPT_VARIANTS if args.model == "gpt" else VARIANTS:
        if args.only not in v.label:
            continue
        params, resident, peak, rss = run(v, args)
        print(f"| {v.label:<52} | {params:7.1f} | {resident:8.1f} | {peak:7.1f} | {rss:8.1f} |", flush=True)


if __name__ == "__main__":
    main()
