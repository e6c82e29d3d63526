"""How the benchmarks' spawned rank processes start and end: as torchrun's would, and as
titanlite's own ranks end (titanlite.parallel.exit_process)."""

import logging
import os
import socket
from typing import NoReturn

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


def quiet_every_rank_lines() -> None:
    """Drop the start-up lines every rank prints about itself (LOG_RANK does not reach
    them), which would land above the table."""
    logging.getLogger("titanlite.every_rank").addFilter(lambda record: False)


def end_rank() -> NoReturn:
    """Leave the process group, if any, and end the process as train.py's ranks do."""
    destroy_distributed()
    exit_process(0)
