"""Helpers for multi-process tests on CPU (gloo): a free port and a spawn with a deadline."""
from __future__ import annotations

import socket
import time
from typing import Any, Callable, Tuple

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], args: Tuple[Any, ...], nprocs: int = 2, timeout: float = 120.0) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; kill them and raise after ``timeout``
    seconds (a hung collective must fail the test, not the whole CI run)."""
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"{nprocs} worker processes of {worker.__name__} did not finish in {timeout:.0f} s")
