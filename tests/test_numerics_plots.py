"""What the PNG plots of ``transformer-linear compare`` say: the verdict, and each panel's own risk threshold."""

import matplotlib
import matplotlib.figure
import pytest

from transformer_linear.numerics import verdict
from transformer_linear.numerics.report import CompareReport, LayerStats, TrainReport
from transformer_linear.numerics.risk import RiskThresholds


@pytest.fixture
def texts(monkeypatch):
    """Every text a saved figure shows (titles, tick labels, legends), by file name."""
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        seen[path.name] = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return seen


def _verdict():
    curves = {"reference": [1.0] * 10, "bf16 autocast": [1.0] * 10, "A": [1.002] * 10, "B": [1.05] * 10}
    train = TrainReport(10, curves, floor_runs=["bf16 autocast"])
    return train, verdict.judge(train, ["A", "B"], verdict.Gate())


@pytest.mark.parametrize("plot", ["layer_sqnr", "loss_curves"])
def test_both_plots_carry_the_verdict(tmp_path, texts, plot):
    train, v = _verdict()
    if plot == "layer_sqnr":
        rows = [LayerStats("fc", r, 25.0, 0.01, 15.0, 0.1, 9.0, 0.1) for r in ("A", "B")]
        CompareReport(["A", "B"], rows, 1.0, {"A": 1.0, "B": 1.0}).plot(tmp_path / f"{plot}.png", RiskThresholds(),
                                                                          {}, verdict=v)
    else:
        train.plot(tmp_path / f"{plot}.png", verdict.Gate(), v)
    shown = " ".join(texts[f"{plot}.png"])
    assert "A PASS (+0.20%)" in shown and "B FAIL (+5.00%)" in shown


def test_each_sqnr_panel_names_its_own_threshold(tmp_path, texts):
    rows = [LayerStats("fc", "A", 25.0, 0.01, 15.0, 0.1, 9.0, 0.1)]
    thresholds = RiskThresholds(min_output_sqnr_db=20.0, min_grad_sqnr_db=10.0)
    CompareReport(["A"], rows, 1.0, {"A": 1.0}).plot(tmp_path / "sqnr.png", thresholds)
    titles = [t for t in texts["sqnr.png"] if "SQNR, dB" in t]
    assert len(titles) == 3
    assert "risky below 20 dB" in titles[0]
    assert all("risky below 10 dB" in t for t in titles[1:])
    assert not any("risky below 20 dB" in t for t in texts["sqnr.png"] if t not in titles[:1])
