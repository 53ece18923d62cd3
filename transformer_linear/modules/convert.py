"""Swap ``nn.Linear`` (and ``transformers``' ``Conv1D``) layers for ``tl.Linear`` in place.

Converted layers keep the original Parameter objects (an optimizer built
before the conversion still updates them) and the original ``state_dict``
layout: ``Conv1D`` becomes a :class:`Conv1DLinear` holding Conv1D's own
(in, out) weight, so ``save_pretrained`` of a converted model writes a
checkpoint that a vanilla ``from_pretrained`` loads correctly. The FP8
state (delayed scaling's ``fp8_*`` buffers) is saved beside the weights;
vanilla ``transformers`` reports those keys as unexpected and ignores them,
and :func:`convert_to_fp8` restores them (``fp8_state="auto"`` reads them from
the directory ``from_pretrained`` loaded).
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from transformer_linear.modules import quantized_init, tensor_parallel
from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.fp8_all_gather_params import gather_spec, make_fp8_all_gathered
from transformer_linear.modules.grouped_linear import GroupedLinear
from transformer_linear.modules.grouped_linear_quantize import check_grouped_quantization
from transformer_linear.modules.hf_experts import (
    DEFAULT_EXPERTS_IMPLEMENTATION,
    ExpertsFP8State,
    attach_fp8_states,
    is_hf_experts,
    register_hf_experts,
)
from transformer_linear.modules.linear import Linear
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.scaling import FP8_STATES

__all__ = ["Conv1DLinear", "ConversionPlan", "conversion_plan", "convert_to_fp8", "load_fp8_state"]

# The state_dict keys of delayed scaling's state (the last part of the key).
FP8_STATE_KEYS = frozenset(key for state in FP8_STATES.values() for key in (state.history_key, state.scale_key))

FilterFn = Callable[[nn.Module, str], bool]


def is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): ``x @ W + b`` with W of shape (in, out).

    Recognised by name and shape, so this module does not import ``transformers``.
    """
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and weight.shape[1] == getattr(module, "nf", None)
    )


class Conv1DLinear(Linear):
    """A ``tl.Linear`` computing what ``transformers``' ``Conv1D`` computes, on Conv1D's own weight.

    ``weight`` has Conv1D's shape (in_features, out_features) and is the
    Conv1D's Parameter object itself, so an optimizer built before the
    conversion keeps updating it, ties stay tied, and ``state_dict`` /
    ``save_pretrained`` write the weight in Conv1D's orientation (a vanilla
    ``GPT2LMHeadModel.from_pretrained`` loads it). The forward quantizes
    the transposed (out, in) copy, which the FP8 GEMMs take.

    ``delay_wgrad_compute``, ``fuse_wgrad_accumulation`` and tensor
    parallelism need the (out, in) layout and are refused.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, **kwargs: Any):
        super().__init__(in_features, out_features, bias, device, dtype, **kwargs)
        self.weight = nn.Parameter(self.weight.new_empty(in_features, out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Conv1D's initialization: normal(std 0.02) weight, zero bias."""
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """Apply the layer to ``inp`` of shape (..., in_features): ``inp @ weight + bias``."""
        if inp.dim() == 0 or inp.shape[-1] != self.in_features:
            raise ValueError(f"Conv1DLinear: argument 'inp' must have shape (..., {self.in_features}), got {list(inp.shape)}")
        if self.delay_wgrad_compute or self.fuse_wgrad_accumulation or tensor_parallel.is_tensor_parallel(self.weight):
            raise ValueError(
                "Conv1DLinear: delay_wgrad_compute, fuse_wgrad_accumulation and tensor parallelism need an (out, in) "
                "weight; convert the model with these off, or replace Conv1D by nn.Linear first"
            )
        weight = self.weight
        if isinstance(weight, quantized_init.QuantizedWeight) and layer_recipe(self.recipe) is not None:
            # Kept quantized (quantized_model_init): the stored columnwise copy is the (out, in) rowwise one.
            return self._forward(is_first_microbatch, inp, quantized_init.transposed(weight), self.bias)
        return self._forward(is_first_microbatch, inp, weight.t().contiguous(), self.bias)


def from_conv1d(conv: nn.Module, **kwargs: Any) -> Conv1DLinear:
    """A :class:`Conv1DLinear` sharing ``conv``'s (a ``Conv1D``'s) Parameters (no copy)."""
    in_features, out_features = conv.weight.shape
    with torch.device("meta"):
        new = Conv1DLinear(in_features, out_features, bias=conv.bias is not None, **kwargs)
    new.weight = conv.weight
    new.bias = conv.bias
    quantized_init.requantize(new)  # under tl.quantized_model_init: the (in, out) weight kept quantized
    new.train(conv.training)
    new.reset_fp8_state()
    return new


def linear_weight(layer: Linear) -> torch.Tensor:
    """``layer``'s weight in ``F.linear``'s (out, in) orientation (a transposed view for :class:`Conv1DLinear`)."""
    return layer.weight.t() if isinstance(layer, Conv1DLinear) else layer.weight


def _skip_reason(module: nn.Module, fqn: str, module_filter_fn: Optional[FilterFn]) -> Optional[str]:
    """None when ``module`` is converted; else why not ('' for modules that are not Linear-like at all)."""
    if isinstance(module, Linear):
        return ""
    linear_like = type(module) is nn.Linear or is_conv1d(module)
    if not linear_like:
        if isinstance(module, nn.Linear):
            return f"{type(module).__name__} is a subclass of nn.Linear (its owner may call F.linear on its weight)"
        return ""
    if module_filter_fn is not None and not module_filter_fn(module, fqn):
        return "module_filter_fn returned False"
    return None


@dataclass(frozen=True)
class ConversionPlan:
    """What :func:`convert_to_fp8` converts in a model, and what it leaves alone.

    Attributes:
        converted: qualified names of the layers it swaps for ``tl.Linear``
            (``nn.Linear`` and ``Conv1D``).
        skipped: Linear-like layers it leaves alone, with the reason.
        existing: layers that already are ``tl.Linear``.
        high_precision: other matmul weights that stay in high precision
            (``nn.MultiheadAttention``'s fused in_proj, convolutions, 2-D
            parameters of custom modules, a MoE router's weight), by
            qualified name, with the reason.
        experts: ``transformers`` experts modules (Mixtral, Qwen-MoE, ...)
            whose projections run as FP8 grouped GEMMs (the
            ``transformer_linear`` experts implementation); those
            ``module_filter_fn`` rejects are in ``skipped``.
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    existing: list[str] = field(default_factory=list)
    high_precision: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)

    def left_in_high_precision(self) -> dict[str, str]:
        """Everything that does not run in FP8 after the conversion: skipped layers and other weights."""
        return {**self.skipped, **self.high_precision}


_NOT_MATMUL = (nn.Embedding, nn.EmbeddingBag)


def _other_high_precision(model: nn.Module) -> dict[str, str]:
    """Weights outside Linear-like layers that take part in matmuls and stay in high precision."""
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        if isinstance(module, nn.MultiheadAttention):
            for pname in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                if getattr(module, pname, None) is not None:
                    out[prefix + pname] = (
                        "nn.MultiheadAttention's q/k/v projection: F.multi_head_attention_forward multiplies by "
                        "this weight directly, so it stays in high precision"
                    )
            continue
        if isinstance(module, (nn.Linear, Linear, *_NOT_MATMUL, ExpertsFP8State)) or is_conv1d(module):
            continue
        if is_hf_experts(module):
            continue  # the plan's ``experts`` (or ``skipped``)
        if isinstance(module, nn.modules.conv._ConvNd):
            out[fqn] = f"{type(module).__name__}: a convolution (convert_to_fp8 converts Linear layers only)"
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() >= 2:
                out[prefix + pname] = (
                    f"a {param.dim()}-D parameter of {type(module).__name__}: a custom module's own matmul stays in "
                    "high precision"
                )
    return out


def _check_model(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: 'model' must be a torch.nn.Module, got {type(model).__name__}")


def conversion_plan(model: nn.Module, module_filter_fn: Optional[FilterFn] = None) -> ConversionPlan:
    """List the layers :func:`convert_to_fp8` would convert and those it skips (and why)."""
    _check_model("conversion_plan", model)
    plan = ConversionPlan()
    for fqn, module in model.named_modules():
        reason = _skip_reason(module, fqn, module_filter_fn)
        if reason is None:
            plan.converted.append(fqn)
        elif reason:
            plan.skipped[fqn] = reason
        elif isinstance(module, Linear):
            plan.existing.append(fqn)
        if is_hf_experts(module):
            if module_filter_fn is None or module_filter_fn(module, fqn):
                plan.experts.append(fqn)
            else:
                plan.skipped[fqn] = "module_filter_fn returned False (the experts run in high precision)"
    plan.high_precision.update(_other_high_precision(model))
    return plan


def _fp8_entries(source: Union[str, os.PathLike, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The delayed-scaling entries of a state dict, a checkpoint file, or a checkpoint directory's files."""
    if isinstance(source, Mapping):
        items = source.items()
        return {k: v for k, v in items if k.rsplit(".", 1)[-1] in FP8_STATE_KEYS}
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"fp8_state: no such checkpoint file or directory: {path}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open  # a transformers dependency; only checkpoints in its format need it

            with safe_open(str(file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys() if k.rsplit(".", 1)[-1] in FP8_STATE_KEYS})
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            out.update(_fp8_entries(state))
    return out


def load_fp8_state(model: nn.Module, source: Union[str, os.PathLike, Mapping[str, torch.Tensor]]) -> list[str]:
    """Restore the delayed-scaling state of ``model``'s ``tl.Linear`` layers (and experts' :class:`ExpertsFP8State`).

    Args:
        model: a converted model.
        source: a state dict, a checkpoint file (``.safetensors`` or a
            ``torch.save`` file) or a directory of them (what
            ``save_pretrained`` wrote). Only the ``fp8_*`` entries are read.

    Returns:
        The names of the layers whose state was restored.

    Raises:
        ValueError: a missing file, or an entry with the wrong shape.
    """
    _check_model("load_fp8_state", model)
    entries = _fp8_entries(source)
    if not isinstance(source, Mapping):
        rename = _checkpoint_key_renamer(model)
        entries = {rename(k): v for k, v in entries.items()}
    restored = []
    for fqn, layer in model.named_modules():
        if not isinstance(layer, (Linear, ExpertsFP8State)):
            continue
        prefix = f"{fqn}." if fqn else ""
        own = {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        if own:
            layer.load_state_dict(own, strict=False)
            restored.append(fqn)
    return restored


def _checkpoint_key_renamer(model: nn.Module) -> Callable[[str], str]:
    """Checkpoint key -> the model's key, as ``from_pretrained`` renames them (transformers writes some models'
    checkpoints in their original layout: Mixtral's ``mlp`` is ``block_sparse_moe`` in the file)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # optional dependency
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:
        return lambda key: key
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return lambda key: key  # not a transformers model
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: apply_renamings(key, renamings)


def _checkpoint_dir(model: nn.Module) -> Optional[Path]:
    """The local directory ``transformers``' ``from_pretrained`` loaded ``model`` from, if any."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if isinstance(name, (str, os.PathLike)) and str(name) and Path(name).is_dir():
        return Path(name)
    return None


def convert_to_fp8(
    model: nn.Module,
    recipe: Optional[Recipe] = None,
    module_filter_fn: Optional[FilterFn] = None,
    fp8_state: Union[str, os.PathLike, Mapping[str, torch.Tensor], None] = "auto",
    fp8_all_gather: bool = False,
) -> nn.Module:
    """Replace every ``nn.Linear`` and ``Conv1D`` in ``model`` by ``tl.Linear`` (in place; returns ``model``).

    A layer reachable under several names (``nn.Sequential(lin, act, lin)``)
    becomes one ``tl.Linear`` placed under all of them, so sharing survives.
    The converted layers hold the original Parameter objects (optimizers
    built before keep working) in their original layout (``Conv1D``'s
    (in, out) weight included, see :class:`Conv1DLinear`).
    Subclasses of ``nn.Linear`` are left alone (their owner may use the
    weight directly, as ``nn.MultiheadAttention`` does); see
    :func:`conversion_plan` for what is converted and skipped.

    ``transformers`` mixture-of-experts models (experts modules built with
    ``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, ...) run
    their experts in FP8 too: each experts module gets an
    :class:`~transformer_linear.modules.hf_experts.ExpertsFP8State` per
    projection (the recipe, and delayed scaling's state), and the model's
    ``config._experts_implementation`` becomes ``"transformer_linear"`` (registered
    in ``ExpertsInterface`` here), which runs the projections as FP8 grouped
    GEMMs on the experts' own 3-D weights. The router stays in high precision.

    Args:
        model: the model; if it is itself a convertible layer the converted module is returned.
        recipe: the converted layers' recipe; None follows ``tl.autocast``.
            ``tl.Linear`` / ``tl.GroupedLinear`` layers already in the model
            without a recipe take it too; those with another recipe of their
            own keep theirs (a warning names them).
        module_filter_fn: ``fn(module, fqn) -> bool``; layers for which it
            returns False are left alone (torchao's convention).
        fp8_state: where the converted layers' delayed-scaling state comes
            from (:func:`load_fp8_state`): a state dict, a checkpoint file
            or directory; ``"auto"`` (default) reads the ``fp8_*`` entries of
            the local directory a ``transformers`` model was loaded from
            (``model.config._name_or_path``) when it holds any, so
            ``from_pretrained`` then ``convert_to_fp8`` resumes a saved FP8
            model; None starts the state fresh.
        fp8_all_gather: make the weight of every ``tl.Linear`` / ``tl.GroupedLinear`` (the filter's) one
            that FSDP2 all-gathers in its recipe's form (FP8 data and scales; NVFP4: FP4) under any
            ``torch.distributed.fsdp.fully_shard`` call, the engine's own included (torchtitan, accelerate,
            Lightning); see modules/fp8_all_gather_params.py. The layers must then run under their recipe.
            A ``Conv1D``'s (in, out) weight and ``transformers`` experts gather in high precision.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a missing ``fp8_state`` file, or entries of the wrong shape; ``fp8_all_gather`` without
            a recipe for a layer, or a weight its recipe cannot gather quantized.
        NotImplementedError: the model has experts and the grouped GEMMs do not
            take ``recipe``'s quantization (check_grouped_quantization); keep the experts in high
            precision with a ``module_filter_fn`` that rejects them.
    """
    _check_model("convert_to_fp8", model)
    experts = _experts_to_convert(model, module_filter_fn, recipe)
    if recipe is not None:
        _give_recipe_to_existing_layers(model, recipe, module_filter_fn)

    tied = _tied_weights(model)
    kept_plain = []

    def convert(module: nn.Module) -> nn.Module:
        # A weight another module holds too (an output layer tied to the embedding) stays a plain Parameter
        # under quantized_model_init: kept quantized it would be a new Parameter, and the tie would break.
        plain = quantized_init.active_config() is not None and id(module.weight) in tied
        with quantized_init.quantized_model_init(enabled=False) if plain else contextlib.nullcontext():
            if is_conv1d(module):
                return from_conv1d(module, recipe=recipe)
            return Linear.from_linear(module, recipe=recipe)

    if _skip_reason(model, "", module_filter_fn) is None:
        converted = convert(model)
        if fp8_all_gather:
            _gather_in_fp8(converted, recipe, module_filter_fn)
        return converted
    done: dict[int, nn.Module] = {}  # id(original) -> its tl.Linear, for layers reached twice
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        # _modules, not named_children(): that skips a child's second name.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if id(child) in done:
                setattr(module, name, done[id(child)])
                continue
            child_fqn = f"{fqn}.{name}" if fqn else name
            if _skip_reason(child, child_fqn, module_filter_fn) is None:
                done[id(child)] = convert(child)
                setattr(module, name, done[id(child)])
                if id(child.weight) in tied:
                    kept_plain.append(child_fqn)
    if kept_plain and quantized_init.active_config() is not None:
        warnings.warn(
            "convert_to_fp8: under quantized_model_init these layers keep a high-precision weight, which another "
            f"module holds too (tied): {', '.join(kept_plain)}; they still run their GEMMs in FP8",
            stacklevel=2,
        )
    if experts:
        _run_experts_in_fp8(experts, recipe)
    source = _checkpoint_dir(model) if isinstance(fp8_state, str) and fp8_state == "auto" else fp8_state
    if source is not None:
        load_fp8_state(model, source)
    if fp8_all_gather:
        _gather_in_fp8(model, recipe, module_filter_fn)
    return model


def _gather_in_fp8(model: nn.Module, recipe: Optional[Recipe], module_filter_fn: Optional[FilterFn]) -> None:
    """convert_to_fp8's ``fp8_all_gather``: each ``tl.Linear`` / ``tl.GroupedLinear`` weight made one FSDP2
    all-gathers by its recipe's weight quantizer (the layer's own recipe, else ``recipe``)."""
    for fqn, layer in model.named_modules():
        if not isinstance(layer, (Linear, GroupedLinear)) or (module_filter_fn and not module_filter_fn(layer, fqn)):
            continue
        spec = gather_spec(layer, layer.recipe or recipe, "convert_to_fp8", fqn, "pass recipe=...")
        make_fp8_all_gathered(layer, spec, f"convert_to_fp8 ({fqn or '<root>'})")


def _tied_weights(model: nn.Module) -> set[int]:
    """The ids of the Parameters more than one module of ``model`` holds (tied embeddings)."""
    holders = collections.Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    return {pid for pid, count in holders.items() if count > 1}


def _give_recipe_to_existing_layers(model: nn.Module, recipe: Recipe, module_filter_fn: Optional[FilterFn]) -> None:
    """``tl.Linear`` / ``tl.GroupedLinear`` layers (and experts' FP8 states of an earlier conversion) already in
    ``model`` without a recipe take ``recipe``.

    Left without one they would follow ``tl.autocast`` alone, and outside it
    run in high precision although the model was converted with a recipe.
    Layers with another recipe of their own keep it, with a warning naming them.
    """
    grouped = (GroupedLinear, ExpertsFP8State)
    layers = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, (Linear, *grouped)) and (module_filter_fn is None or module_filter_fn(m, fqn))
    ]
    if any(isinstance(m, grouped) and m.recipe is None for _, m in layers):
        check_grouped_quantization("convert_to_fp8", recipe)  # before any layer changes
    kept = []
    for fqn, layer in layers:
        if layer.recipe is None:
            layer.recipe = recipe
            layer.reset_fp8_state()  # the history length is the recipe's
        elif layer.recipe != recipe:
            kept.append(f"{fqn or '<root>'} ({layer.recipe!r})")
    if kept:
        warnings.warn(
            f"convert_to_fp8: these layers keep the recipe of their own instead of {recipe!r}: {', '.join(kept)}",
            stacklevel=3,
        )


def _experts_to_convert(model: nn.Module, module_filter_fn: Optional[FilterFn], recipe: Optional[Recipe]) -> list[nn.Module]:
    """The ``transformers`` experts modules :func:`convert_to_fp8` runs in FP8 (checked before anything changes)."""
    experts = [
        module
        for fqn, module in model.named_modules()
        if is_hf_experts(module) and (module_filter_fn is None or module_filter_fn(module, fqn))
    ]
    if experts and recipe is not None:
        try:
            check_grouped_quantization("convert_to_fp8", recipe)
        except NotImplementedError as e:
            raise NotImplementedError(
                f"{e}. The model's mixture-of-experts layers ({type(experts[0]).__name__}) run on the grouped GEMMs; "
                "keep them in high precision with a module_filter_fn that returns False for them"
            ) from None
    return experts


def _run_experts_in_fp8(experts: list[nn.Module], recipe: Optional[Recipe]) -> None:
    """Give each experts module its FP8 state modules and select the ``transformer_linear`` implementation."""
    register_hf_experts(DEFAULT_EXPERTS_IMPLEMENTATION)
    for module in experts:
        if not any(isinstance(child, ExpertsFP8State) for child in module.children()):
            attach_fp8_states(module, recipe)
        # The config is shared with the model (a sub-config for composite models): one assignment selects it.
        module.config._experts_implementation = DEFAULT_EXPERTS_IMPLEMENTATION
