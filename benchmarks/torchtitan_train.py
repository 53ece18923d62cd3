"""torchtitan's own ``Trainer`` on the CPU with this package's converters: losses against the same run without
a converter, DCP checkpoint resume, bytes FSDP2 all-gathers.

Runs torchtitan's ``llama3_debugmodel`` / ``qwen3_moe_debug`` trainer configs on gloo ranks (FSDP2 over all
of them, as torchtitan shards: each block, then the root), with the converters of
``transformer_linear.integrations.torchtitan`` added to the model spec, and prints one JSON line per run.

What is changed for a CPU run (``cpu_trainer_config`` and ``cpu_shim``), and nothing else:

- torchtitan picks its device at import (``torchtitan.tools.utils.device_type``: the accelerator, else
  "cuda"); ``cpu_shim`` rebinds every torchtitan module's ``device_type`` / ``device_module`` that says
  "cuda" / ``torch.cuda`` to "cpu" / ``torch.cpu``. The gloo process group is made before the Trainer,
  which then skips its own (NCCL) init.
- FlexAttention has no backward on the CPU: each layer's ``inner_attention`` becomes torchtitan's
  ``ScaledDotProductAttention`` (causal; what torchtitan's graph_trainer tests do), and the data are one
  document per sequence, so the document mask Flex would apply is the causal one.
- gloo has no ``PREMUL_SUM``: FSDP2's reduce-scatter is forced to a SUM (torchtitan's divide factor is 1.0,
  it divides the gradients itself), by wrapping ``torchtitan.distributed.fsdp.disable_fsdp_gradient_division``.
- torch 2.13 has no ``torch.distributed.set_timeout``, which torchtitan calls once after the first step
  to shorten the groups' timeouts: ``torchtitan.distributed.utils.set_pg_timeouts`` does nothing then.
- The data: torchtitan's c4_test and tokenizer are repository assets, not in the wheel; a synthetic
  bigram language (``SyntheticDataLoader``, a torchtitan dataloader whose state is its step, so DCP resumes
  it) and a tokenizer that only reports the vocabulary size.
- Sizes for two cores: ``--seq-len``, ``--batch``, ``--layers`` (fewer of the debug model's identical
  layers), the validator off, activation checkpointing off unless ``--activation-checkpoint`` (the debug
  models' own, selective), fp32 parameters (FSDP2 ``param_dtype``).

Example (the figures in docs/torchtitan.md):

    python benchmarks/torchtitan_train.py --model llama3 --recipes none current mxfp8 nvfp4 --steps 30 --compile
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import socket
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.distributed import fsdp as titan_fsdp
from torchtitan.distributed import utils as titan_dist_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry as llama3_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.qwen3 import model_registry as qwen3_registry
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug
from torchtitan.trainer import Trainer

from transformer_linear import _C
from transformer_linear.integrations.torchtitan import TLGroupedExpertsConverter, TLLinearConverter

MODELS = {
    "llama3": (llama3_debugmodel, llama3_registry, "debugmodel"),
    "qwen3_moe": (qwen3_moe_debug, qwen3_registry, "debugmodel_moe"),
}


class _CPUDeviceModule:
    """``torch.cpu`` plus the calls torchtitan's memory monitor makes of a device module (the CPU has no
    allocator statistics: the monitor reports -1, the capacity is the machine's memory)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def memory_stats(self, device: Any = None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _sum_reduce_scatter(disable_division: Any) -> Any:
    @functools.wraps(disable_division)
    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division.tl_cpu_shim = True
    return disable_fsdp_gradient_division


def cpu_shim() -> None:
    """Point torchtitan's device globals (bound at import to "cuda" on a machine without an accelerator)
    at the CPU, in every torchtitan module that holds them; and make FSDP2's gradient reduce-scatter a SUM.

    torchtitan divides the gradients itself and sets FSDP2's divide factor to 1.0, which FSDP2 sends as
    ``ReduceOp.PREMUL_SUM(1.0)``, an op gloo lacks; a plain SUM is the same reduction.
    """
    if not hasattr(dist, "set_timeout"):
        # This torch has no dist.set_timeout, which torchtitan calls once after the first step to shorten the
        # process groups' timeouts: the groups keep their initial timeout.
        titan_dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    if not getattr(titan_fsdp.disable_fsdp_gradient_division, "tl_cpu_shim", False):
        titan_fsdp.disable_fsdp_gradient_division = _sum_reduce_scatter(titan_fsdp.disable_fsdp_gradient_division)
    device_module = _CPUDeviceModule()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = device_module


class SyntheticTokenizer(BaseTokenizer):
    """A tokenizer that only knows its vocabulary size (the data are token ids already)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, tokenizer_path: str = "") -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("SyntheticTokenizer: the synthetic data are token ids")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("SyntheticTokenizer: the synthetic data are token ids")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticDataLoader(BaseDataLoader):
    """A bigram language: each token is followed by its successor in a fixed random permutation with
    probability 0.75, else by a random token. Batch ``i`` of rank ``r`` depends only on (seed, r, i); the
    state is ``i``, so a DCP checkpoint resumes the stream exactly."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any = None,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        self.config, self.rank, self.world = config, dp_rank, dp_world_size
        self.seq_len, self.batch = seq_len, local_batch_size
        self.step = 0
        self.successor = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(config.seed))

    def _batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 1009 + self.rank + 1)
        shape = (self.batch, self.seq_len + 1)
        noise = torch.randint(0, self.config.vocab_size, shape, generator=g)
        follow = torch.rand(shape, generator=g) < 0.75
        tokens = torch.empty(shape, dtype=torch.long)
        tokens[:, 0] = noise[:, 0]
        for t in range(1, shape[1]):
            tokens[:, t] = torch.where(follow[:, t], self.successor[tokens[:, t - 1]], noise[:, t])
        return {"input": tokens[:, :-1]}, tokens[:, 1:]

    def __iter__(self):
        while True:
            batch = self._batch(self.step)
            self.step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": self.step, "world_size": self.world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.step = int(state_dict[f"dp_rank_{self.rank}"])


def converters(recipe: Optional[str], moe: bool, fp8_all_gather: bool) -> Optional[list]:
    """The converters of a run (None: the unconverted baseline)."""
    if recipe is None:
        return None
    out = [TLLinearConverter.Config(recipe=recipe, fp8_all_gather=fp8_all_gather)]
    if moe:
        out.append(TLGroupedExpertsConverter.Config(recipe=recipe, fp8_all_gather=fp8_all_gather))
    return out


def cpu_trainer_config(model: str, recipe: Optional[str], *, steps: int, seq_len: int, batch: int,
                       layers: Optional[int], compile: bool, dump_folder: str, fp8_all_gather: bool = True,
                       checkpoint_interval: int = 0, load_step: int = -1, lr: float = 2e-3,
                       activation_checkpoint: bool = False) -> Trainer.Config:
    """torchtitan's debug trainer config for ``model`` with the converters of ``recipe``, sized and
    adapted for the CPU (see the module docstring for each change); ``activation_checkpoint``: keep the
    model config's own (the debug models': selective, per op), else none."""
    make_config, registry, flavor = MODELS[model]
    config = make_config()
    config.model_spec = registry(flavor, converters=converters(recipe, model == "qwen3_moe", fp8_all_gather))
    model_config = config.model_spec.model
    if layers is not None:
        del model_config.layers[layers:]
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.tokenizer = SyntheticTokenizer.Config(vocab_size=model_config.vocab_size)
    config.dataloader = SyntheticDataLoader.Config(vocab_size=model_config.vocab_size)
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    # FSDP2 by torch's plain fully_shard on the data-parallel mesh (DTensor only for model-parallel axes).
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer = default_adamw(lr=lr)
    config.validator.enable = False
    config.debug.seed = 0  # the same init in every run (the comparisons start from one init)
    if not activation_checkpoint:
        config.activation_checkpoint = None
    config.compile.enable = compile
    config.compile.components = ["model"]  # the loss stays eager (its compile has nothing of ours)
    config.metrics.log_freq = 1
    config.metrics.enable_tensorboard = False
    config.dump_folder = dump_folder
    config.checkpoint.enable = checkpoint_interval > 0
    config.checkpoint.interval = max(checkpoint_interval, 1)
    config.checkpoint.last_save_model_only = False
    config.checkpoint.folder = "checkpoint"
    config.checkpoint.keep_latest_k = 0  # keep every checkpoint: a run resumes from step N after later saves
    config.checkpoint.load_step = load_step
    return config


class AllGatherBytes(contextlib.AbstractContextManager):
    """Counts the bytes this rank sends into FSDP2's all-gathers (its shard of each gathered tensor), split
    into the transformer blocks' gathers (``blocks``: what the converters convert, plus the blocks' norms)
    and the rest (``other``: embeddings, final norm, output projection). The blocks' count includes the
    package's own all-gathers outside FSDP2's: an MXFP8 weight's rowwise copy that a forward recomputed
    after backward's columnwise-only gather gathers (activation checkpointing)."""

    def __init__(self) -> None:
        self.bytes = {"blocks": 0, "other": 0}
        self._group: Any = None
        self._all_gather = dist.all_gather_single
        self._unshard = FSDPParamGroup.unshard

    def __enter__(self) -> "AllGatherBytes":
        counter = self

        @functools.wraps(self._all_gather)
        def all_gather(output_tensor, input_tensor, *args, **kwargs):
            group = counter._group
            blocks = group is None or any(hasattr(m, "attention") for m in group.modules)
            counter.bytes["blocks" if blocks else "other"] += input_tensor.numel() * input_tensor.element_size()
            return counter._all_gather(output_tensor, input_tensor, *args, **kwargs)

        @functools.wraps(self._unshard)
        def unshard(group, *args, **kwargs):
            counter._group = group  # FSDP2 issues the group's all-gather inside unshard
            try:
                return counter._unshard(group, *args, **kwargs)
            finally:
                counter._group = None

        dist.all_gather_single, FSDPParamGroup.unshard = all_gather, unshard
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single, FSDPParamGroup.unshard = self._all_gather, self._unshard


def train(config: Trainer.Config) -> dict[str, Any]:
    """Build torchtitan's Trainer from ``config`` and train; returns the logged losses (step -> loss), the
    bytes this rank all-gathered per step, and the wall time."""
    cpu_shim()
    trainer = config.build()
    losses: dict[int, float] = {}
    log = trainer.metrics_processor.log

    @functools.wraps(log)
    def record(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        losses[step] = float(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    module_types = collections.Counter(type(m).__name__ for part in trainer.model_parts for m in part.modules())
    start = time.perf_counter()
    try:
        with AllGatherBytes() as counter:
            trainer.train()
    finally:
        trainer.close()
    steps = max(1, len(losses))
    return {"losses": losses, "seconds": time.perf_counter() - start, "module_types": dict(module_types),
            "gather_bytes_per_step": {k: v / steps for k, v in counter.bytes.items()}}


def _worker(fn, rank: int, world: int, port: int, isa: str, queue, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # two ranks on two cores
    _C.set_cpu_isa(isa)  # every rank on the same CPU path (the paths' GEMMs sum in different orders)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            queue.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure reaches the caller
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, *args: Any, world: int = 2, timeout: float = 3600.0) -> list[Any]:
    """``fn(*args)`` on ``world`` gloo ranks (spawned; ``fn`` module-level); each rank's result, in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, _C.cpu_isa(), queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def train_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A rank's run of :func:`cpu_trainer_config` (``**kwargs``), for :func:`run_ranks`."""
    return train(cpu_trainer_config(**kwargs))


def _mean_last(losses: dict[int, float], n: int) -> float:
    last = sorted(losses)[-n:]
    return sum(losses[s] for s in last) / len(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3")
    parser.add_argument("--recipes", nargs="+", default=["none", "current"], help='"none" = no converter')
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None, help="keep this many of the model's layers")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--no-fp8-all-gather", action="store_true")
    parser.add_argument("--activation-checkpoint", action="store_true",
                        help="keep the debug model's activation checkpointing (selective), else none")
    parser.add_argument("--resume-at", type=int, default=0, help="also: save at this step, resume, compare")
    parser.add_argument("--last", type=int, default=5, help="losses compared: the mean of the last N steps")
    args = parser.parse_args()
    common = dict(model=args.model, steps=args.steps, seq_len=args.seq_len, batch=args.batch, layers=args.layers,
                  compile=args.compile, fp8_all_gather=not args.no_fp8_all_gather,
                  activation_checkpoint=args.activation_checkpoint)
    baseline = None
    for name in args.recipes:
        recipe = None if name == "none" else name
        with tempfile.TemporaryDirectory() as tmp:
            out = run_ranks(train_config, dict(common, recipe=recipe, dump_folder=tmp))[0]
        row = {"model": args.model, "recipe": name, **{k: v for k, v in common.items() if k != "model"},
               "seconds": round(out["seconds"], 1), "gather_bytes_per_step": out["gather_bytes_per_step"],
               "loss_first": out["losses"][min(out["losses"])], f"loss_last{args.last}": _mean_last(out["losses"], args.last)}
        if recipe is None:
            baseline = out
        elif baseline is not None:
            ref = _mean_last(baseline["losses"], args.last)
            row["loss_vs_none"] = row[f"loss_last{args.last}"] / ref - 1
            ours, ref_bytes = out["gather_bytes_per_step"], baseline["gather_bytes_per_step"]
            row["gather_bytes_vs_none"] = {
                "all": (ours["blocks"] + ours["other"]) / (ref_bytes["blocks"] + ref_bytes["other"]),
                "blocks": ours["blocks"] / ref_bytes["blocks"]}
        if args.resume_at:
            # The uninterrupted run saves at step N (and every N steps); a new run loads step N and trains
            # to the end with the same config (the LR schedule depends on training.steps).
            with tempfile.TemporaryDirectory() as tmp:
                saved = run_ranks(train_config, dict(common, recipe=recipe, dump_folder=tmp,
                                                     checkpoint_interval=args.resume_at))[0]
                resumed = run_ranks(train_config, dict(common, recipe=recipe, dump_folder=tmp,
                                                       checkpoint_interval=args.resume_at,
                                                       load_step=args.resume_at))[0]
            after = {s: v for s, v in saved["losses"].items() if s > args.resume_at}
            row["resume_bitwise"] = resumed["losses"] == after
            row["checkpointing_run_bitwise"] = saved["losses"] == out["losses"]
            row["resume_losses"] = resumed["losses"]
        row["converted"] = {k: v for k, v in out["module_types"].items() if k.startswith("TL")}
        row["losses"] = out["losses"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
