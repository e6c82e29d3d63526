"""Process-group start-up and shut-down, the choice of device, and the end of a rank process."""

import atexit
import os
import sys
import threading
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanlite.config import Comm
from titanlite.parallel.flight_recorder import start_flight_recorder
from titanlite.parallel.parallel_dims import all_groups


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when started without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device() -> torch.device:
    """CUDA (this process's local GPU) when there is one, otherwise the CPU."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # cuda-only
    return device


def init_distributed(device: torch.device, comm: Comm, dump_folder: str) -> str | None:
    """Join the process group when launched with more than one rank: NCCL for GPUs,
    gloo for CPUs (and for CPU tensors on GPU machines, which checkpointing uses).

    Return the file this rank's NCCL flight recorder writes when a collective times out,
    or None (one rank, CPUs, or the recorder off)."""
    if world_size_from_env() == 1:
        return None
    cuda = device.type == "cuda"
    dump_prefix = start_flight_recorder(comm, dump_folder) if cuda else None  # NCCL reads it at start-up
    dist.init_process_group(
        backend="cuda:nccl,cpu:gloo" if cuda else "gloo",
        timeout=timedelta(seconds=comm.init_timeout_seconds),
        device_id=device if cuda else None,
    )
    return None if dump_prefix is None else f"{dump_prefix}{dist.get_rank()}"


def use_collective_timeout(mesh: DeviceMesh | None, seconds: int) -> None:
    """Give every group the training talks over, the default one and each of ``mesh``'s (its
    expert view's included), this timeout for the collectives started from now on. Other
    groups (the checkpoint manager's) keep theirs."""
    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=seconds)
    # FSDP's mesh group is the default group itself; setting it twice changes nothing.
    for group in [dist.group.WORLD, *all_groups(mesh)]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


# How a peer's death or a timeout shows up: DistError subclasses from c10d and NCCL, but
# plain RuntimeErrors from gloo's transport.
_COLLECTIVE_FAILURE_MARKS = (
    "gloo",
    "NCCL",
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset",
    "pair closure",
)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` says that a collective failed: a peer died, hung or was unreachable."""
    return isinstance(error, dist.DistError) or any(mark in str(error) for mark in _COLLECTIVE_FAILURE_MARKS)


def gather_from_every_rank(value, group=None) -> list:
    """Every rank's ``value`` in rank order, on every rank (``[value]`` without a process
    group). ``group`` None is the default group."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def first_error_on_any_rank(error: str | None, group=None, name_rank: bool = False) -> str | None:
    """Gather every rank's error message (None: no error) and return the lowest rank's, the
    same on every rank, so that all ranks fail together instead of some waiting for the others.
    With ``name_rank``, a message from another rank ends with "(on rank N)"."""
    for rank, message in enumerate(gather_from_every_rank(error, group)):
        if message is None:
            continue
        if name_rank and rank != dist.get_rank(group):
            return f"{message} (on rank {rank})"
        return message
    return None


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End this rank process with ``status`` without the interpreter's final teardown.

    Gloo runs collectives on worker threads of its own, and destroy_process_group does not
    stop them. Such a thread may still be dropping its reference to the last collective's
    tensors when the main thread returns; that needs the GIL, and a thread that asks for
    the GIL while the interpreter finalizes is ended inside a C++ destructor, which aborts
    the whole process ("terminate called without an active exception", SIGABRT). A run
    that finished would be reported as crashed. So everything normally done at exit is
    done here while the interpreter is intact, in the interpreter's own order: running
    threads are let finish (threading's shutdown hook, which also stops idle
    concurrent.futures workers), then the atexit handlers run (logging's flush,
    multiprocessing's reaping of DCP's checkpoint writer process, ...), then the standard
    streams are flushed and the process ends.
    """
    try:
        join_threads = getattr(threading, "_shutdown", None)  # what Python's exit calls first
        if join_threads is not None:
            join_threads()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken pipe: nothing left to save
                pass
        os._exit(status)
