"""A rank that hangs after the first step: the others give up within
comm.train_timeout_seconds with one clear line, instead of waiting forever. Under HSDP
the others wait in the mesh's own groups (shard and replicate), not the default one. A rank
that hangs inside a checkpoint save holds the others in the checkpoint's own group, which
gives up after comm.init_timeout_seconds."""

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tests.forked_scripts import start_python
from tests.helpers import rendezvous_env, tiny_args

REPO = Path(__file__).resolve().parents[2]
# Every rank runs the real entry point; rank 1 stops answering during step 3, after noting
# the time it stopped in the dump folder. A rank whose main() returns notes the time it
# ended there too: a test may look only after the fact (its job started with the others).
LAUNCHER = """
import os, sys, time
from pathlib import Path
from titanlite import train
from titanlite.checkpoint import CheckpointManager
from titanlite.parallel import exit_process
def hang(dump_folder):
    mark = Path(dump_folder, ".hang-started")
    mark.write_text(str(time.time()))
    mark.rename(mark.with_name("hang-started"))  # whole, for the test polling it
    time.sleep(600)
step = train.Trainer.train_step
def hang_in_step(self):
    if os.environ["RANK"] == "1" and self.step == 2:
        hang(self.job_config.job.dump_folder)
    return step(self)
save = CheckpointManager.save
def hang_in_save(self, step, *args, **kwargs):
    if os.environ["RANK"] == "1" and step == 2:
        hang(self.folder.parent)
    return save(self, step, *args, **kwargs)
if os.environ["HANG_IN"] == "save":
    CheckpointManager.save = hang_in_save
else:
    train.Trainer.train_step = hang_in_step
status = train.main(sys.argv[1:])
dump_folder = sys.argv[sys.argv.index("--job.dump_folder") + 1]
Path(dump_folder, f"rank{os.environ['RANK']}-ended").write_text(str(time.time()))
exit_process(status)
"""
TRAIN_TIMEOUT = 5
ARGS = tiny_args({"training.steps": 6, "metrics.log_freq": None, "comm.train_timeout_seconds": TRAIN_TIMEOUT})
# Layout -> (world size, extra arguments).
LAYOUTS = {
    "fsdp2": (2, []),
    "hsdp2x2": (
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    ),
}
# Start-up of the ranks, before the hang, may be slow on a busy machine.
START_LIMIT = 240
# After the hang: the train timeout, then the failing rank's exit, on a 2-core machine
# shared with other jobs. PyTorch's default timeout, which the ranks would otherwise
# wait out, is 30 minutes.
SLACK = 40


def launch(rank: int, env: dict[str, str], args: list[str], logs: Path) -> multiprocessing.Process:
    """One rank, as torchrun starts it (forked from the fork server: tests/forked_scripts.py); its
    output goes to files."""
    return start_python(
        ["-c", LAUNCHER, *args],
        cwd=REPO,
        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        stdout=logs / f"rank{rank}.out",
        stderr=logs / f"rank{rank}.err",
    )


def wait_for_hang(mark: Path, ranks: list[multiprocessing.Process], logs: Path) -> float:
    """The time the stuck rank stopped answering, once it has."""
    deadline = time.monotonic() + START_LIMIT
    while not mark.exists():
        failed = [rank for rank, process in enumerate(ranks) if process.exitcode is not None]
        assert not failed, f"rank(s) {failed} ended before the hang: {(logs / f'rank{failed[0]}.err').read_text()}"
        assert time.monotonic() < deadline, "no rank reached the hang"
        time.sleep(0.2)
    return float(mark.read_text())


def ends_by(process: multiprocessing.Process, deadline: float) -> bool:
    """Whether ``process`` has ended by the wall-clock time ``deadline``."""
    process.join(timeout=max(1.0, deadline - time.time()))
    return process.exitcode is not None


def start_ranks(tmp_path: Path, world_size: int, args: list[str], hang_in: str):
    env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        **rendezvous_env(),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HANG_IN": hang_in,
    }
    dump_folder, logs = tmp_path / "dump", tmp_path / "logs"
    logs.mkdir()
    dump_folder.mkdir()
    args = [*args, "--job.dump_folder", str(dump_folder)]
    return [launch(rank, env, args, logs) for rank in range(world_size)], dump_folder, logs


def others_give_up(ranks, dump_folder: Path, logs: Path, limit: float) -> list[str]:
    """Wait for the hang; check that every rank but the stuck one ended with status 1 within
    ``limit`` seconds of it, and return their one titanlite line each."""
    hang_started = wait_for_hang(dump_folder / "hang-started", ranks, logs)
    lines = []
    for rank in (rank for rank in range(len(ranks)) if rank != 1):
        ended = ends_by(ranks[rank], hang_started + limit + SLACK)
        assert ended, f"rank {rank} still waits {time.time() - hang_started:.0f} s after rank 1 stopped"
        stderr = (logs / f"rank{rank}.err").read_text()
        assert ranks[rank].exitcode == 1, stderr
        gave_up_after = float((dump_folder / f"rank{rank}-ended").read_text()) - hang_started
        print(f"rank {rank} gave up {gave_up_after:.1f} s after rank 1 stopped")
        assert gave_up_after <= limit + SLACK, f"rank {rank} gave up only {gave_up_after:.0f} s after rank 1 stopped"
        errors = [line for line in stderr.splitlines() if line.startswith("titanlite:")]
        assert len(errors) == 1, stderr
        lines.append(errors[0])
    assert ranks[1].exitcode is None  # the stuck rank is still stuck: the others did not wait for it
    return lines


# The checkpoint group's collectives wait for the slowest writer, so it keeps the start-up
# timeout; long enough for start-up on a busy machine, far below PyTorch's 30 minutes.
INIT_TIMEOUT = 15
SAVE_HANG_ARGS = [*ARGS, "--checkpoint.enable", "--checkpoint.interval", "2"]
SAVE_HANG_ARGS += ["--comm.init_timeout_seconds", str(INIT_TIMEOUT)]


@pytest.fixture(scope="module")
def stuck_jobs(tmp_path_factory):
    """Every job of the module, started at once: each test waits out a timeout (5 s, 5 s, 15 s)
    with its ranks mostly idle, so the waits overlap instead of adding up. The jobs do not
    share a process group or a folder; each test checks its own. name -> (ranks, dump, logs)."""
    jobs = {
        # The longest wait first: its ranks start before the machine fills up.
        "save": (2, SAVE_HANG_ARGS, "save"),
        **{layout: (size, [*ARGS, *layout_args], "step") for layout, (size, layout_args) in LAYOUTS.items()},
    }
    started = {}
    try:
        for name, (world_size, args, hang_in) in jobs.items():
            started[name] = start_ranks(tmp_path_factory.mktemp(name), world_size, args, hang_in)
        yield started
    finally:
        for ranks, _, _ in started.values():
            for process in ranks:
                process.kill()
                process.join()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stuck_rank_fails_the_others_within_the_train_timeout(stuck_jobs, layout):
    ranks, dump_folder, logs = stuck_jobs[layout]
    for line in others_give_up(ranks, dump_folder, logs, TRAIN_TIMEOUT):
        assert line.startswith("titanlite: rank "), line
        assert ": a collective failed after step 2 (did another rank die or hang?" in line, line
        assert "flight recorder" not in line  # gloo: no NCCL recorder, and no folder for it
    assert not (dump_folder / "comm_traces").exists()


def test_a_rank_stuck_in_a_save_fails_the_others_within_the_init_timeout(stuck_jobs):
    ranks, dump_folder, logs = stuck_jobs["save"]
    [line] = others_give_up(ranks, dump_folder, logs, INIT_TIMEOUT)
    assert line.startswith("titanlite: "), line
    assert ": a collective failed after step 2 (did another rank die or hang?" in line, line
    assert not (dump_folder / "checkpoint" / "step-2").exists()
