"""How the benchmarks' spawned rank processes start and end: as torchrun's would, and as
titanlite's own ranks end (titanlite.parallel.exit_process)."""

import logging
import os
import socket
from typing import NoReturn

import torch

from titanlite.parallel import destroy_distributed, exit_process


def free_port() -> int:
    """A free local TCP port for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_environment(rank: int, world_size: int, port: int, **extra: str) -> None:
    """Set what torchrun gives a rank on one machine (RANK, WORLD_SIZE, MASTER_*, ...) and `extra`."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def keep_stager_between_saves() -> None:
    """Let a DefaultStager serve more than one save under a torch older than the project's pin.

    torch before 2.13 closes the stager's StateDictStager at the end of every staging,
    which empties its copy dispatch table and drops its cached pinned buffers, so the
    second save through the same stager (as CheckpointManager makes) fails with
    `KeyError: <class 'type'>`; 2.13 closes it only in DefaultStager.close(). The GPU
    machines lent to the project run their image's torch (2.11), not the pin, so the GPU
    scripts keep the table and the buffers to the end of the process, as 2.13 does."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13):
        StateDictStager.close = lambda self: None  # older torch only


def quiet_every_rank_lines() -> None:
    """Drop the start-up lines every rank prints about itself (LOG_RANK does not reach
    them), which would land above the table."""
    logging.getLogger("titanlite.every_rank").addFilter(lambda record: False)


def end_rank() -> NoReturn:
    """Leave the process group, if any, and end the process as train.py's ranks do."""
    destroy_distributed()
    exit_process(0)
