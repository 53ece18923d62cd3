"""torchtitan model converters: its models' Linear layers and mixture-of-experts GEMMs on this package's FP8 /
NVFP4 kernels, chosen in a torchtitan config the way its own Float8 / MXFP8 / NVFP4 converters are.

torchtitan (0.3) builds a model from a tree of configs; a converter rewrites that tree before the model is
built (on the meta device, then sharded by torchtitan's own ``fully_shard`` calls, then materialized and
initialized by ``init_states``):

- :class:`TLLinearConverter` swaps each selected ``Linear.Config`` for :class:`TLLinear.Config`, which builds a
  ``tl.Linear`` that is also a torchtitan ``Module`` (same parameter names, same ``param_init``);
- :class:`TLGroupedExpertsConverter` swaps each ``GroupedExperts.Config`` for one of a subclass whose forward
  runs the three expert projections (``w1``, ``w3``, ``w2``) as the package's grouped GEMMs on the experts' own
  3-D weights (``transformer_linear.modules.hf_experts.ExpertsFP8State``: the recipe and delayed scaling's
  state per projection). The routing (``num_tokens_per_expert``) stays on the device: ``offs`` is its cumsum
  and no GEMM reads it on the host. Expert groups of any size are taken as they come (the block recipes'
  token blocks restart at each expert, docs/moe.md), so the token dispatcher is left as it is: no padding.

```python
from transformer_linear.integrations.torchtitan import TLLinearConverter, TLGroupedExpertsConverter
config.model_spec = model_registry("debugmodel_moe", converters=[
    TLLinearConverter.Config(recipe="mxfp8", fp8_all_gather=True),
    TLGroupedExpertsConverter.Config(recipe="mxfp8", fp8_all_gather=True),
])
```

torchtitan requires its configs to be ``@dataclass(kw_only=True, slots=True)`` subclasses of its own
(non-frozen) ones, so these are not frozen; each converter validates its config when it is built.
Install with ``pip install "transformer_linear[torchtitan]"`` (the versions this was tested with).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_linear import recipe as tl_recipe
from transformer_linear.modules.autocast import layer_recipe
from transformer_linear.modules.fp8_all_gather import checked_cached_weight, gathered_weight, weight_for_op
from transformer_linear.modules.fp8_all_gather_params import gather_spec, make_fp8_all_gathered
from transformer_linear.modules.fsdp_gather_grouped import GroupedFP8AllGatherWeight, check_grouped_gatherable
from transformer_linear.modules.grouped_linear_functional import check_grouped_linear_args, run_grouped_linear
from transformer_linear.modules.grouped_linear_quantize import check_grouped_quantization
from transformer_linear.modules.hf_experts import ExpertsFP8State
from transformer_linear.modules.linear import Linear as TLLinearBase
from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import check_recipe, quantization_spec

try:
    # The optional dependency, imported here only: the package itself imports without torchtitan.
    from torch.distributed.tensor import DTensor
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.models.common.linear import Linear as TitanLinear
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.protocols.module import Module as TitanModule
    from torchtitan.tools.logging import logger
except ImportError as _error:  # pragma: no cover - exercised by the test that hides torchtitan
    raise ImportError(
        "transformer_linear.integrations.torchtitan needs torchtitan; install the extra: "
        f'pip install "transformer_linear[torchtitan]" ({_error})'
    ) from _error

__all__ = [
    "TLGroupedExpertsConverter",
    "TLLinear",
    "TLLinearConverter",
    "resolve_recipe",
    "tl_grouped_experts_class",
]

# A module filter's contract, as torchtitan's own converters' (torchao's, on configs): (config, fqn) -> convert?
ConfigFilterFn = Callable[[Any, str], bool]


def resolve_recipe(where: str, recipe: object, options: Optional[dict] = None) -> Recipe:
    """The recipe a converter's ``recipe`` field names: a registry name (``transformer_linear.recipe
    .available_names()``: "current", "delayed", "block", "mxfp8", "rowwise", "nvfp4", ...) with ``options``
    replacing its fields' defaults, or a recipe object (then ``options`` must be empty).

    Raises:
        TypeError: ``recipe`` is neither a name nor a recipe, or options given with a recipe object.
        ValueError: an unknown name or a bad option (the message names the known ones).
    """
    options = dict(options or {})
    if isinstance(recipe, str):
        try:
            return tl_recipe.from_name(recipe, **options)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: argument 'recipe': {e}") from None
    if options:
        raise TypeError(f"{where}: argument 'recipe_options' applies to a recipe name, not to {recipe!r}")
    if recipe is None:
        raise TypeError(f"{where}: argument 'recipe' must be a recipe name or object, got None")
    check_recipe(where, recipe)
    return recipe  # type: ignore[return-value]


def _check_str_list(where: str, name: str, value: object) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{where}: argument '{name}' must be a list of str, got {value!r}")


def _replace_config(model_config: Any, parent: Any, attr: Any, new_config: Any) -> Any:
    """Put ``new_config`` where ``traverse`` found the old one; returns the (maybe new) root."""
    if parent is None:
        return new_config
    if isinstance(parent, list):
        parent[attr] = new_config
    else:
        setattr(parent, attr, new_config)
    return model_config


# ---------------------------------------------------------------------------
# Dense: Linear.Config -> tl.Linear
# ---------------------------------------------------------------------------


class TLLinear(TLLinearBase, TitanModule):
    """``tl.Linear`` as a torchtitan ``Module``: built from :class:`TLLinear.Config`, initialized by
    ``init_states`` (the config's ``param_init``, else ``nn.Linear``'s), its delayed-scaling state started
    fresh when the meta-built model is materialized."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanLinear.Config):
        """torchtitan's ``Linear.Config`` plus the recipe (an object, resolved by the converter)."""

        recipe: Any = None
        """The layer's recipe (a ``transformer_linear.recipe`` object); None follows ``tl.autocast``."""

        fp8_all_gather: bool = False
        """FSDP2 all-gathers the weight in the recipe's form (see convert_to_fp8's ``fp8_all_gather``)."""

        def __post_init__(self) -> None:
            check_recipe("TLLinear.Config", self.recipe)
            if self.fp8_all_gather and self.recipe is None:
                raise ValueError("TLLinear.Config: fp8_all_gather=True needs a recipe")

    def __init__(self, config: Config) -> None:
        TLLinearBase.__init__(self, config.in_features, config.out_features, bias=config.bias, recipe=config.recipe)
        if config.fp8_all_gather:
            # Before torchtitan's fully_shard: the shard FSDP2 makes is then one that gathers itself quantized.
            spec = gather_spec(self, config.recipe, "TLLinear", "", "")
            make_fp8_all_gathered(self, spec, "TLLinear")

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        # to_empty() left the delayed-scaling buffers uninitialized: start the state fresh.
        self.reset_fp8_state()


class TLLinearConverter(QuantizationConverter):
    """Replace the model's ``Linear.Config`` nodes by :class:`TLLinear.Config` (a ``tl.Linear`` under a recipe).

    Which layers: every plain ``Linear.Config`` (subclasses, such as another converter's, are left alone)
    whose fqn contains one of ``fqns`` (empty: all), none of ``filter_fqns``, and for which ``module_filter_fn``
    returns True; the output projection (``lm_head`` / ``output``) and the MoE router's gate only when asked.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: Any = "current"
        """A ``transformer_linear.recipe`` name ("current", "delayed", "block", "mxfp8", "rowwise", "nvfp4", ...)
        or a recipe object."""

        recipe_options: dict = field(default_factory=dict)
        """Fields of the named recipe that replace its defaults (``{"margin": 1}``)."""

        fqns: list[str] = field(default_factory=list)
        """Convert only Linears whose fqn contains one of these (empty: every Linear)."""

        filter_fqns: list[str] = field(default_factory=list)
        """Leave alone the Linears whose fqn contains one of these (torchtitan's Float8 converter's field)."""

        module_filter_fn: Optional[ConfigFilterFn] = None
        """``fn(linear_config, fqn) -> bool``: False leaves that Linear alone."""

        convert_lm_head: bool = False
        """Also convert the output projection (``lm_head`` / ``output``), which by default stays high precision."""

        convert_router: bool = False
        """Also convert MoE routers' gates (``...router.gate``), which by default stay high precision."""

        fp8_all_gather: bool = False
        """FSDP2 (torchtitan's ``fully_shard``) all-gathers the converted weights quantized, not in high
        precision; the layers must then run under their recipe."""

    def __init__(self, config: Config) -> None:
        self.config = config
        where = "TLLinearConverter"
        self.recipe = resolve_recipe(where, config.recipe, config.recipe_options)
        _check_str_list(where, "fqns", config.fqns)
        _check_str_list(where, "filter_fqns", config.filter_fqns)
        if config.module_filter_fn is not None and not callable(config.module_filter_fn):
            raise TypeError(f"{where}: argument 'module_filter_fn' must be callable, got {config.module_filter_fn!r}")
        for name in ("convert_lm_head", "convert_router", "fp8_all_gather", "model_compile_enabled"):
            if not isinstance(getattr(config, name), bool):
                raise TypeError(f"{where}: argument '{name}' must be a bool, got {getattr(config, name)!r}")
        if config.fp8_all_gather:
            # Checked now rather than at the first gather: a recipe that cannot gather any weight quantized.
            quantization_spec(self.recipe)

    def selects(self, linear_config: Any, fqn: str) -> bool:
        """Whether the converter converts the Linear ``linear_config`` found at ``fqn``."""
        cfg = self.config
        if type(linear_config) is not TitanLinear.Config:
            return False
        last = fqn.rsplit(".", 1)[-1]
        if not cfg.convert_lm_head and last in ("lm_head", "output"):
            return False
        if not cfg.convert_router and ".router." in f".{fqn}":
            return False
        if cfg.fqns and not any(f in fqn for f in cfg.fqns):
            return False
        if any(f in fqn for f in cfg.filter_fqns):
            return False
        return cfg.module_filter_fn is None or bool(cfg.module_filter_fn(linear_config, fqn))

    def convert(self, model_config: Any) -> Any:
        """The model config with the selected Linears as :class:`TLLinear.Config` (changed in place)."""
        converted = []
        for fqn, linear_config, parent, attr in list(model_config.traverse(TitanLinear.Config)):
            if not self.selects(linear_config, fqn):
                continue
            fields = {f.name: getattr(linear_config, f.name) for f in dataclasses.fields(linear_config)}
            new_config = TLLinear.Config(**fields, recipe=self.recipe, fp8_all_gather=self.config.fp8_all_gather)
            model_config = _replace_config(model_config, parent, attr, new_config)
            converted.append(fqn)
        logger.info(f"transformer_linear: {len(converted)} Linear layers to tl.Linear under {self.recipe!r}")
        return model_config


# ---------------------------------------------------------------------------
# Mixture of experts: GroupedExperts -> grouped GEMMs
# ---------------------------------------------------------------------------

# The experts' weights, their (out, in) layout per expert, and the state module of each.
_PROJECTIONS = ("w1_EFD", "w3_EFD", "w2_EDF")


class _ExpertsState(ExpertsFP8State, TitanModule):
    """One projection's recipe and delayed-scaling state, as a torchtitan ``Module`` (the Trainer checks that
    every submodule is one)."""

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        self.reset_fp8_state()  # to_empty() left the buffers uninitialized


def _plain_experts_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A gathered-in-FP8 expert weight is saved as its plain high-precision master (a DTensor of plain shards
    under FSDP2), so checkpoints load into models with or without the converter."""
    for name in _PROJECTIONS:
        key = prefix + name
        weight = state_dict.get(key)
        if weight is None:
            continue
        local = weight._local_tensor if isinstance(weight, DTensor) else weight
        if not isinstance(local, GroupedFP8AllGatherWeight):
            continue
        if local is weight:
            state_dict[key] = local._tensor
            continue
        with torch.no_grad():
            state_dict[key] = DTensor.from_local(local._tensor, weight.device_mesh, weight.placements,
                                                 run_check=False, shape=weight.shape, stride=weight.stride())


class _TLGroupedExpertsMixin:
    """What the converted experts class adds to its torchtitan ``GroupedExperts`` parent."""

    def _init_tl(self, config: Any) -> None:
        for name in _PROJECTIONS:
            setattr(self, f"fp8_{name[:2]}", _ExpertsState(config.recipe))
        if config.fp8_all_gather:
            spec = check_grouped_quantization("TLGroupedExperts", config.recipe)
            # Each rank quantizes whole experts: the experts must split evenly over the shard group, checked
            # at the first gather (the group is not known yet); what does not depend on it is checked now.
            check_grouped_gatherable(spec, self.num_experts, 1, "TLGroupedExperts")
            for name in _PROJECTIONS:
                weight = getattr(self, name)
                wrapped = GroupedFP8AllGatherWeight(weight.detach(), spec.weight, spec.history)
                setattr(self, name, nn.Parameter(wrapped, requires_grad=weight.requires_grad))
            self._register_state_dict_hook(_plain_experts_in_state_dict)

    def _projection(self, name: str, inp: Tensor, offs: Tensor) -> Tensor:
        weight = getattr(self, name)
        state: _ExpertsState = getattr(self, f"fp8_{name[:2]}")
        if isinstance(weight, DTensor):
            # As the parent does: the GEMMs take the local tensors (under EP a shard of the experts).
            weight = weight.to_local()
        gathered = gathered_weight(weight)
        if gathered is None:
            return state(inp.to(weight.dtype), weight, offs)
        # FSDP2 gathered the experts in FP8: the GEMMs read that copy (the cached-weight path).
        recipe = layer_recipe(state.recipe)
        if recipe is None:
            raise ValueError(f"TLGroupedExperts: {name} was all-gathered quantized but runs without a recipe")
        spec = check_grouped_quantization("TLGroupedExperts", recipe)
        check_grouped_linear_args("TLGroupedExperts", inp, gathered, offs, None)
        cached = checked_cached_weight(gathered, spec.weight)
        return run_grouped_linear(state, inp.to(gathered.dtype), weight_for_op(gathered), offs, None, spec,
                                  cached).out

    def forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        """SwiGLU experts on tokens sorted by expert: ``w2(silu(w1 x) * w3 x)`` per expert, as the grouped
        GEMMs of each projection's recipe (``num_tokens_per_expert_E`` never read on the host)."""
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h = F.silu(self._projection("w1_EFD", x_RD, offs)) * self._projection("w3_EFD", x_RD, offs)
        return self._projection("w2_EDF", h, offs).type_as(x_RD)


_CLASSES: dict[type, type] = {}


def tl_grouped_experts_class(parent: type) -> type:
    """The converted class of a torchtitan ``GroupedExperts`` (sub)class ``parent`` (one per parent, cached):
    its Config is ``parent.Config`` plus ``recipe`` and ``fp8_all_gather``.

    Raises:
        TypeError: ``parent`` is not a ``GroupedExperts`` subclass.
    """
    if not (isinstance(parent, type) and issubclass(parent, GroupedExperts)):
        raise TypeError(f"tl_grouped_experts_class: argument 'parent' must be a GroupedExperts subclass, got {parent!r}")
    if parent in _CLASSES:
        return _CLASSES[parent]
    if issubclass(parent, _TLGroupedExpertsMixin):
        return parent

    @dataclass(kw_only=True, slots=True)
    class Config(parent.Config):  # type: ignore[name-defined, misc]
        recipe: Any = None
        fp8_all_gather: bool = False

        def __post_init__(self) -> None:
            if self.recipe is not None:
                check_grouped_quantization("TLGroupedExperts.Config", self.recipe)
            if self.fp8_all_gather and self.recipe is None:
                raise ValueError("TLGroupedExperts.Config: fp8_all_gather=True needs a recipe")

    def __init__(self: Any, config: Any) -> None:
        parent.__init__(self, config)
        self._init_tl(config)

    name = f"TL{parent.__name__}"
    cls = type(name, (_TLGroupedExpertsMixin, parent), {"Config": Config, "__init__": __init__,
                                                          "__module__": __name__, "__qualname__": name})
    _CLASSES[parent] = cls
    return cls


class TLGroupedExpertsConverter(QuantizationConverter):
    """Replace each ``GroupedExperts.Config`` (any subclass) by its :func:`tl_grouped_experts_class` config."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: Any = "current"
        """A ``transformer_linear.recipe`` name or object the grouped GEMMs take (check_grouped_quantization):
        "current", "delayed", "block", "mxfp8", "rowwise", "nvfp4"."""

        recipe_options: dict = field(default_factory=dict)
        """Fields of the named recipe that replace its defaults."""

        fqns: list[str] = field(default_factory=list)
        """Convert only the experts whose fqn contains one of these (empty: all)."""

        filter_fqns: list[str] = field(default_factory=list)
        """Leave alone the experts whose fqn contains one of these."""

        module_filter_fn: Optional[ConfigFilterFn] = None
        """``fn(experts_config, fqn) -> bool``: False leaves those experts alone."""

        fp8_all_gather: bool = False
        """FSDP2 all-gathers the experts' weights quantized (whole experts per rank: the experts must split
        evenly over the shard group; not DelayedScaling nor NVFP4, which raise here)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        where = "TLGroupedExpertsConverter"
        self.recipe = resolve_recipe(where, config.recipe, config.recipe_options)
        try:
            spec = check_grouped_quantization(where, self.recipe)
        except NotImplementedError as e:
            raise ValueError(f"{where}: argument 'recipe': {e}") from None
        _check_str_list(where, "fqns", config.fqns)
        _check_str_list(where, "filter_fqns", config.filter_fqns)
        if config.module_filter_fn is not None and not callable(config.module_filter_fn):
            raise TypeError(f"{where}: argument 'module_filter_fn' must be callable, got {config.module_filter_fn!r}")
        if not isinstance(config.fp8_all_gather, bool):
            raise TypeError(f"{where}: argument 'fp8_all_gather' must be a bool, got {config.fp8_all_gather!r}")
        if config.fp8_all_gather:
            check_grouped_gatherable(spec, 1, 1, where)

    def selects(self, experts_config: Any, fqn: str) -> bool:
        """Whether the converter converts the experts ``experts_config`` found at ``fqn``."""
        cfg = self.config
        if isinstance(experts_config, _converted_configs()):
            return False
        if cfg.fqns and not any(f in fqn for f in cfg.fqns):
            return False
        if any(f in fqn for f in cfg.filter_fqns):
            return False
        return cfg.module_filter_fn is None or bool(cfg.module_filter_fn(experts_config, fqn))

    def convert(self, model_config: Any) -> Any:
        """The model config with the selected experts converted (changed in place)."""
        converted = []
        for fqn, experts_config, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            if not self.selects(experts_config, fqn):
                continue
            cls = tl_grouped_experts_class(type(experts_config)._owner)
            fields = {f.name: getattr(experts_config, f.name) for f in dataclasses.fields(experts_config)}
            new_config = cls.Config(**fields, recipe=self.recipe, fp8_all_gather=self.config.fp8_all_gather)
            model_config = _replace_config(model_config, parent, attr, new_config)
            converted.append(fqn)
        logger.info(f"transformer_linear: {len(converted)} GroupedExperts on the grouped GEMMs under {self.recipe!r}")
        return model_config


def _converted_configs() -> tuple[type, ...]:
    """The configs of the converted experts classes made so far (already converted: left alone)."""
    return tuple(cls.Config for cls in _CLASSES.values())
