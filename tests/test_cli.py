"""``transformer-linear compare`` end to end: Hugging Face models, --model factories, exit codes, bad input."""

import importlib
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from transformer_linear import cli
from transformer_linear.recipe import available_names

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).parent.parent
TINY = ["--steps", "2", "--no-plots"]


def _run(capsys, *argv):
    code = cli.main(["compare", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "config, layer",
    [("tiny_llama", "model.layers.0.self_attn.q_proj"), ("tiny_gpt2", "transformer.h.0.attn.c_attn")],
)
def test_hf_model_from_config_with_text_data(tmp_path, capsys, config, layer):
    out = tmp_path / "report"
    argv = ["--hf", str(DATA / config), "--hf-random-init", "--data", str(DATA / "sample.txt")]
    code, printed, _ = _run(capsys, *argv, "--input-shape", "2,16", "--lr", "1e-3", "--out", str(out), "--steps", "2")
    assert code == 0, printed
    assert "UTF-8 bytes as ids" in printed and "verdict:" in printed
    assert "experts" not in printed.splitlines()[0]  # a dense model: no "0 experts modules"
    report = json.loads((out / "report.json").read_text())
    assert layer in report["converted"] and report["skipped"] == {}  # GPT-2's Conv1D layers are converted too
    assert {s["name"] for s in report["final_compare"]["layers"]} == set(report["converted"])
    assert all(15 < float(s["output_sqnr"]) < 60 for s in report["final_compare"]["layers"])
    assert "## Risky layers" in (out / "report.md").read_text()
    for png in ("loss_curves.png", "layer_sqnr.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_hf_token_ids_from_npy_and_layers_regex(tmp_path, capsys):
    np.save(tmp_path / "ids.npy", np.arange(4 * 16).reshape(4, 16) % 256)
    argv = ["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--data", str(tmp_path / "ids.npy")]
    code, printed, _ = _run(capsys, *argv, "--input-shape", "2,16", "--layers", r"mlp\.down", "--out", str(tmp_path), *TINY)
    assert code == 0
    names = {s["name"] for s in json.loads((tmp_path / "report.json").read_text())["final_compare"]["layers"]}
    assert names == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}


def test_model_factory_example(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, printed, _ = _run(capsys, "--model", "examples.fp8_check_model:build", "--out", str(tmp_path), *TINY)
    assert code == 0
    assert "high precision encoder.self_attn.out_proj: NonDynamicallyQuantizableLinear is a subclass" in printed
    assert "high precision encoder.self_attn.in_proj_weight: nn.MultiheadAttention's q/k/v projection" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["converted"] == ["encoder.linear1", "encoder.linear2", "head"]
    assert list(report["high_precision"]) == ["encoder.self_attn.in_proj_weight"]
    assert "in_proj_weight" in (tmp_path / "report.md").read_text()


def _write_module(tmp_path, monkeypatch, body):
    (tmp_path / "usermodels.py").write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usermodels", raising=False)


MODELS = """
    import torch
    from torch import nn

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def no_linear():
        return nn.Sequential(nn.ReLU())

    def precise():
        # Starts at the exact solution: the reference loss is the tiny noise floor,
        # FP8's quantization error is far above it. Column 15 underflows in FP8.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16))
        w, b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
        noise = 1e-3 * torch.randn(32, 16)

        def make_batch(step):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
            x[:, 15] = 1e-12
            return x

        def loss_fn(out, x):
            return (out - torch.nn.functional.linear(x, w, b) - noise).square().mean()

        return model, make_batch, loss_fn

    def broken():
        raise RuntimeError("factory failed")

    def odd_shapes():
        # NVFP4 quantizes in blocks of 16 along each copy's rows: it cannot run layers 0 (in 100) and 4 (out 60).
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 60))
"""


def test_model_factory_with_synthetic_inputs(tmp_path, capsys, monkeypatch):
    _write_module(tmp_path, monkeypatch, MODELS)
    code, printed, _ = _run(capsys, "--model", "usermodels:mlp", "--input-shape", "4,8", "--out", "rep", "--max-gap", "100", *TINY)
    assert code == 0, printed
    assert (tmp_path / "rep" / "report.md").exists()


def test_model_factory_leaves_sys_path_as_it_was(tmp_path, capsys, monkeypatch):
    """The current directory is importable only while the factory is imported and called: left on
    sys.path, a source checkout's transformer_linear (no built extension) would shadow the installed
    package in this process and in every process it spawns (multiprocessing copies sys.path)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delitem(sys.modules, "examples.fp8_check_model", raising=False)
    before = list(sys.path)
    code, printed, _ = _run(capsys, "--model", "examples.fp8_check_model:build", "--out", str(tmp_path), *TINY)
    assert code == 0, printed
    assert sys.path == before


def test_exit_status_3_when_the_gap_exceeds_max_gap_and_the_filter_closes_it(tmp_path, capsys, monkeypatch):
    _write_module(tmp_path, monkeypatch, MODELS)
    # The bf16 floor on every CPU (auto picks a perturbed-init fp32 run where bf16 is slow, and this
    # model, started at the exact solution, is not quiet under a perturbed init).
    argv = ["--model", "usermodels:precise", "--recipes", "delayed", "--lr", "1e-7", "--noise-floor", "bf16"]
    argv += ["--out", "rep", *TINY]
    code, printed, _ = _run(capsys, *argv)
    assert code == 3
    assert "DelayedScaling(HYBRID): gap" in printed and "FAIL; with the filter +0.00% PASS (the filter helped" in printed
    assert "Suggested filter for DelayedScaling(HYBRID)" in printed
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["verdict"]["exit_code"] == 3 and report["verdict"]["filtered"]["DelayedScaling(HYBRID)"]["helped"]
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert "x underflow 6.250% > 1%" in " ".join(report["risky_layers"]["0"])
    gaps = report["loss_gap"]
    assert gaps["DelayedScaling(HYBRID)"] > 1.0
    assert gaps["DelayedScaling(HYBRID) +filter"] == 0.0  # the only layer kept in high precision
    assert all(abs(gaps[f]) < 1e-3 for f in report["floor_runs"])  # high precision is quiet here
    assert "KEEP_HIGH_PRECISION" in (tmp_path / "rep" / "report.md").read_text()
    code, _, _ = _run(capsys, *argv, "--max-gap", "1e9")
    assert code == 0


def test_a_filter_that_does_not_help_beyond_the_noise_is_not_suggested(tmp_path, capsys, monkeypatch):
    """The same risky layer, but a noise margin so wide that keeping it in high precision is no measurable
    change: the layer is still reported, the filter run still shown, and no code to paste is printed."""
    _write_module(tmp_path, monkeypatch, MODELS)
    argv = ["--model", "usermodels:precise", "--recipes", "delayed", "--lr", "1e-7", "--noise-floor", "bf16",
            "--noise-factor", "1e9", "--out", "rep", *TINY]
    code, printed, _ = _run(capsys, *argv)
    assert code == 0, printed
    assert "x underflow 6.250% > 1%" in printed and "DelayedScaling(HYBRID) +filter" in printed
    assert "no measurable effect" in printed and "No filter suggested" in printed
    assert "KEEP_HIGH_PRECISION" not in printed
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["verdict"]["filter_suggested_for"] == []
    assert "KEEP_HIGH_PRECISION" not in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--size", "tiny", "--recipes", "delayed,fp4"], "--recipes: unknown recipe fp4; expected delayed, current"),
        (["--model", "no_such_package.models:build"], "--model: cannot import 'no_such_package.models': ModuleNotFoundError"),
        (["--model", "usermodels"], "--model: expected 'package.module:factory'"),
        (["--model", "usermodels:missing"], "--model: module 'usermodels' has no attribute 'missing'"),
        (["--model", "usermodels:broken"], "--model: usermodels:broken() raised RuntimeError: factory failed"),
        (["--model", "usermodels:mlp"], "returns no make_batch; describe the inputs with --input-shape"),
        (["--model", "usermodels:no_linear", "--input-shape", "4,8"], "has no nn.Linear layers"),
        (["--model", "usermodels:mlp", "--input-shape", "4,9"], "the model fails on the first batch ((4, 9) torch.float32)"),
        (["--model", "usermodels:mlp", "--input-shape", "4,x"], "--input-shape: expected positive integers"),
        (["--model", "usermodels:mlp", "--input-shape", "4,8", "--input-dtype", "long"], "--input-dtype long needs --vocab"),
        (["--hf", "no/such/dir", "--hf-random-init"], "--hf: no such directory: no/such/dir"),
        (["--hf", "./missing_model"], "--hf: no such directory: ./missing_model"),
        (["--model", "usermodels:mlp", "--input-shape", "4,8", "--batch-size", "2"], "--batch-size goes with the built-in GPT and --hf"),
        (["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--input-shape", "2,16", "--batch-size", "3"], "--batch-size 3 contradicts --input-shape 2,16"),
        (["--size", "tiny", "--seeds", "0"], "--seeds must be positive"),
        (["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--data", "ids3d.pt"], "must hold token ids of shape (n,) or (rows, seq), got [2, 2, 16]"),
        (["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--data", "big.pt"], "token ids must lie in [0, 256)"),
        (["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--data", "short.pt"], "rows of 4 tokens are shorter than the sequence length 64"),
        (["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--input-shape", "2,999"], "exceeds the model's maximum 128"),
        (["--size", "tiny", "--data", "x.txt"], "--hf-random-init and --data go with --hf"),
        (["--size", "tiny", "--layers", "("], "--layers: not a regular expression"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    _write_module(tmp_path, monkeypatch, MODELS)
    torch.save(torch.zeros(2, 2, 16, dtype=torch.long), tmp_path / "ids3d.pt")
    torch.save(torch.full((64,), 300), tmp_path / "big.pt")
    torch.save(torch.zeros(3, 4, dtype=torch.long), tmp_path / "short.pt")
    code, _, err = _run(capsys, *argv, *TINY, "--out", "rep")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("transformer-linear compare: error: "), err
    assert message in err


# Factories whose user code ends the process or forgets a return (issue 23).
EXITING_MODELS = """
    import sys

    from torch import nn

    def exits():
        sys.exit(0)

    def exits_in_make_batch():
        def make_batch(step):
            sys.exit(0)

        return nn.Sequential(nn.Linear(8, 4)), make_batch

    def no_batch():
        return nn.Sequential(nn.Linear(8, 4)), lambda step: None
"""


def test_make_batch_returning_none_is_one_line_naming_the_factory(tmp_path, capsys, monkeypatch):
    _write_module(tmp_path, monkeypatch, EXITING_MODELS)
    code, _, err = _run(capsys, "--model", "usermodels:no_batch", "--out", "rep", *TINY)
    assert code == 2
    assert err.count("\n") == 1, err
    assert "--model: the make_batch of usermodels:no_batch returned None for step 0" in err


@pytest.mark.parametrize("factory", ["exits", "exits_in_make_batch"])
def test_user_code_calling_sys_exit_is_exit_2_naming_the_factory(tmp_path, capsys, monkeypatch, factory):
    """Exit 0 means every gap within --max-gap: a factory (or its make_batch) ending the process
    wrote no report, and must not pass a CI gate."""
    _write_module(tmp_path, monkeypatch, EXITING_MODELS)
    code, _, err = _run(capsys, "--model", f"usermodels:{factory}", "--out", "rep", *TINY)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("transformer-linear compare: error: "), err
    assert f"usermodels:{factory}" in err and "sys.exit(0)" in err
    assert not (tmp_path / "rep" / "report.json").exists()


def test_batch_size_is_honoured_with_hf(tmp_path, capsys):
    argv = ["--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--batch-size", "3", "--input-shape", "3,16"]
    code, printed, _ = _run(capsys, *argv, "--out", str(tmp_path), "--noise-floor", "none", *TINY)
    assert code == 0, printed
    from transformer_linear.numerics import sources

    seen = []
    real = sources.synthetic_batches
    try:
        sources.synthetic_batches = lambda shape, *a, **k: seen.append(shape) or real(shape, *a, **k)
        cli.main(["compare", "--hf", str(DATA / "tiny_llama"), "--hf-random-init", "--batch-size", "3", "--out",
                  str(tmp_path), "--noise-floor", "none", *TINY])
    finally:
        sources.synthetic_batches = real
    assert seen == [(3, 64)]


def test_a_misspelt_option_gets_the_subcommand_usage_and_a_guess(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--stpes", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage: transformer-linear compare" in err and "did you mean --steps?" in err


def test_traceback_works_after_the_subcommand(tmp_path):
    with pytest.raises(ValueError, match="unknown recipe"):
        cli.main(["compare", "--size", "tiny", "--recipes", "bogus", "--traceback", "--out", str(tmp_path)])


def test_help_shows_the_defaults_and_the_gate(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 3e-3)" in text and "(default delayed,current)" in text
    assert "|gap| <= max(--max-gap, --noise-factor x noise floor)" in text


def test_report_is_written_after_each_run_and_compile_runs(tmp_path, capsys, monkeypatch):
    _write_module(tmp_path, monkeypatch, MODELS)
    compare_module = importlib.import_module("transformer_linear.numerics.compare")

    snapshots = []
    real = compare_module.train_run

    def spy(*a, **k):
        report = tmp_path / "rep" / "report.json"
        snapshots.append(json.loads(report.read_text())["final_loss"] if report.exists() else None)
        return real(*a, **k)

    monkeypatch.setattr(compare_module, "train_run", spy)
    argv = ["--model", "usermodels:mlp", "--input-shape", "4,8", "--out", "rep", "--compile", "--noise-floor", "none",
            "--max-gap", "100"]
    code, printed, err = _run(capsys, *argv, *TINY)
    assert code == 0, printed
    # Before each run, report.json holds every run finished so far.
    assert snapshots[0] is None and [list(s) for s in snapshots[1:3]] == [["reference"], ["reference", "DelayedScaling(HYBRID)"]]
    assert "[3/3] CurrentScaling(HYBRID)" in err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["complete"] is True and "(partial" not in (tmp_path / "rep" / "report.md").read_text()


def test_readme_other_options_name_every_recipe_and_the_report_directory_is_ignored():
    readme = (REPO / "README.md").read_text()
    options = readme[readme.index("Other options (`transformer-linear compare --help`"):]
    options = options[: options.index("\n\n")]
    assert all(f"`{name}`" in options for name in available_names())
    assert f"{cli.DEFAULT_OUT}/" in (REPO / ".gitignore").read_text().split()


def test_layers_a_recipe_cannot_run_are_found_before_training_and_kept_in_high_precision(tmp_path, capsys, monkeypatch):
    _write_module(tmp_path, monkeypatch, MODELS)
    argv = ["--model", "usermodels:odd_shapes", "--input-shape", "16,100", "--recipes", "nvfp4,block,mxfp8",
            "--max-gap", "1e9", "--out", "rep", *TINY]
    code, printed, err = _run(capsys, *argv)
    assert code == 0, printed + err
    # The header ends where the table of runs starts (the first line may say "a bf16 autocast run").
    header = printed[: printed.index("\nrun ")]
    nvfp4 = "NVFP4BlockScaling(E2M1)"
    assert f"high precision under {nvfp4} only: 0: quantize_nvfp4_packed: the columns of 'x' (100)" in header
    assert f"high precision under {nvfp4} only: 4: " in header
    assert "under Float8BlockScaling" not in header and "under MXFP8BlockScaling" not in header
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert set(report["refused_by_recipe"]) == {nvfp4} and set(report["refused_by_recipe"][nvfp4]) == {"0", "4"}
    rows = {(s["recipe"], s["name"]) for s in report["final_compare"]["layers"]}
    assert {name for recipe, name in rows if recipe == nvfp4} == {"2"}
    assert {name for recipe, name in rows if recipe.startswith("MXFP8")} == {"0", "2", "4"}
    assert "`0`, under NVFP4BlockScaling(E2M1) only" in (tmp_path / "rep" / "report.md").read_text()


def test_a_recipe_that_can_run_no_layer_is_refused_up_front(tmp_path, capsys, monkeypatch):
    _write_module(tmp_path, monkeypatch, MODELS)
    argv = ["--model", "usermodels:mlp", "--input-shape", "4,8", "--recipes", "current,nvfp4", "--out", "rep", *TINY]
    code, printed, err = _run(capsys, *argv)
    assert code == 2 and "run " not in printed
    assert "--recipes: NVFP4BlockScaling(E2M1) cannot run any of the model's layers (0: " in err
