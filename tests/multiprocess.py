"""Run a function on N CPU ranks (gloo) with torch.multiprocessing, and collect what each returns.

Ranks are real processes joined by a real process group, started the way torchrun
would start them (RANK / WORLD_SIZE / MASTER_* in the environment), and, as torchrun's
workers do, they meet at a store their launcher (this test process) hosts: see
tests.helpers.rendezvous_ports.
"""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.helpers import rendezvous_env
from titanlite.parallel import exit_process


def _worker(rank: int, world_size: int, rendezvous: dict, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        **rendezvous,
    )
    # Ranks share the machine's cores; more threads than cores per rank only thrash.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result = fn(*args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    exit_process(0)  # as train.py's ranks end: no interpreter teardown racing gloo's threads


def run_on_ranks(world_size: int, fn: Callable, *args) -> list:
    """Call fn(*args) on `world_size` ranks; returns the per-rank results, rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(world_size, rendezvous_env(), fn, args, out_dir),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
