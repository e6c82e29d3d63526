"""The NCCL flight recorder's set-up from comm.* (titanlite/parallel/flight_recorder.py) and
the collective-failure line that names its dump. No GPU needed: the variables are computed
and written into a dictionary standing in for the environment."""

import os

import pytest
import torch.distributed as dist

from titanlite import train
from titanlite.config import Comm
from titanlite.parallel.flight_recorder import dump_prefix, flight_recorder_env, start_flight_recorder


def test_the_config_becomes_pytorchs_variables():
    assert flight_recorder_env(Comm(), "/runs/a") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join("/runs/a", "comm_traces", "rank_"),
    }
    comm = Comm(trace_buf_size=64, save_traces_folder="fr", save_traces_file_prefix="host7_rank")
    env = flight_recorder_env(comm, "out")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.path.join("out", "fr", "host7_rank")


def test_starting_it_sets_the_variables_and_makes_the_folder(tmp_path):
    environ = {"PATH": "/bin"}
    prefix = start_flight_recorder(Comm(), str(tmp_path), environ)
    assert prefix == str(tmp_path / "comm_traces" / "rank_")
    assert (tmp_path / "comm_traces").is_dir()
    assert environ == {"PATH": "/bin", **flight_recorder_env(Comm(), str(tmp_path))}


def test_zero_turns_it_off_without_a_folder(tmp_path):
    environ: dict[str, str] = {}
    assert start_flight_recorder(Comm(trace_buf_size=0), str(tmp_path), environ) is None
    # PyTorch records 2000 events when the variable is unset, so off is said explicitly.
    assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert list(tmp_path.iterdir()) == []


def test_what_the_user_set_wins_under_either_spelling(tmp_path):
    mine = tmp_path / "mine" / "trace_"
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_FR_DUMP_TEMP_FILE": str(mine)}
    assert start_flight_recorder(Comm(), str(tmp_path), environ) == str(mine)
    # TORCH_FR_DUMP_TEMP_FILE is read before TORCH_NCCL_DEBUG_INFO_TEMP_FILE: setting the
    # latter would only mislead.
    assert environ == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
        "TORCH_FR_DUMP_TEMP_FILE": str(mine),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "comm_traces").exists()


@pytest.mark.parametrize(
    "users",
    [
        {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"},
        {"TORCH_FR_BUFFER_SIZE": "0"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "false"},
    ],
)
def test_the_user_turning_it_off_means_no_dump_and_no_folder(tmp_path, users):
    environ = dict(users)
    assert start_flight_recorder(Comm(), str(tmp_path), environ) is None
    assert all(environ[name] == value for name, value in users.items())
    assert not (tmp_path / "comm_traces").exists()


def test_the_dump_place_follows_pytorchs_order_of_names():
    both = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "10",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/a/rank_",
        "TORCH_FR_DUMP_TEMP_FILE": "/b/rank_",
    }
    assert dump_prefix(both) == "/b/rank_"
    assert dump_prefix({**both, "TORCH_FR_BUFFER_SIZE": "0"}) is None
    assert dump_prefix({}) is None


class FailingTrainer:
    """Stands in for the Trainer: built at once, its training ends in a peer's timeout."""

    flight_recorder_dump: str | None = None

    def __init__(self, job_config):
        self.rank, self.step = 3, 7

    def train(self):
        raise dist.DistBackendError("NCCL watchdog: collective ALLREDUCE timed out after 100000 ms\nmore detail")


@pytest.mark.parametrize("dump", [None, "/runs/a/comm_traces/rank_3"])
def test_the_failure_line_names_the_dump_when_there_is_one(monkeypatch, capsys, dump):
    monkeypatch.setattr(FailingTrainer, "flight_recorder_dump", dump)
    monkeypatch.setattr(train, "Trainer", FailingTrainer)
    assert train.main([]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    start = (
        "titanlite: rank 3: a collective failed after step 7 (did another rank die or hang? see its log): "
        "NCCL watchdog: collective ALLREDUCE timed out after 100000 ms"
    )
    assert line == (start if dump is None else f"{start}; NCCL flight recorder dump: {dump}")
