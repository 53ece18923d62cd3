"""Which recipes' quantizers the grouped (mixture-of-experts) GEMMs take (:func:`check_grouped_quantization`):
every role of one scaling kind, FP8 or FP4, whose kind takes them (ScalingKind.grouped_problem). The experts'
weights, the grouped GEMMs' operands and the weight gradient are the kind's (recipe/kind*.py); the op that
runs them is in grouped_linear_ops.py.
"""

from transformer_linear.recipe import Recipe
from transformer_linear.recipe.quantization import QuantizationSpec, check_recipe, quantization_spec

__all__ = ["check_grouped_quantization"]


def check_grouped_quantization(where: str, recipe: Recipe) -> QuantizationSpec:
    """The quantizers of ``recipe``, checked to be ones the grouped GEMMs take: one scaling kind for every
    role, which takes them (ScalingKind.grouped_problem: one scale per tensor; block scales with 1 x B
    blocks, B 128, 32 or the whole row, of the input and grad_output alike, and weight scales that pair with
    them, grouped_scaling.GROUPED_GEMM_SCALINGS; NVFP4).

    Raises:
        TypeError: not a recipe (check_recipe).
        NotImplementedError: quantizers outside those (the message names the recipe and the role).
    """
    check_recipe(where, recipe)
    spec = quantization_spec(recipe)
    name = type(recipe).__name__

    def refuse(why: str) -> NotImplementedError:
        return NotImplementedError(
            f"{where}: recipe {name} {why}; the grouped GEMMs take FP8 with one scale per tensor for every role "
            "(DelayedScaling, Float8CurrentScaling), block scales for every role (Float8BlockScaling, "
            "MXFP8BlockScaling, Float8RowwiseScaling), or NVFP4 for every role (NVFP4BlockScaling)"
        )

    roles = {role: getattr(spec, role) for role in ("input", "weight", "grad_output")}
    kinds = {q.kind for q in roles.values()}
    if len(kinds) > 1:
        raise refuse(f"mixes scaling kinds across its roles ({', '.join(f'{r}: {q.kind}' for r, q in roles.items())})")
    problem = spec.weight.scaling_kind.grouped_problem(spec.input, spec.weight, spec.grad_output)
    if problem is not None:
        raise refuse(problem)
    return spec
