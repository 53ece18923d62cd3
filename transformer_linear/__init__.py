"""transformer_linear: an FP8 Linear layer for PyTorch.

``transformer_linear.ops`` holds the FP8 kernels as ``torch.library`` custom
ops; ``transformer_linear.reference`` defines their numerics in plain torch.
"""

import importlib.machinery
import pathlib

try:
    from transformer_linear import _C  # noqa: F401  (the compiled kernels; every op module needs them)
except ImportError as _error:
    _here = pathlib.Path(__file__).parent
    _built = [p.name for s in importlib.machinery.EXTENSION_SUFFIXES for p in _here.glob(f"_C{s}")]
    if _built:
        raise ImportError(f"transformer_linear: the compiled extension {_built[0]} in {_here} failed to load: "
                          f"{_error}") from _error
    raise ImportError(
        f"transformer_linear: the compiled extension (_C) is not in {_here}. This is a source folder: run from a "
        "repository clone's root after `pip install .`, Python imports the clone's transformer_linear/ (which has "
        "no build) instead of the installed package. Run from another directory, or install with "
        "`pip install -e .`, which builds the extension into the source folder."
    ) from _error

from transformer_linear import ops, reference  # noqa: E402
from transformer_linear._compile_cache import tag_compile_caches

# Compiled graphs cached by another version of the package are not reused (_compile_cache.py).
tag_compile_caches()

__version__ = "0.1.0"

__all__ = ["ops", "reference", "__version__"]

# The Linear module and its FP8 configuration.
from transformer_linear import distributed, recipe  # noqa: E402
from transformer_linear.modules.autocast import autocast, fp8_autocast  # noqa: E402
from transformer_linear.modules.checkpointing import selective_checkpoint_contexts  # noqa: E402
from transformer_linear.modules.convert import convert_to_fp8, load_fp8_state  # noqa: E402
from transformer_linear.modules.grouped_linear import GroupedLinear  # noqa: E402
from transformer_linear.modules.grouped_linear_functional import grouped_linear  # noqa: E402
from transformer_linear.modules.hf_experts import register_hf_experts  # noqa: E402
from transformer_linear.modules.linear import Linear  # noqa: E402
from transformer_linear.modules.quantized_init import (  # noqa: E402
    clear_high_precision_init_val,
    fp8_model_init,
    get_high_precision_init_val,
    quantized_model_init,
    quantized_weight_bytes,
    requantize_weights,
)
from transformer_linear.recipe.quantization import TensorQuantizer  # noqa: E402

__all__ += [
    "GroupedLinear",
    "Linear",
    "autocast",
    "convert_to_fp8",
    "load_fp8_state",
    "distributed",
    "fp8_autocast",
    "grouped_linear",
    "recipe",
    "register_hf_experts",
    "selective_checkpoint_contexts",
    "TensorQuantizer",
    "clear_high_precision_init_val",
    "fp8_model_init",
    "get_high_precision_init_val",
    "quantized_model_init",
    "quantized_weight_bytes",
    "requantize_weights",
]

# Optimizer-side master weights of FP8 primary weights.
from transformer_linear import optim  # noqa: E402

__all__ += ["optim"]

# "Is FP8 safe for my model?": layer-by-layer comparison with nn.Linear.
from transformer_linear import numerics  # noqa: E402

__all__ += ["numerics"]
