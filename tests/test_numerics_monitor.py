"""tl.numerics.monitor: statistics with known answers, logs, warnings, torch.compile, overhead."""

import csv
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_linear as tl
from transformer_linear import cli, recipe
from transformer_linear.numerics import FP8HealthWarning, monitor, sqnr

HAS_TENSORBOARD = True
try:
    import tensorboard  # noqa: F401
except ImportError:
    HAS_TENSORBOARD = False


def _layer(r):
    torch.manual_seed(0)
    return tl.Linear(16, 8, recipe=r)


def test_current_scaling_statistics_have_the_known_values():
    layer = _layer(recipe.CurrentScaling())
    x = torch.randn(32, 16).clamp(-4, 4)
    x[0, 0] = 8.0  # the amax
    x[1:5, 3] = 1e-12  # 4 of 512 elements: far below e4m3's smallest subnormal at scale 448/8
    with monitor(layer, every=1) as mon:
        y = layer(x)
        (record,) = mon.step()
    assert record["input_amax"] == 8.0
    assert record["input_scale"] == pytest.approx(448.0 / 8.0)
    assert record["input_underflow"] == pytest.approx(4 / 512)
    assert record["input_saturation"] == 0.0
    assert record["weight_amax"] == pytest.approx(float(layer.weight.detach().abs().max()))
    assert record["weight_scale"] == pytest.approx(448.0 / record["weight_amax"])
    expected = sqnr(y, F.linear(x.double(), layer.weight.double(), layer.bias.double()))
    assert record["output_sqnr_db"] == pytest.approx(expected)
    assert 20.0 < record["output_sqnr_db"] < 40.0


def test_delayed_scaling_reports_the_scale_the_forward_used():
    # TE's first step quantizes with scale 1: inputs above 448 saturate.
    layer = _layer(recipe.DelayedScaling(first_step_just_in_time=False))
    x = torch.randn(10, 16)
    x[:, 0] = 1000.0  # 10 of 160 elements
    with monitor(layer, every=1) as mon, pytest.warns(FP8HealthWarning, match="input saturation 6.25%"):
        layer(x)
        (first,) = mon.step()
        layer(x)
        (second,) = mon.step()
    assert first["input_scale"] == 1.0 and first["input_saturation"] == pytest.approx(10 / 160)
    assert first["output_sqnr_db"] < 10.0
    assert second["input_scale"] == pytest.approx(448.0 / 1000.0) and second["input_saturation"] == 0.0


def test_records_every_n_steps_to_jsonl_csv_and_tensorboard(tmp_path):
    model = tl.convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), recipe.CurrentScaling())
    with monitor(model, every=3, log_dir=tmp_path) as mon:
        for _ in range(7):
            model(torch.randn(4, 16)).sum().backward()
            mon.step()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["layer"]) for r in lines] == [(s, n) for s in (0, 3, 6) for n in ("0", "2")]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert len(rows) == 6 and float(rows[0]["output_sqnr_db"]) == pytest.approx(lines[0]["output_sqnr_db"])
    assert any(tmp_path.glob("events.out.tfevents.*")) == HAS_TENSORBOARD
    assert cli.main(["monitor-report", str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "monitor.png").read_bytes()[:4] == b"\x89PNG"


def test_monitor_report_on_a_directory_without_records(tmp_path, capsys):
    assert cli.main(["monitor-report", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_just_in_time_first_step_reports_the_scale_it_used():
    # The default first step scales the input by its own amax: nothing saturates.
    layer = _layer(recipe.DelayedScaling())
    x = torch.randn(10, 16)
    x[:, 0] = 1000.0
    with monitor(layer, every=1) as mon:
        layer(x)
        (first,) = mon.step()
        layer(x)
        (second,) = mon.step()
    assert first["input_scale"] == pytest.approx(448.0 / 1000.0) and first["input_saturation"] == 0.0
    assert second["input_scale"] == pytest.approx(448.0 / 1000.0) and second["input_saturation"] == 0.0


def test_warns_once_per_layer():
    layer = _layer(recipe.DelayedScaling(amax_history_len=1))
    x = torch.full((4, 16), 1000.0)
    with monitor(layer, every=1) as mon, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            layer(x * 10)  # grows every step: every step saturates
            x = x * 10
            mon.step()
    assert len([w for w in caught if issubclass(w.category, FP8HealthWarning)]) == 1


def test_layers_without_a_recipe_follow_autocast_or_are_not_recorded():
    layer = _layer(None)
    with monitor(layer, every=1) as mon:
        layer(torch.randn(4, 16))
        assert mon.step() == []
        with tl.autocast(recipe=recipe.CurrentScaling()):
            layer(torch.randn(4, 16))
            (record,) = mon.step()
    assert record["recipe"] == "CurrentScaling"


@pytest.mark.parametrize("bad, match", [(nn.ReLU(), "no tl.Linear layers"), (42, "must be an nn.Module")])
def test_rejects_models_without_fp8_layers(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        monitor(bad)


def test_compiled_model_records_without_graph_breaks():
    torch.manual_seed(0)
    eager = tl.convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), recipe.CurrentScaling())
    x = torch.randn(8, 32)
    with monitor(eager, every=2) as mon:
        for recording in (True, False):
            assert mon.recording is recording
            explained = torch._dynamo.explain(eager)(x)
            assert explained.graph_break_count == 0, explained.break_reasons
            mon._captured.clear()
            mon.step()
    compiled_model = torch.compile(eager, fullgraph=True)  # fullgraph raises on any graph break
    expected = []
    with monitor(eager, every=2) as mon:
        got = []
        for _ in range(4):
            compiled_model(x).sum().backward()
            got.append(mon.step())
    with monitor(eager, every=2) as mon:
        for _ in range(4):
            eager(x).sum().backward()
            expected.append(mon.step())
    assert [len(r) for r in got] == [2, 0, 2, 0]
    for g, e in zip(got, expected):
        for rg, re_ in zip(g, e):
            assert rg["input_amax"] == pytest.approx(re_["input_amax"])
            assert rg["output_sqnr_db"] == pytest.approx(re_["output_sqnr_db"], abs=0.5)


class _AtenOps(TorchDispatchMode):
    """The aten ops run under it, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_of_steps(model, x, mon=None, steps=2):
    with _AtenOps() as seen:
        for _ in range(steps):
            model(x).sum().backward()
            if mon is not None:
                mon.step()
    return seen.ops


def test_steps_between_recordings_run_no_extra_tensor_work():
    """Between recordings the hooks only test a flag and step() only counts: a monitored step runs
    exactly the aten ops of an unmonitored one (the time it costs is in benchmarks/bench_monitor.py)."""
    torch.manual_seed(0)
    model = tl.convert_to_fp8(nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)]), recipe.CurrentScaling())
    x = torch.randn(16, 64)
    model(x).sum().backward()  # gradients exist: every step below accumulates into them
    base = _ops_of_steps(model, x)
    with monitor(model, every=1000) as mon:
        recording = _ops_of_steps(model, x, mon, steps=1)  # step 0 records
        between = _ops_of_steps(model, x, mon)
    assert len(recording) > len(base) / 2, "the recording step should compute statistics"
    assert between == base
