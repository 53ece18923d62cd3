"""transformer_linear: an FP8 Linear layer for PyTorch.

``transformer_linear.ops`` holds the FP8 kernels as ``torch.library`` custom
ops; ``transformer_linear.reference`` defines their numerics in plain torch.
"""

from transformer_linear import ops, reference

__version__ = "0.1.0"

__all__ = ["ops", "reference", "__version__"]
