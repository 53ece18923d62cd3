"""The tests' recipe tables, derived from the registry (``recipe.available_names``) and from what each
recipe's quantizers are, so that a new recipe lands in every table it belongs to."""

from transformer_linear import recipe
from transformer_linear.recipe.quantization import TensorQuantizer, quantization_spec

NAMES = recipe.available_names()

ONE_PER_CLASS = list({type(recipe.from_name(name)): name for name in reversed(NAMES)}.values())[::-1]
"""One registered name per recipe class (the first), for tests that cover each recipe once, not each of its
format presets."""
SCALES_FROM_HISTORY = [name for name in ONE_PER_CLASS if quantization_spec(recipe.from_name(name)).history is not None]
"""Of those, the recipes whose scales come from an amax history (delayed scaling)."""


def weight_quantizer(name: str) -> TensorQuantizer:
    """The weight quantizer of the built-in recipe ``name``."""
    return quantization_spec(recipe.from_name(name)).weight


def names_of_kind(kind: str) -> list[str]:
    """The built-in recipes whose quantizers are of the scaling kind ``kind``."""
    return [name for name in NAMES if weight_quantizer(name).kind == kind]


BLOCK_NAMES = names_of_kind("block")
"""Block-scaled FP8 recipes (128x128, MX 1x32, rowwise)."""
ONE_WEIGHT_COPY = [name for name in NAMES if weight_quantizer(name).columnwise_is_transpose]
"""Recipes whose columnwise weight copy is the rowwise one transposed (a stored or gathered weight carries one)."""
SEPARATE_WEIGHT_COPY = [name for name in NAMES if name not in ONE_WEIGHT_COPY]
"""Recipes whose columnwise weight copy has blocks of its own."""

SHORT_HISTORY = 4
"""The amax history length the tables give recipes that keep one (a few steps fill it)."""


def built(names: list[str]) -> dict[str, recipe.Recipe]:
    """The recipes ``names`` name, those with an amax history given a short one (:data:`SHORT_HISTORY`)."""
    return {
        name: recipe.from_name(name, **({"amax_history_len": SHORT_HISTORY} if name in SCALES_FROM_HISTORY else {}))
        for name in names
    }


TENSORWISE = [name for name in ONE_PER_CLASS if weight_quantizer(name).kind == "tensorwise"]
"""One recipe per class of the tensorwise-scaled ones (current and delayed scaling)."""
