"""Is FP8 safe for my model? Compare FP8 recipes with nn.Linear, layer by layer.

    report = tl.numerics.compare(model, example_inputs)
    print(report)                  # per-layer SQNR, max error, amax, scale, underflow, saturation
    report.to_json("report.json"); report.plot("sqnr.png")

    train = tl.numerics.train_compare(model, make_batch, loss_fn, steps=200)
    print(train.summary()); train.plot("loss.png")

    with tl.numerics.monitor(model, every=100, log_dir="fp8_logs") as mon:   # during training
        ...; mon.step()

``transformer-linear compare`` runs train_compare on the built-in GPT, an
importable model factory or a Hugging Face causal LM.
"""

from transformer_linear.numerics.compare import RECIPE_NAMES, compare, resolve_recipes, train_compare, with_recipe
from transformer_linear.numerics.monitor import FP8HealthWarning, monitor, monitor_report
from transformer_linear.numerics.report import CompareReport, LayerStats, TrainReport
from transformer_linear.numerics.risk import RiskThresholds, keep_high_precision, risky_layers
from transformer_linear.numerics.stats import max_relative_error, range_stats, sqnr

__all__ = [
    "RECIPE_NAMES",
    "CompareReport",
    "FP8HealthWarning",
    "RiskThresholds",
    "keep_high_precision",
    "monitor",
    "monitor_report",
    "risky_layers",
    "with_recipe",
    "LayerStats",
    "TrainReport",
    "compare",
    "max_relative_error",
    "range_stats",
    "resolve_recipes",
    "sqnr",
    "train_compare",
]
