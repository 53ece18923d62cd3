"""Run a function on several gloo ranks (CPU processes) from a pytest test.

Each rank runs ``fn(rank, world_size, *args)`` with the default process
group initialised; its return value comes back to the test. A rank that
raises fails the test with that rank's traceback, and a hang fails it after
``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_linear import _C


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, cpu_isa: str, results, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    # Two ranks share two cores: one thread each keeps them from oversubscribing.
    torch.set_num_threads(1)
    # Every rank on the test's CPU path: a rank left to measure its own could pick another one where two
    # paths time alike (the paths' FP8 GEMMs sum in different orders), and ranks would differ in their bits.
    _C.set_cpu_isa(cpu_isa)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the test
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 180.0) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return each rank's result, in rank order.

    ``fn`` must be a module-level function (it is pickled into spawned
    processes), as must its arguments.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    cpu_isa = _C.cpu_isa()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, cpu_isa, results, args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout  # for the whole run, not per rank
    join_grace = 5.0  # seconds a rank gets to exit after reporting
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # queue.Empty: some rank hangs
                join_grace = 0.5  # the hanging ranks are killed, not waited for
                raise AssertionError(
                    f"distributed test timed out after {timeout:.0f}s; ranks finished: {sorted(outcomes)}"
                ) from e
            if ok:
                outcomes[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
                join_grace = 0.5
                break  # the others may now hang waiting for it
        if failures:
            # Give the other ranks a moment to report too: the first failure to
            # arrive may be a peer's broken connection, not the cause.
            deadline = time.monotonic() + 10.0
            while len(outcomes) + len(failures) < world_size and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except Exception:
                    break
                if not ok:
                    failures.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=join_grace)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcomes[r] for r in range(world_size)]
