"""Is FP8 safe for my model? Compare FP8 recipes with nn.Linear, layer by layer.

    report = tl.numerics.compare(model, example_inputs)
    print(report)                  # per-layer SQNR, max error, amax, scale, underflow, saturation
    report.to_json("report.json"); report.plot("sqnr.png")

    train = tl.numerics.train_compare(model, make_batch, loss_fn, steps=200)
    print(train.summary()); train.plot("loss.png")

``python -m transformer_linear compare`` runs both on a built-in GPT-style model.
"""

from transformer_linear.numerics.compare import compare, resolve_recipes, train_compare
from transformer_linear.numerics.report import CompareReport, LayerStats, TrainReport
from transformer_linear.numerics.stats import max_relative_error, range_stats, sqnr

__all__ = [
    "CompareReport",
    "LayerStats",
    "TrainReport",
    "compare",
    "max_relative_error",
    "range_stats",
    "resolve_recipes",
    "sqnr",
    "train_compare",
]
