"""Run a function on N CPU ranks (gloo) with torch.multiprocessing, and collect what each returns.

Ranks are real processes joined by a real process group, started the way torchrun
would start them (RANK / WORLD_SIZE / MASTER_* in the environment).
"""

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs
from titanlite.parallel import exit_process

# A flavor small enough for dozens of test runs: 3 blocks (so "every 2nd block" AC and
# the last-block reshard rule both show), grouped-query attention, and a vocabulary
# (258 rows) that does not split evenly over 4 ranks.
TINY = LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=32, rope_theta=10000.0)


def register_tiny_flavor() -> None:
    LLAMA3_FLAVORS.setdefault("tiny", TINY)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Ranks share the machine's cores; more threads than cores per rank only thrash.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    register_tiny_flavor()
    result = fn(*args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    exit_process(0)  # as train.py's ranks end: no interpreter teardown racing gloo's threads


def run_on_ranks(world_size: int, fn: Callable, *args) -> list:
    """Call fn(*args) on `world_size` ranks; returns the per-rank results, rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), fn, args, out_dir),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
