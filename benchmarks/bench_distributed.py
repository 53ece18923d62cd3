"""Training-step time of an MLP of tl.Linear vs nn.Linear under DDP, FSDP2 and
tensor parallelism, on gloo ranks (CPU processes) of this machine.

Every engine runs the same model (``--layers`` square layers of ``--width``)
on ``--tokens`` rows per rank, with nn.Linear and with tl.Linear under current
scaling, delayed scaling, and delayed scaling without the amax all-reduce
(``set_amax_reduction_group(model, None)``): the last pair prices the
reduction (one small all-reduce per layer per forward and per backward). The
variants of one engine are timed round-robin in one run, so machine noise
hits them alike; the table gives the median step time and its ratio to
nn.Linear's under the same engine.

    python benchmarks/bench_distributed.py                     # 2 ranks, 4 x 1024, 512 rows
    python benchmarks/bench_distributed.py --engines ddp --width 2048 --iters 20
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import transformer_linear as tl
from transformer_linear import recipe

ENGINES = ("ddp", "fsdp2", "tp")
VARIANTS = ("nn.Linear", "tl current", "tl delayed", "tl delayed, no amax all-reduce")


def _mlp(args: argparse.Namespace) -> nn.Sequential:
    """``args.layers`` Linear layers of ``args.width``, a ReLU between each two."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _variant(base: nn.Sequential, name: str) -> nn.Sequential:
    model = copy.deepcopy(base)
    if name == "nn.Linear":
        return model
    fp8_recipe = recipe.CurrentScaling() if name == "tl current" else recipe.DelayedScaling()
    model = tl.convert_to_fp8(model, recipe=fp8_recipe)
    if name.endswith("no amax all-reduce"):
        tl.distributed.set_amax_reduction_group(model, None)
    return model


def _wrap(model: nn.Sequential, engine: str, mesh) -> nn.Module:
    linears = [name for name, m in model.named_children() if isinstance(m, (nn.Linear, tl.Linear))]
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if engine == "fsdp2":
        for name in linears:
            tl.distributed.fully_shard(model.get_submodule(name), mesh=mesh)
        return tl.distributed.fully_shard(model, mesh=mesh)
    from torch.distributed.tensor import parallel

    # tl.distributed's styles shard tl.Linear and nn.Linear alike. Column- and
    # row-parallel layers alternate, as in Megatron MLPs; an odd last layer stays replicated.
    plan = {}
    for colwise, rowwise in zip(linears[0::2], linears[1::2]):
        plan[colwise] = tl.distributed.ColwiseParallel()
        plan[rowwise] = tl.distributed.RowwiseParallel()
    return parallel.parallelize_module(model, mesh, plan)


def _step_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    return step


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        base = _mlp(args)
        x = torch.randn(args.tokens, args.width, generator=torch.Generator().manual_seed(rank))
        if rank == 0:
            print(
                f"{world} gloo ranks x {args.threads} thread(s); MLP {args.layers} x ({args.width} x {args.width}), "
                f"{args.tokens} rows per rank; median of {args.iters} steps (fwd + bwd + SGD)\n"
            )
            print(f"| {'engine':<6} | {'variant':<30} | {'ms / step':>9} | {'vs nn.Linear':>12} |")
            print(f"|{'-' * 8}|{'-' * 32}|{'-' * 11}|{'-' * 14}|")
        for engine in args.engines:
            # TP: every rank sees the whole batch (here: each rank's rows, the same shape).
            steps = {name: _step_fn(_wrap(_variant(base, name), engine, mesh), x) for name in VARIANTS}
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for _ in range(args.warmup):
                for step in steps.values():
                    step()
            for _ in range(args.iters):
                for name, step in steps.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - t0)
            # The slowest rank's time is the step's time.
            medians = torch.tensor([statistics.median(times[name]) for name in VARIANTS], dtype=torch.float64)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
            if rank == 0:
                base_ms = medians[0].item() * 1e3
                for name, t in zip(VARIANTS, medians.tolist()):
                    print(f"| {engine:<6} | {name:<30} | {t * 1e3:9.2f} | {t * 1e3 / base_ms:11.2f}x |")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512, help="rows per rank")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args.ranks, _free_port(), args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
