"""AOTInductor packaging of a two-layer MLP: compile time and package size, tl.Linear against nn.Linear.

Each case runs in a fresh process with an empty Inductor cache directory (a cold compile): the MLP
(in -> hidden -> in, ReLU between, eval()) is exported with a dynamic batch and packaged with
``torch._inductor.aoti_compile_and_package``. It prints the export and package wall times, the CPU
time of the process and its children (the C++ compiler runs as a child), and the package's size. With
``--warm`` each case is packaged a second time in another fresh process reusing that cache directory.

    python benchmarks/bench_aoti.py                      # 1024 -> 4096 -> 1024
    python benchmarks/bench_aoti.py --cases nn-fp32,tl-current --warm

Cases: ``nn-fp32`` / ``nn-bf16``: nn.Linear with fp32 / bf16 weights (and input); ``tl-<recipe>``:
tl.Linear(recipe=...) with fp32 weights (quantized on every call); ``qmi-<recipe>``: built under
tl.quantized_model_init(recipe=...), so the weights are stored in FP8 (fp32 activations);
``qmi-<recipe>-rowwise``: the same with ``rowwise_only=True`` (no columnwise copy stored).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_kernels import cpu_model

DEFAULT_CASES = "nn-fp32,nn-bf16,tl-current,tl-mxfp8,qmi-current,qmi-mxfp8,qmi-block,qmi-nvfp4"


def _model(case: str, features: int, hidden: int):
    import torch  # noqa: PLC0415 (imported in the worker only)
    from torch import nn  # noqa: PLC0415

    import transformer_linear as tl  # noqa: PLC0415
    from transformer_linear import recipe  # noqa: PLC0415

    kind, _, arg = case.partition("-")
    arg, _, variant = arg.partition("-")
    if kind == "nn":
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[arg]
        return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, features)).to(dtype), dtype
    r = recipe.from_name(arg)

    def build():
        return nn.Sequential(tl.Linear(features, hidden, recipe=r), nn.ReLU(), tl.Linear(hidden, features, recipe=r))

    if kind == "tl":
        return build(), torch.float32
    if kind == "qmi":
        with tl.quantized_model_init(recipe=r, rowwise_only=variant == "rowwise"):
            return build(), torch.float32
    raise SystemExit(f"unknown case {case!r}")


def _worker(case: str, features: int, hidden: int, out: str) -> None:
    import torch  # noqa: PLC0415
    from torch.export import Dim  # noqa: PLC0415

    torch.manual_seed(0)
    model, dtype = _model(case, features, hidden)
    # An inference export: torch unwraps a QuantizedWeight into parameters, and NVFP4's uint8 data cannot
    # require grad.
    model.eval().requires_grad_(False)
    x = torch.randn(8, features, dtype=dtype)
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=4096)},))
    t1 = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(Path(out).with_suffix(".pt2")))
    t2 = time.perf_counter()
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    weights = sum(t.numel() * t.element_size() for t in _stored_tensors(model))
    Path(out).write_text(json.dumps({
        "case": case, "export_s": t1 - t0, "package_s": t2 - t1, "cpu_s": cpu,
        "package_bytes": os.path.getsize(path), "weight_bytes": weights,
    }))


def _stored_tensors(model):
    """The parameters' storage as the package holds it: a QuantizedWeight's inner tensors."""
    for p in model.parameters():
        if hasattr(p, "__tensor_flatten__"):
            names, _ = p.__tensor_flatten__()
            yield from (getattr(p, n) for n in names)
        else:
            yield p


def _run(case: str, args, cache: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"{case}-{time.monotonic_ns()}.json")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    cmd = [sys.executable, __file__, "--worker", case, "--features", str(args.features), "--hidden",
           str(args.hidden), "--out", out]
    subprocess.run(cmd, env=env, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--warm", action="store_true", help="package each case again with its cache warm")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.worker, args.features, args.hidden, args.out)
        return

    print(f"# AOTInductor packages, MLP {args.features} -> {args.hidden} -> {args.features}, dynamic batch")
    print(f"# CPU: {cpu_model()}, {os.cpu_count()} cores; load average before: {os.getloadavg()[0]:.2f}")
    print("| case | run | export s | package s (wall) | CPU s | package MB | weights MB |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            cache = os.path.join(tmp, f"cache-{case}")
            for run in ("cold", "warm") if args.warm else ("cold",):
                r = _run(case, args, cache, tmp)
                print(f"| {case} | {run} | {r['export_s']:.1f} | {r['package_s']:.1f} | {r['cpu_s']:.1f} | "
                      f"{r['package_bytes'] / 2**20:.2f} | {r['weight_bytes'] / 2**20:.2f} |", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
