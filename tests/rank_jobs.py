"""Run functions on N CPU ranks (gloo) with torch.multiprocessing, and collect what each returns.

Ranks are real processes joined by a real process group, started the way torchrun
would start them (RANK / WORLD_SIZE / MASTER_* in the environment), and, as torchrun's
workers do, they meet at a store their launcher (this test process) hosts: see
tests.helpers.rendezvous_ports.

Starting rank processes (each imports torch) costs seconds; run_jobs_on_ranks runs many
small jobs in one launch, each in a process group of its own.
"""

import copy
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from tests.helpers import AGENT_STORE, rendezvous_ports
from titanlite.parallel import exit_process


def forget_dtensor_caches() -> None:
    """After a process group is destroyed, before the next one: DTensor caches sharding
    decisions and redistribution planners with the meshes they were made for, and a mesh of
    the next group with the same shape compares equal to the last one's (torch 2.13 compares
    layouts, not process groups): a cached output spec (an in-place optimizer update's, say)
    would put a parameter on the destroyed groups."""
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


class Job(NamedTuple):
    """fn(*args) on `world_size` ranks, as if launched alone: they see RANK 0..world_size-1."""

    world_size: int
    fn: Callable
    args: tuple = ()


class _Placed(NamedTuple):
    name: str
    job: Job
    first_rank: int  # the launch's ranks first_rank .. first_rank + world_size - 1 run it
    port: int  # its own store: each job starts a new default process group


def _place(world_size: int, jobs: dict[str, Job]) -> list[_Placed]:
    """Each job on a block of consecutive ranks, smaller jobs side by side on the block
    with the fewest jobs yet. Every rank takes its jobs in this list's order, so the ranks
    of a job always meet (no rank waits for a job that another rank has queued later)."""
    load = [0] * world_size
    placed = []
    ports = rendezvous_ports(len(jobs))
    for (name, job), port in zip(jobs.items(), ports, strict=True):
        if world_size % job.world_size:
            raise ValueError(f"job {name!r}: {job.world_size} rank(s) do not divide a launch of {world_size}")
        blocks = range(0, world_size, job.world_size)
        first = min(blocks, key=lambda start: max(load[start : start + job.world_size]))
        for rank in range(first, first + job.world_size):
            load[rank] += 1
        placed.append(_Placed(name, job, first, port))
    return placed


# How long a job's ranks wait for each other before the job starts: up to the time of the
# jobs its other ranks have queued before it (a peer that dies ends the launch anyway).
MEET_TIMEOUT = timedelta(minutes=30)


def _meet(port: int, world_size: int) -> None:
    """Wait until the job's `world_size` ranks have all come to its store, so that the
    trainer's process-group timeout (comm.init_timeout_seconds) does not also count the
    time some ranks spent on earlier jobs."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=MEET_TIMEOUT)
    if store.add("job_ranks_arrived", 1) == world_size:
        store.set("job_ranks_all_here", "1")
    store.wait(["job_ranks_all_here"])


def _log_job_time(name: str, job_rank: int, seconds: float, cpu_seconds: float) -> None:
    """With TITANLITE_JOB_TIMES=FILE, one line per job and rank appended to FILE: the rank's
    wall and CPU seconds. On a machine the suite keeps busy, the CPU seconds summed over a job's
    ranks are what the job costs the suite."""
    path = os.environ.get("TITANLITE_JOB_TIMES")
    if path:
        with open(path, "a") as log:
            log.write(f"{seconds:7.1f} s  {cpu_seconds:7.1f} s CPU  rank {job_rank}  {name}\n")


# Rank processes fork from multiprocessing's fork server, which has imported torch and
# titanlite once per test process (tests/conftest.py): a spawned rank imported them again
# (about 2.5 s of CPU each, a third of the suite's CPU time over its few hundred ranks).


def _worker(rank: int, placed: list[_Placed], out_dir: str, environ: dict) -> None:
    # A forked rank has the fork server's environment; a rank sees the launching test's, as
    # a spawned one did (a test's monkeypatched variables included).
    os.environ.clear()
    os.environ.update(environ)
    # One intra-op thread, as run_tests.sh gives every process: the suite keeps every core busy
    # without them, and a second thread's waits at OpenMP's barriers only spin.
    torch.set_num_threads(1)
    results = {}
    for name, job, first, port in placed:
        if not first <= rank < first + job.world_size:
            continue
        job_rank = rank - first
        os.environ.update(
            RANK=str(job_rank),
            LOCAL_RANK=str(job_rank),
            WORLD_SIZE=str(job.world_size),
            LOCAL_WORLD_SIZE=str(job.world_size),
            MASTER_PORT=str(port),
            **AGENT_STORE,
        )
        _meet(port, job.world_size)
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            # A copy as the job left it: a later job must not change what it returned
            # (a list a log handler of this job still appends to, say).
            results[name] = copy.deepcopy(job.fn(*job.args))
        except BaseException as error:
            raise RuntimeError(f"job {name!r} failed on its rank {job_rank}") from error
        _log_job_time(name, job_rank, time.perf_counter() - started, time.process_time() - cpu_started)
        if dist.is_initialized():  # the next job starts a default group of its own
            dist.destroy_process_group()
        forget_dtensor_caches()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    exit_process(0)  # as train.py's ranks end: no interpreter teardown racing gloo's threads


def run_jobs_on_ranks(world_size: int, jobs: dict[str, Job]) -> dict[str, list]:
    """Run every job in one launch of `world_size` rank processes; returns each job's
    per-rank results, in its rank order. A failing job fails the launch, naming the job.

    A job starts once its own ranks are done with their earlier jobs, not all ranks: a job
    that reads what an earlier one wrote must share a rank with it, or follow a job that
    does (a job on every rank waits for everything before it)."""
    placed = _place(world_size, jobs)
    with tempfile.TemporaryDirectory() as out_dir:
        worker_args = (placed, out_dir, dict(os.environ))
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, start_method="forkserver")
        per_rank = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    return {
        name: [per_rank[rank][name] for rank in range(first, first + job.world_size)] for name, job, first, _ in placed
    }


def run_jobs_in_fewest_launches(jobs: dict[str, Job]) -> dict[str, list]:
    """run_jobs_on_ranks for jobs whose sizes no one launch divides (3 and 4 ranks, say): a
    launch of the largest size runs every job whose size divides it, then the same for the
    jobs left, one launch after another. Returns each job's per-rank results."""
    results, left = {}, dict(jobs)
    while left:
        world_size = max(job.world_size for job in left.values())
        fitting = {name: job for name, job in left.items() if world_size % job.world_size == 0}
        results |= run_jobs_on_ranks(world_size, fitting)
        left = {name: job for name, job in left.items() if name not in fitting}
    return {name: results[name] for name in jobs}


def run_on_ranks(world_size: int, fn: Callable, *args) -> list:
    """Call fn(*args) on `world_size` ranks; returns the per-rank results, rank order."""
    return run_jobs_on_ranks(world_size, {fn.__name__: Job(world_size, fn, args)})[fn.__name__]
