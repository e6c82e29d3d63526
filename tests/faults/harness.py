"""Kill a multi-rank CPU training run at a chosen moment, restart it, and check the resume.

A trial (run_trial) does what a crash and a scheduler's restart do to a real job:

1. It starts WORLD_SIZE rank processes (RANK / WORLD_SIZE / MASTER_* in the environment,
   as torchrun would), each running LAUNCHER: install one fault point (install_fault) by
   monkeypatching inside that process, then call the real entry point
   titanlite.train.main(argv). Production code has no test hooks.
2. When the fault point is reached on the chosen rank (or on every rank), that process
   writes what the checkpoint folder held (fault-fired-rank<R>.json) and SIGKILLs itself.
   As soon as any rank is gone the harness SIGKILLs the whole job, every rank's process
   group included (DCP's writer processes of async_with_pinned_mem live there), the way
   torchrun tears a job down when one worker dies.
3. It lists the checkpoint folder, loads every published step-N folder's weights with
   titanlite.checkpoint.load.load_model, restarts the job without faults to the last step
   and compares what it resumed from and the losses it logged with an uninterrupted run.

The fault points (FAULT_POINTS) and the checks are described in docs/reliability.md;
tests/faults/test_kill_resume.py runs one trial per fault point, and
`python -m tests.faults.chaos` many random ones.
"""

import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from tests.forked_scripts import start_python
from tests.helpers import rendezvous_env, tiny_args
from titanlite import train
from titanlite.checkpoint import manager
from titanlite.checkpoint.load import load_model
from titanlite.config import parse_args

REPO = Path(__file__).resolve().parents[2]
FAULT_ENV = "TITANLITE_TEST_FAULT"
FAULT_POINTS = ("step", "staging", "write", "rename", "purge")
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
LOSS = "loss_metrics/global_avg_loss"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.step-\d+\.(partial|deleting)$")
_LOADED = re.compile(r"loaded checkpoint (\S+) \(")

# What every rank process runs. The fault (if any) comes as JSON in FAULT_ENV.
LAUNCHER = f"""
import os, sys
from tests.faults import harness
from titanlite import train
from titanlite.parallel import exit_process
if os.environ.get({FAULT_ENV!r}):
    harness.install_fault(harness.Fault.from_json(os.environ[{FAULT_ENV!r}]))
exit_process(train.main(sys.argv[1:]))
"""


@dataclass(frozen=True)
class RunConfig:
    """The training run a trial kills: small enough for a few seconds per job."""

    steps: int = 8
    interval: int = 2
    keep_latest_k: int = 2
    async_mode: str = "disabled"
    world_size: int = 2

    def args(self, dump_folder: Path) -> list[str]:
        return tiny_args(
            {
                "training.steps": self.steps,
                "checkpoint.enable": True,
                "checkpoint.interval": self.interval,
                "checkpoint.keep_latest_k": self.keep_latest_k,
                "checkpoint.async_mode": self.async_mode,
                "comm.train_timeout_seconds": 5,
                "comm.init_timeout_seconds": 60,
                "job.dump_folder": dump_folder,
            }
        )

    @property
    def saves(self) -> list[int]:
        """The steps a run saves at: every interval, and the last step."""
        return sorted({*range(self.interval, self.steps + 1, self.interval), self.steps})

    @property
    def purged(self) -> list[int]:
        """The checkpoints an uninterrupted run deletes (keep_latest_k), oldest first."""
        return self.saves[: -self.keep_latest_k] if self.keep_latest_k else []

    def fault_steps(self, point: str) -> list[int]:
        """The steps at which `point` can fire in this run."""
        if point == "step":
            return list(range(1, self.steps + 1))
        if point == "staging":  # only the async saves stage; the last save is synchronous
            return [] if self.async_mode == "disabled" else [s for s in self.saves if s != self.steps]
        if point in ("write", "rename"):
            return self.saves
        if point == "purge":
            return self.purged
        raise ValueError(f"unknown fault point {point!r}; expected one of {', '.join(FAULT_POINTS)}")


@dataclass(frozen=True)
class Fault:
    """Where to SIGKILL the job.

    step: kill on entry to Trainer.train_step for training step `step` (1-based).
    staging: kill while the async save of checkpoint step-`step` copies the state
        (FileSystemWriter.stage for async, DefaultStager._stage for async_with_pinned_mem).
    write: kill once this rank's data files of step-`step` are written, before DCP's
        .metadata (FileSystemWriter.write_data; with async_with_pinned_mem it runs in DCP's
        writer process, which kills its rank first).
    rename: kill right before os.replace(".step-N.partial", "step-N") for N = `step`.
    purge: kill half-way through deleting checkpoint step-`step` (shutil.rmtree of
        ".step-N.deleting", after one of its files is removed).

    rank: the rank that dies, or None for every rank (the whole job crashes there).
    """

    point: str
    step: int
    rank: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Fault":
        return cls(**json.loads(text))

    def __str__(self) -> str:
        who = "all ranks" if self.rank is None else f"rank {self.rank}"
        return f"{self.point}@{self.step} on {who}"


# --- inside a rank process --------------------------------------------------------------


def _listing(folder: Path) -> dict[str, bool]:
    """Every entry of a checkpoint folder and whether it is a complete checkpoint."""
    if not folder.is_dir():
        return {}
    return {
        entry.name: bool(_STEP_FOLDER.match(entry.name)) and (entry / ".metadata").is_file()
        for entry in sorted(folder.iterdir())
    }


def _die(fault: Fault, rank: int, checkpoint_folder: Path, where: str, kill_parent: bool = False) -> None:
    """Record what the checkpoint folder holds right now, then SIGKILL this process (and,
    in DCP's writer process, the rank that started it first)."""
    record = {
        "fault": asdict(fault),
        "rank": rank,
        "where": where,
        "time": time.time(),
        "listing": _listing(checkpoint_folder),
    }
    dump_folder = checkpoint_folder.parent
    (dump_folder / f"fault-fired-rank{rank}.json").write_text(json.dumps(record, indent=1))
    if kill_parent:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _partial_step(path) -> int | None:
    match = re.fullmatch(r"\.step-(\d+)\.partial", Path(path).name)
    return int(match.group(1)) if match else None


def install_fault(fault: Fault) -> None:
    """Monkeypatch this rank process so that it SIGKILLs itself at `fault`. Call before
    titanlite.train.main; only the object that `fault.point` names is patched."""
    rank = int(os.environ.get("RANK", "0"))
    if fault.rank is not None and fault.rank != rank:
        return
    config = parse_args(sys.argv[1:])
    folder = Path(config.job.dump_folder) / config.checkpoint.folder

    if fault.point == "step":
        train_step = train.Trainer.train_step

        def train_step_or_die(self):
            if self.step + 1 == fault.step:
                _die(fault, rank, folder, f"entering train_step for step {fault.step}")
            return train_step(self)

        train.Trainer.train_step = train_step_or_die

    elif fault.point == "staging":
        # async: DCP stages through the writer (an AsyncStager); async_with_pinned_mem: through
        # the manager's DefaultStager, whose _stage runs in a background thread.
        save = manager.CheckpointManager.save
        saving = {"step": None}

        def save_remembering_step(self, step, *args, **kwargs):
            saving["step"] = step
            return save(self, step, *args, **kwargs)

        class StagerThatDies(manager.DefaultStager):
            def _stage(self, state_dict, **kwargs):
                if saving["step"] == fault.step:
                    _die(fault, rank, folder, f"DefaultStager._stage for step-{fault.step}")
                return super()._stage(state_dict, **kwargs)

        manager.CheckpointManager.save = save_remembering_step
        manager.DefaultStager = StagerThatDies
        manager.FileSystemWriter = _writer_factory(fault, rank, folder)

    elif fault.point == "write":
        manager.FileSystemWriter = _writer_factory(fault, rank, folder)

    elif fault.point == "rename":
        replace_file = os.replace

        def replace_or_die(src, dst, *args, **kwargs):
            if _partial_step(src) == fault.step and Path(dst).name == f"step-{fault.step}":
                _die(fault, rank, folder, f"os.replace({Path(src).name}, {Path(dst).name})")
            return replace_file(src, dst, *args, **kwargs)

        os.replace = replace_or_die  # the manager calls os.replace; patched in this process only

    elif fault.point == "purge":
        rmtree = shutil.rmtree

        def rmtree_or_die(path, *args, **kwargs):
            if Path(path).name == f".step-{fault.step}.deleting":
                files = sorted(p for p in Path(path).iterdir() if p.is_file())
                if files:
                    files[0].unlink()  # half-way: one file gone, the others still there
                _die(fault, rank, folder, f"shutil.rmtree({Path(path).name}) after deleting {len(files[:1])} file(s)")
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree_or_die  # the manager calls shutil.rmtree; patched in this process only

    else:
        raise ValueError(f"unknown fault point {fault.point!r}; expected one of {', '.join(FAULT_POINTS)}")


def _writer_factory(fault: Fault, rank: int, folder: Path):
    """What the manager calls instead of FileSystemWriter(path, ...)."""

    def writer(*args, **kwargs):
        return WriterThatDies(*args, fault=fault, rank=rank, folder=folder, **kwargs)

    return writer


class WriterThatDies(FileSystemWriter):
    """DCP's FileSystemWriter, dying at the fault's staging or write. A module-level class:
    with async_with_pinned_mem DCP pickles the writer into its writer process, which
    imports this module to rebuild it."""

    def __init__(self, *args, fault: Fault, rank: int, folder: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault, self.fault_rank, self.fault_folder = fault, rank, folder
        self.rank_pid = os.getpid()

    def stage(self, state_dict):
        # async_mode async stages through the writer, in the rank's main thread.
        if self.fault.point == "staging" and _partial_step(self.path) == self.fault.step:
            _die(self.fault, self.fault_rank, self.fault_folder, f"FileSystemWriter.stage for step-{self.fault.step}")
        return super().stage(state_dict)

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        if self.fault.point == "write" and _partial_step(self.path) == self.fault.step:
            in_writer_process = os.getpid() != self.rank_pid
            where = f"FileSystemWriter.write_data for step-{self.fault.step}, data written, no .metadata yet"
            if in_writer_process:
                where += " (in DCP's writer process: its rank is killed first)"
            _die(self.fault, self.fault_rank, self.fault_folder, where, kill_parent=in_writer_process)
        return written


# --- the job, seen from outside ---------------------------------------------------------


@dataclass
class Job:
    returncodes: list[int | None]
    outputs: list[str]  # each rank's stdout and stderr
    seconds: float
    killed_by_harness: bool
    timed_out: bool


def _kill_process_group(process: multiprocessing.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the rank, and DCP's writer process if any
    except ProcessLookupError:
        pass


def _wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def run_job(config: RunConfig, dump_folder: Path, fault: Fault | None, timeout: float, tag: str) -> Job:
    """Start the job's rank processes and wait until all exit. Once any rank has died
    (non-zero exit or a signal), SIGKILL every rank's process group at once."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(config.world_size),
        **rendezvous_env(),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault.to_json()
    logs = [dump_folder.parent / f"{dump_folder.name}.{tag}.rank{r}.log" for r in range(config.world_size)]
    start = time.monotonic()
    # Each rank forks from the test process's fork server (tests/forked_scripts.py), which has
    # imported torch and titanlite already, and leads a process group of its own.
    processes = [
        start_python(
            ["-c", LAUNCHER, *config.args(dump_folder)],
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(config.world_size)},
            stdout=log,
            stderr=None,
        )
        for rank, log in enumerate(logs)
    ]
    killed = timed_out = False
    try:
        while any(p.exitcode is None for p in processes):
            if any(p.exitcode not in (None, 0) for p in processes):
                killed = True
                break
            if time.monotonic() - start > timeout:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            _kill_process_group(process)
        for process in processes:
            process.join()
            _wait_group_gone(process.pid)
    return Job(
        [p.exitcode for p in processes],
        [log.read_text() for log in logs],
        time.monotonic() - start,
        killed,
        timed_out,
    )


def read_losses(dump_folder: Path, metrics: str = "metrics") -> dict[int, float]:
    """step -> global average loss from the run's metrics.jsonl (rank 0 writes it)."""
    losses = {}
    for path in sorted((dump_folder / metrics).glob("*/metrics.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if LOSS in record:
                    losses[record["step"]] = record[LOSS]
    return losses


_REFERENCES: dict[RunConfig, dict[int, float]] = {}


def reference_losses(config: RunConfig, workdir: Path) -> dict[int, float]:
    """The losses of an uninterrupted run, computed once per config and cached.

    The async mode only changes how checkpoints are written, not what is trained, so one
    run with async_mode disabled serves every mode; each trial also checks the killed
    run's own losses (in its async mode) against it, which would catch a difference."""
    key = replace(config, async_mode="disabled")
    if key not in _REFERENCES:
        dump = Path(workdir) / f"reference-{key.steps}-{key.interval}-{key.keep_latest_k}-{key.world_size}"
        shutil.rmtree(dump, ignore_errors=True)
        dump.mkdir(parents=True)
        job = run_job(key, dump, None, timeout=300, tag="reference")
        if job.returncodes != [0] * key.world_size:
            raise RuntimeError(f"the reference run failed ({job.returncodes}):\n{job.outputs[0][-3000:]}")
        losses = read_losses(dump)
        if sorted(losses) != list(range(1, key.steps + 1)):
            raise RuntimeError(f"the reference run logged steps {sorted(losses)}, expected 1..{key.steps}")
        _REFERENCES[key] = losses
    return _REFERENCES[key]


def _complete(listing: dict[str, bool]) -> list[int]:
    return sorted(int(_STEP_FOLDER.match(name).group(1)) for name, complete in listing.items() if complete)


def _load_error(path: Path) -> str | None:
    """None if the folder's model weights load, else the error in one line."""
    try:
        load_model(path)
    # Anything that stops a load counts as corrupt; DCP's CheckpointException is a BaseException.
    except (Exception, CheckpointException) as error:
        return " ".join(f"{type(error).__name__}: {error}".split())[:300]
    return None


@dataclass
class TrialResult:
    config: RunConfig
    fault: Fault
    status: str = "ok"  # ok, corrupt, lost or failed (anything else went wrong)
    problems: list[str] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)  # where the fault fired, per rank
    before_kill: list[int] = field(default_factory=list)  # complete steps the dying rank saw
    after_kill: list[str] = field(default_factory=list)  # the folder listing once the job was dead
    expected_resume: int = 0
    resumed_from: str | None = None
    removed_leftovers: list[str] = field(default_factory=list)
    compared_steps: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def problem(self, status: str, text: str) -> None:
        self.problems.append(f"{status}: {text}")
        # corrupt and lost are what the chaos summary counts; they win over "failed".
        if self.status == "ok" or (self.status == "failed" and status in ("corrupt", "lost")):
            self.status = status

    def summary(self) -> str:
        resumed = "fresh start" if self.resumed_from is None else Path(self.resumed_from).name
        text = (
            f"{self.fault} async_mode={self.config.async_mode}: {self.status.upper()}; complete before kill "
            f"{self.before_kill or '-'}, after kill {self.after_kill or '-'}; resumed from {resumed} "
            f"(expected {'fresh start' if not self.expected_resume else f'step-{self.expected_resume}'}); "
            f"losses compared at steps {_span(self.compared_steps)}; {self.seconds:.1f} s"
        )
        return text + "".join(f"\n    {problem}" for problem in self.problems)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def run_trial(
    config: RunConfig, fault: Fault, workdir: Path, reference: dict[int, float], keep: bool = False
) -> TrialResult:
    """Kill a run at `fault`, restart it without faults, and check the resume (see the
    module docstring). Never raises for what it finds: the result says what went wrong."""
    if fault.step not in config.fault_steps(fault.point):
        raise ValueError(
            f"{fault} cannot fire in a run with {config} (possible steps: {config.fault_steps(fault.point)})"
        )
    start = time.monotonic()
    result = TrialResult(config, fault)
    dump = (
        Path(workdir)
        / f"trial-{fault.point}-{fault.step}-{'all' if fault.rank is None else fault.rank}-{config.async_mode}"
    )
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    folder = dump / "checkpoint"
    try:
        _check_trial(config, fault, dump, folder, reference, result)
    finally:
        result.seconds = time.monotonic() - start
    if result.ok and not keep:
        shutil.rmtree(dump, ignore_errors=True)
        for log in dump.parent.glob(f"{dump.name}.*.log"):
            log.unlink()
    return result


def _check_trial(config, fault, dump, folder, reference, result) -> None:
    # 1. The run, killed at the fault.
    job = run_job(config, dump, fault, timeout=180, tag="killed")
    records = [json.loads(p.read_text()) for p in sorted(dump.glob("fault-fired-rank*.json"))]
    result.fired = [f"rank {r['rank']}: {r['where']}" for r in records]
    if not records:
        why = "timed out" if job.timed_out else f"exit statuses {job.returncodes}"
        result.problem("failed", f"the fault never fired ({why}); rank 0's output ends:\n{job.outputs[0][-2000:]}")
        return
    before = sorted({step for r in records for step in _complete(r["listing"])})
    result.before_kill = before

    # 2. What the job left behind.
    listing = _listing(folder)
    result.after_kill = list(listing)
    after = _complete(listing)
    for name in listing:
        if _STEP_FOLDER.match(name) and not listing[name]:
            result.problem("corrupt", f"{name} was published without DCP's .metadata")
    loadable = {}
    for step in after:
        error = _load_error(folder / f"step-{step}")
        loadable[step] = error is None
        if error:
            result.problem("corrupt", f"step-{step} is published but does not load: {error}")
    if before:
        newest = before[-1]
        if newest not in after:
            result.problem("lost", f"step-{newest}, the newest complete checkpoint before the kill, is gone")
        for step in before[:-1]:
            newer = [s for s in after if s > step]
            if step not in after and len(newer) < config.keep_latest_k:
                result.problem(
                    "lost",
                    f"step-{step} is gone although only {len(newer)} newer checkpoint(s) "
                    f"remain (keep_latest_k={config.keep_latest_k})",
                )
    expected = after[-1] if after else 0
    result.expected_resume = expected
    killed_losses = read_losses(dump)
    for step, loss in killed_losses.items():
        if loss != reference.get(step):
            result.problem(
                "failed",
                f"the killed run's loss at step {step} is {loss!r}, the reference's "
                f"{reference.get(step)!r} (before any fault fired)",
            )
    shutil.move(dump / "metrics", dump / "metrics-killed") if (dump / "metrics").exists() else None

    # 3. The restart, without faults, to the last step.
    job = run_job(config, dump, None, timeout=300, tag="restart")
    if job.returncodes != [0] * config.world_size:
        result.problem(
            "failed",
            f"the restart failed with exit statuses {job.returncodes}; rank 0's output ends:\n{job.outputs[0][-2000:]}",
        )
        return
    loaded = _LOADED.findall(job.outputs[0])
    result.resumed_from = loaded[0] if loaded else None
    result.removed_leftovers = re.findall(r"removed an incomplete checkpoint folder: (\S+)", job.outputs[0])
    if len(loaded) > 1:
        result.problem("failed", f"the restart loaded {len(loaded)} checkpoints: {loaded}")
    if loaded:
        name = Path(loaded[0]).name
        if not _STEP_FOLDER.match(name) or not listing.get(name):
            result.problem("corrupt", f"the restart loaded {loaded[0]}, which was not a complete checkpoint")
        elif int(_STEP_FOLDER.match(name).group(1)) != expected:
            result.problem(
                "failed", f"the restart resumed from {name}, but the newest complete checkpoint was step-{expected}"
            )
    elif expected:
        result.problem("failed", f"the restart started fresh although step-{expected} was complete")

    # 4. Leftovers are gone, the run ended with its last checkpoint, the losses match.
    final = _listing(folder)
    leftovers = [name for name in final if _LEFTOVER.match(name)]
    if leftovers:
        result.problem("failed", f"incomplete folders left after the restart: {leftovers}")
    final_complete = _complete(final)
    if not final_complete or final_complete[-1] != config.steps:
        result.problem(
            "failed",
            f"after the restart the complete checkpoints are {final_complete}, "
            f"expected the newest to be step-{config.steps}",
        )
    elif _load_error(folder / f"step-{config.steps}"):
        result.problem("corrupt", f"the restart's step-{config.steps} does not load")
    losses = read_losses(dump)
    wanted = list(range(expected + 1, config.steps + 1))
    missing = [s for s in wanted if s not in losses]
    if missing:
        result.problem("failed", f"the restart logged no loss for steps {missing}")
    extra = sorted(s for s in losses if s <= expected)
    if extra:
        result.problem("failed", f"the restart logged steps {extra}, at or before its resume step {expected}")
    for step in wanted:
        if step in losses and losses[step] != reference[step]:
            result.problem(
                "failed",
                f"step {step}: loss {losses[step]!r} after the resume, {reference[step]!r} in the uninterrupted run",
            )
    result.compared_steps = [s for s in wanted if s in losses]


def random_trial(rng: random.Random, base: RunConfig = RunConfig()) -> tuple[RunConfig, Fault]:
    """A fault point, async mode, step and rank drawn from `rng`, among those that can fire."""
    point = rng.choice(FAULT_POINTS)
    modes = [m for m in ASYNC_MODES if m != "disabled"] if point == "staging" else list(ASYNC_MODES)
    config = replace(base, async_mode=rng.choice(modes))
    # Only rank 0 publishes and purges: a rename or purge fault on another rank never fires.
    ranks = [0, None] if point in ("rename", "purge") else [*range(config.world_size), None]
    return config, Fault(point, rng.choice(config.fault_steps(point)), rng.choice(ranks))
