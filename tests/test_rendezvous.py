"""How the tests' rank processes meet: at a store this process hosts, whose port nothing else
can take between the moment it is chosen and the moment the ranks use it."""

import errno
import os
import socket

import torch
import torch.distributed as dist

from tests.helpers import free_ports
from tests.rank_jobs import run_on_ranks


def port_is_taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as error:
            assert error.errno == errno.EADDRINUSE, error
            return True
        return False


def groups_in_turn(ports: list[int]) -> tuple[list[float], int]:
    """A default process group on each port in turn (as a resume test rebuilds its trainers),
    each summing the ranks' numbers; and the port run_on_ranks gave this launch."""
    sums = []
    launch_port = int(os.environ["MASTER_PORT"])
    for port in ports:
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo")
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        sums.append(value.item())
        dist.destroy_process_group()
    return sums, launch_port


def test_ports_stay_taken_from_their_choice_until_the_session_ends():
    ports = free_ports(2)
    # Minutes may pass before the ranks bind a port that is merely free; these are held.
    assert [port_is_taken(port) for port in ports] == [True, True]

    results = run_on_ranks(2, groups_in_turn, ports)

    assert [sums for sums, _ in results] == [[3.0, 3.0], [3.0, 3.0]]
    launch_port = results[0][1]
    assert results[1][1] == launch_port
    # run_on_ranks's own port was held by this process, not by a rank that has now exited.
    assert port_is_taken(launch_port)
    assert launch_port not in ports
