"""Fault tolerance through torchft: replica groups as real rank processes, a real lighthouse.

- Two groups x FSDP 2 equal HSDP 2 x 2 at every step, and a full restart of both groups
  resumes as the uninterrupted HSDP run goes on; likewise an MoE model with its experts
  split over ep 2 inside each group and the expert bias trained.
- One group SIGKILLed mid-run: the other trains on, its steps fast again; the restarted
  group heals from it (not from the checkpoint folder), with equal states at the first step
  they share. Then the lighthouse is SIGKILLed: every group stops with one line.
- Bad input: one line, exit status 2, nothing written.
"""

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.faults.harness import read_losses
from tests.forked_scripts import kill_group, start_python
from tests.helpers import rendezvous_env, tiny_args
from tests.s3_server import BUCKET, s3_server
from titanlite import train
from titanlite.checkpoint.load import load_model
from titanlite.metrics import tags

# What every rank runs: the trainer, plus two test hooks inside the process (production code
# has none): FT_TEST_PAUSE seconds of sleep at each quorum, so that a restart overlaps training,
# and FT_TEST_DUMP, a folder that receives this rank's states (as sent to a healing peer)
# whenever its group heals or sees the quorum grow, and the data position at every step.
LAUNCHER = """
import os, sys, time, torch
from titanlite import train
from titanlite.parallel import exit_process
from titanlite.parallel.fault_tolerance import ReplicaGroups
pause, dump = float(os.environ.get("FT_TEST_PAUSE", "0")), os.environ.get("FT_TEST_DUMP")
start_step = ReplicaGroups.start_step
def start_step_and_dump(self, step):
    before = self.participants
    healed = start_step(self, step)
    time.sleep(pause)
    if dump and (healed or 0 < before < self.participants):
        name = f"g{self.section.replica_id}-r{os.environ.get('RANK', '0')}-step{self.manager.current_step()}.pt"
        torch.save(self.states_for_peer(), os.path.join(dump, name))
    return healed
ReplicaGroups.start_step = start_step_and_dump
train_step = train.Trainer.train_step
def train_step_and_record_the_data_position(self):
    if dump:
        name = f"positions-g{self.job_config.fault_tolerance.replica_id}-r{os.environ.get('RANK', '0')}.txt"
        with open(os.path.join(dump, name), "a") as record:
            record.write(f"{self.step} {self.loader.windows_consumed}\\n")
    return train_step(self)
train.Trainer.train_step = train_step_and_record_the_data_position
exit_process(train.main(sys.argv[1:]))
"""

LISTENING = re.compile(r"listening on: http://[^:\s]+:(\d+)")


def start_lighthouse(folder: Path) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse as users start it, on a port the kernel picks; (process, address)."""
    script = Path(sys.executable).parent / "torchft_lighthouse"
    command = [str(script) if script.exists() else shutil.which("torchft_lighthouse")]
    # A dead group is dropped after 2 s of silence (5 s by default).
    command += ["--min_replicas", "1", "--bind", "[::]:0", "--join_timeout_ms", "500"]
    command += ["--heartbeat_timeout_ms", "2000", "--quorum_tick_ms", "50"]
    log = folder / "lighthouse.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = LISTENING.search(log.read_text())
        if match:
            return process, f"http://127.0.0.1:{match.group(1)}"
        assert process.poll() is None, log.read_text()
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"the lighthouse did not start: {log.read_text()}")


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory):
    process, address = start_lighthouse(tmp_path_factory.mktemp("lighthouse"))
    yield address
    process.kill()
    process.wait()


class Group:
    """One replica group (or a plain run): its ranks as processes, as torchrun would start them."""

    def __init__(self, name: str, folder: Path, args: list[str], ranks: int, env: dict[str, str]):
        self.name, self.folder = name, folder
        self.logs = [folder / f"{name}-rank{rank}.log" for rank in range(ranks)]
        store = rendezvous_env()
        self.processes = []
        for rank in range(ranks):
            rank_env = {**os.environ, **env, **store, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            rank_env.update({"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1"})
            args_ = ["-c", LAUNCHER, *args]
            self.processes.append(start_python(args_, env=rank_env, stdout=self.logs[rank], stderr=None))

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        if any(process.exitcode is None for process in self.processes):
            self.kill()
            raise AssertionError(f"{self.name} did not finish:\n{self.log()[-3000:]}")
        return [process.exitcode for process in self.processes]

    def kill(self) -> None:
        for process in self.processes:  # SIGKILL every rank before joining any
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.processes:
            kill_group(process)

    def log(self) -> str:
        return self.logs[0].read_text()

    def running(self) -> bool:
        return all(process.exitcode is None for process in self.processes)

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(rf"step: +{step} ", self.log()):
            assert time.monotonic() < deadline and self.running(), self.log()
            time.sleep(0.05)


# docs/reliability.md's way to kill one replica group outright: torchrun starts every rank in
# a session of its own, so its ranks are listed first, then torchrun and each rank's process
# group (a rank's own children, an asynchronous checkpoint writer, are in it) are SIGKILLed.
KILL_ONE_GROUP = 'ranks=$(pgrep -P "$PID"); kill -KILL "$PID"; for rank in $ranks; do kill -KILL -- "-$rank"; done'


class TorchrunGroup(Group):
    """A replica group as run_train.sh starts one: torchrun and the ranks it starts."""

    def __init__(self, name: str, folder: Path, args: list[str], ranks: int, env: dict[str, str]):
        self.name, self.folder = name, folder
        self.logs = [folder / f"{name}.log"]  # torchrun's and rank 0's lines (LOG_RANK 0)
        launcher = folder / f"{name}_launcher.py"
        launcher.write_text(LAUNCHER)
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
        command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", str(launcher), *args]
        with self.logs[0].open("w") as out:
            self.torchrun = subprocess.Popen(
                command, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT
            )

    def running(self) -> bool:
        return self.torchrun.poll() is None

    def kill(self) -> None:
        ranks = subprocess.run(["pgrep", "-P", str(self.torchrun.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2, ranks
        subprocess.run(["bash", "-c", KILL_ONE_GROUP], env={**os.environ, "PID": str(self.torchrun.pid)}, check=True)
        self.torchrun.wait()
        deadline = time.monotonic() + 30
        for rank in map(int, ranks):  # gone, not merely orphaned (the init process reaps them)
            while Path(f"/proc/{rank}").exists() and "Z" not in _process_state(rank):
                assert time.monotonic() < deadline, f"rank {rank} of {self.name} outlived the kill"
                time.sleep(0.05)


def _process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "Z"


def run_args(dump_folder: Path, steps: int, overrides: dict | None = None) -> list[str]:
    return tiny_args(
        {
            "training.steps": steps,
            "training.global_batch_size": 8,  # 4 data-parallel ranks of 2 sequences
            "checkpoint.enable": True,
            "checkpoint.interval": 2,
            "job.dump_folder": dump_folder,
            "comm.train_timeout_seconds": 30,
            "comm.init_timeout_seconds": 120,
            **(overrides or {}),
        }
    )


def ft_args(dump_folder: Path, steps: int, group: int, overrides: dict | None = None) -> list[str]:
    ft = {"fault_tolerance.enable": True, "fault_tolerance.group_size": 2, "fault_tolerance.replica_id": group}
    return run_args(dump_folder, steps, {**ft, **(overrides or {})})


def start_groups(folder: Path, lighthouse: str, steps: int, overrides=None, ranks=2, name="run", env=None):
    env = {"TORCHFT_LIGHTHOUSE": lighthouse, **(env or {})}
    return [Group(f"{name}-g{g}", folder, ft_args(folder / "dump", steps, g, overrides), ranks, env) for g in range(2)]


def metrics_of(dump_folder: Path, group: int | None) -> dict[int, dict]:
    """step -> the logged record of `group` (its runs' metrics.jsonl, later runs last; None:
    a run without fault tolerance)."""
    records = {}
    pattern = "*" if group is None else f"*_group{group}"
    for path in sorted((dump_folder / "metrics").glob(f"{pattern}/metrics.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["step"]] = record
    return records


def test_two_groups_equal_hsdp_and_a_full_restart_resumes(tmp_path, lighthouse):
    hsdp = Group(
        "hsdp",
        tmp_path,
        run_args(tmp_path / "hsdp", 6, {"parallelism.data_parallel_replicate_degree": 2}),
        ranks=4,
        env={},
    )
    assert hsdp.wait() == [0] * 4, hsdp.log()
    # The groups share one prefix of a bucket (a real S3 server) as they would share a folder.
    with s3_server():
        bucket = {"checkpoint.folder": f"s3://{BUCKET}/ft"}
        groups = start_groups(tmp_path, lighthouse, steps=4, overrides=bucket)
        assert [group.wait() for group in groups] == [[0, 0]] * 2, groups[0].log() + groups[1].log()
        # Every group restarts: both load the newest checkpoint (the first group's) and go on.
        groups = start_groups(tmp_path, lighthouse, steps=6, overrides=bucket, name="restart")
        assert [group.wait() for group in groups] == [[0, 0]] * 2, groups[0].log() + groups[1].log()
        for group in groups:
            assert re.search(rf"loaded checkpoint s3://{BUCKET}/ft/step-4 ", group.log()), group.log()
        ours, _ = load_model(f"s3://{BUCKET}/ft/step-6")

    reference = read_losses(tmp_path / "hsdp")
    assert sorted(reference) == list(range(1, 7))
    for g in range(2):
        losses = {step: record[tags.LOSS] for step, record in metrics_of(tmp_path / "dump", g).items()}
        assert sorted(losses) == list(range(1, 7))
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, abs=1e-5), (g, step, losses, reference)
        assert all(record[tags.FT_GROUPS] == 2 for record in metrics_of(tmp_path / "dump", g).values())
    theirs, _ = load_model(tmp_path / "hsdp" / "checkpoint" / "step-6")
    for (name, mine), (_, other) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        torch.testing.assert_close(mine, other, atol=1e-5, rtol=0, msg=name)


def test_moe_groups_under_expert_parallelism_equal_hsdp(tmp_path, lighthouse):
    """An inner layout with experts split over ep 2, and the expert bias on: the routed
    counts are summed over the groups, so both groups' biases and losses stay the HSDP run's."""
    moe = {"model.name": "qwen3", "model.flavor": "tiny_moe", "model.moe_bias_update_rate": 0.001}
    moe |= {"parallelism.expert_parallel_degree": 2, "checkpoint.interval": 3}
    hsdp_args = run_args(tmp_path / "hsdp", 3, {**moe, "parallelism.data_parallel_replicate_degree": 2})
    hsdp = Group("hsdp", tmp_path, hsdp_args, ranks=4, env={})
    assert hsdp.wait() == [0] * 4, hsdp.log()
    groups = start_groups(tmp_path, lighthouse, steps=3, overrides=moe)
    assert [group.wait() for group in groups] == [[0, 0]] * 2, groups[0].log() + groups[1].log()
    reference = metrics_of(tmp_path / "hsdp", None)
    for g in range(2):
        records = metrics_of(tmp_path / "dump", g)
        assert sorted(records) == sorted(reference) == [1, 2, 3]
        for step, expected in reference.items():
            # The load is max / mean of the routed counts: over all four data-parallel ranks
            # only if each group's counts were summed with the other's.
            for tag in (tags.LOSS, tags.MOE_MAX_LOAD):
                assert records[step][tag] == pytest.approx(expected[tag], abs=1e-5), (g, step, tag)
    ours, _ = load_model(tmp_path / "dump" / "checkpoint" / "step-3")
    theirs, _ = load_model(tmp_path / "hsdp" / "checkpoint" / "step-3")
    biases = [name for name in theirs.state_dict() if name.endswith("expert_bias")]
    assert biases and theirs.state_dict()[biases[0]].abs().sum() > 0  # the bias did train
    for (name, mine), (_, other) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        torch.testing.assert_close(mine, other, atol=1e-5, rtol=0, msg=name)


def _states_equal(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _states_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _states_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif where.endswith(".heals"):
        assert b == a + 1, where  # the healed group counts its heal
    else:
        assert a == b, where


def test_a_killed_group_drops_out_heals_and_a_dead_lighthouse_stops_both(tmp_path):
    """One launch, three faults in turn: group 1, a torchrun of two ranks, killed outright as
    docs/reliability.md shows (group 0 trains on alone), group 1 restarted (it heals from
    group 0), then the lighthouse SIGKILLed (both stop with one line)."""
    process, lighthouse = start_lighthouse(tmp_path)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    # A quorum without the lighthouse gives up after comm.train_timeout_seconds.
    overrides = {"ema.enable": True, "checkpoint.interval": 5, "comm.train_timeout_seconds": 10}
    env = {"FT_TEST_PAUSE": "0.15", "FT_TEST_DUMP": str(dumps)}
    try:
        group_env = {"TORCHFT_LIGHTHOUSE": lighthouse, **env}
        survivor = Group("run-g0", tmp_path, ft_args(tmp_path / "dump", 1000, 0, overrides), 2, group_env)
        doomed = TorchrunGroup("run-g1", tmp_path, ft_args(tmp_path / "dump", 1000, 1, overrides), 2, group_env)
        doomed.wait_for_step(6)
        doomed.kill()
        killed_after = int(re.findall(r"step: +(\d+) ", survivor.log())[-1])
        survivor.wait_for_step(killed_after + 3)  # alone: the survivor went on without a restart
        assert list((tmp_path / "dump" / "checkpoint").glob("step-*")), "the survivor saved nothing yet"
        args = ft_args(tmp_path / "dump", 1000, 1, overrides)
        restarted = Group("restarted-g1", tmp_path, args, 2, {"TORCHFT_LIGHTHOUSE": lighthouse, **env})
        healed = None
        while healed is None:
            assert restarted.processes[0].exitcode is None, restarted.log()
            healed = re.search(r"healed from a live group at step (\d+)", restarted.log())
            time.sleep(0.05)
        first_shared = int(healed.group(1))
        restarted.wait_for_step(first_shared + 4)
    finally:
        process.kill()
        process.wait()
    for group in (survivor, restarted):  # the lighthouse is gone: every group stops, one line each
        assert group.wait(timeout=120) == [1, 1], group.log()[-3000:]
        last = group.log().strip().splitlines()[-1]
        assert last.startswith("titanlite: fault tolerance: no quorum before step "), group.log()[-2000:]
        assert "does not answer" in last and lighthouse in last, last

    assert "loaded checkpoint" not in restarted.log()  # from the peer's memory, not the folder
    for rank in range(2):
        ours = torch.load(dumps / f"g0-r{rank}-step{first_shared}.pt", weights_only=False)
        theirs = torch.load(dumps / f"g1-r{rank}-step{first_shared}.pt", weights_only=False)
        assert {"model", "optimizer", "ema", "train_state"} <= set(ours)
        _states_equal(ours, theirs)

    # The data position is the step's, in both groups, the healed one from its first step on.
    for positions in dumps.glob("positions-*.txt"):
        seen = [tuple(map(int, line.split())) for line in positions.read_text().splitlines()]
        assert seen and all(windows == 8 * step for step, windows in seen), (positions.name, seen)
    first_after_heal = dumps / "positions-g1-r0.txt"
    assert any(
        step == first_shared
        for step, _ in (map(int, line.split()) for line in first_after_heal.read_text().splitlines())
    )

    records = metrics_of(tmp_path / "dump", 0)
    alone = [step for step, record in records.items() if record[tags.FT_GROUPS] == 1]
    assert alone and min(alone) > 6 and max(alone) < first_shared + 1, alone
    shared = first_shared + 4
    assert records[shared][tags.FT_SKIPPED] == 4 * len(alone)  # each step alone skipped the other group's 4 windows
    assert metrics_of(tmp_path / "dump", 1)[shared][tags.LOSS] == records[shared][tags.LOSS]
    # Step times: the step that found the group dead waits for the lighthouse to drop it; a
    # few steps later they are back to what they were before.
    times = {step: record[tags.STEP_TIME] for step, record in records.items()}
    before = statistics.median(times[step] for step in range(2, 7))
    after = statistics.median(times[step] for step in alone[2:5])
    assert after < 3 * before + 0.2, (before, after, times)


def _last_error_line(group: Group) -> str:
    return group.log().strip().splitlines()[-1]


def test_groups_of_different_layouts_stop_at_their_first_quorum_with_one_line(tmp_path, lighthouse):
    """2 ranks against 1 (FSDP 2 against one process): each group names the degree that
    differs and both values, exit status 2 on every rank, in well under a minute; nothing
    is trained and no step is retried."""
    started = time.monotonic()
    groups = [
        Group(f"g{g}", tmp_path, ft_args(tmp_path / "dump", 4, g), ranks, {"TORCHFT_LIGHTHOUSE": lighthouse})
        for g, ranks in ((0, 2), (1, 1))
    ]
    statuses = [group.wait(timeout=60) for group in groups]
    assert time.monotonic() - started < 60
    assert statuses == [[2, 2], [2]], groups[0].log() + groups[1].log()
    for group, (mine, theirs, other) in zip(groups, ((2, 1, 1), (1, 2, 0)), strict=True):
        expected = (
            "titanlite: config error: replica groups disagree on parallelism.data_parallel_shard_degree: "
            f"{mine} here, {theirs} in group {other}"
        )
        log = group.log()
        assert _last_error_line(group).startswith(expected), log
        assert log.count("disagree") == 1 and "Traceback" not in log and "not committed" not in log, log
        assert not re.search(r"step: +1 ", log), log
    assert "disagree" not in groups[0].logs[1].read_text()  # rank 1 stops without a line of its own


def test_a_step_that_never_commits_stops_the_run_with_one_line(tmp_path, lighthouse):
    """min_replica_size 2 with one group alive: every try of step 1 fails to commit; after
    comm.init_timeout_seconds of tries the group stops with one line, exit status 1."""
    overrides = {"fault_tolerance.min_replica_size": 2, "comm.init_timeout_seconds": 3}
    group = Group("alone", tmp_path, ft_args(tmp_path / "dump", 4, 0, overrides), 1, {"TORCHFT_LIGHTHOUSE": lighthouse})
    assert group.wait(timeout=60) == [1], group.log()
    line = _last_error_line(group)
    assert line.startswith("titanlite: fault tolerance: step 1 not committed in "), group.log()
    assert "fewer than min_replica_size 2" in line and "comm.init_timeout_seconds (3 s)" in line, line
    assert group.log().count("not committed (try ") < 5, group.log()  # not a line per try


@pytest.mark.parametrize(
    "setting, lighthouse_address, expected",
    [
        ({"fault_tolerance.replica_id": 2}, None, "fault_tolerance.replica_id must lie in [0, 2)"),
        ({}, "http://127.0.0.1:{closed}", "does not answer"),
        ({}, "", "needs the lighthouse's address in TORCHFT_LIGHTHOUSE"),
        ({"fault_tolerance.semi_sync_method": "diloco"}, None, "has no DiLoCo"),
        ({"fault_tolerance.process_group": "nccl"}, None, "'nccl' needs CUDA GPUs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(setting, lighthouse_address, expected, tmp_path, monkeypatch, capsys):
    closed = _closed_port()
    if lighthouse_address is not None:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse_address.format(closed=closed))
    assert train.main(ft_args(tmp_path / "dump", 4, 0, setting)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "dump").exists()


def test_torchft_missing_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    assert train.main(ft_args(tmp_path / "dump", 4, 0)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs torchft" in err[0] and "titanlite[ft]" in err[0], err
    assert not (tmp_path / "dump").exists()


def test_run_train_with_ft_groups_and_no_torchft_is_one_line_and_exit_2(tmp_path):
    """FT_GROUPS without torchft: the launcher names the ft extra before it starts anything
    (a torchft package that fails to import stands in for a missing one)."""
    shadow = tmp_path / "shadow" / "torchft"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named torchft')\n")
    env = {key: value for key, value in os.environ.items() if key not in ("TORCHFT_LIGHTHOUSE", "NGPU")}
    env |= {"FT_GROUPS": "2", "NGPU": "2", "PYTHONPATH": str(tmp_path / "shadow"), "PYTHON": sys.executable}
    result = subprocess.run(
        [str(Path(__file__).resolve().parent.parent / "run_train.sh"), "--training.steps", "1"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "FT_GROUPS needs torchft" in lines[0], result.stderr
    assert "pip install 'titanlite[ft]'" in lines[0], lines
    assert "lighthouse" not in result.stdout, result.stdout


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
