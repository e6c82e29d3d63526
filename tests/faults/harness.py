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

The checkpoint folder is local (storage "local") or a prefix of a bucket on an S3 server
(storage "s3": moto's, in this process, started by object_store()), where a step is
committed by its marker instead of renamed into place.

The fault points (FAULT_POINTS) and the checks are described in docs/reliability.md;
tests/faults/test_kill_resume.py runs one trial per fault point, and
`python -m tests.faults.chaos` many random ones.
"""

import contextlib
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
from tests.s3_server import s3_server
from titanlite import train
from titanlite.checkpoint import files, manager
from titanlite.checkpoint.files import COMMITTED, is_complete
from titanlite.checkpoint.load import load_model
from titanlite.checkpoint.object_io import ObjectWriter
from titanlite.config import parse_args
from titanlite.storage import ObjectPath, checkpoint_folder, location

REPO = Path(__file__).resolve().parents[2]
FAULT_ENV = "TITANLITE_TEST_FAULT"
# A local folder publishes a step by renaming it, object storage by writing its commit marker.
FAULT_POINTS = ("step", "staging", "write", "rename", "purge")
OBJECT_FAULT_POINTS = ("step", "staging", "write", "commit", "purge")
STORAGES = ("local", "s3")
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
LOSS = "loss_metrics/global_avg_loss"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.step-\d+\.(partial|deleting)$")
_LOADED = re.compile(r"loaded checkpoint (\S+) \(")
_SAVED = re.compile(r"checkpoint saved: (\S+)")

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
    storage: str = "local"  # or "s3": the checkpoints go to a bucket (run_trial's store)

    def args(self, dump_folder: Path, checkpoint_url: str | None = None) -> list[str]:
        """The job's command line; `checkpoint_url` the checkpoint folder in object storage
        (None: the default folder, inside the dump folder)."""
        return tiny_args(
            {
                "training.steps": self.steps,
                "checkpoint.enable": True,
                "checkpoint.folder": checkpoint_url,
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

    @property
    def fault_points(self) -> tuple[str, ...]:
        return OBJECT_FAULT_POINTS if self.storage == "s3" else FAULT_POINTS

    def fault_steps(self, point: str) -> list[int]:
        """The steps at which `point` can fire in this run."""
        if point not in self.fault_points:
            raise ValueError(
                f"unknown fault point {point!r} with storage {self.storage}; "
                f"expected one of {', '.join(self.fault_points)}"
            )
        if point == "step":
            return list(range(1, self.steps + 1))
        if point == "staging":  # only the async saves stage; the last save is synchronous
            return [] if self.async_mode == "disabled" else [s for s in self.saves if s != self.steps]
        if point in ("write", "rename", "commit"):
            return self.saves
        return self.purged


@dataclass(frozen=True)
class Fault:
    """Where to SIGKILL the job.

    step: kill on entry to Trainer.train_step for training step `step` (1-based).
    staging: kill while the async save of checkpoint step-`step` copies the state (the
        writer's stage for async, DefaultStager._stage for async_with_pinned_mem).
    write: kill once this rank's data files of step-`step` are written, before DCP's
        .metadata (the writer's write_data; with async_with_pinned_mem it runs in DCP's
        writer process, which kills its rank first).
    rename (local): kill right before os.replace(".step-N.partial", "step-N") for N = `step`.
    commit (object storage): kill right before rank 0 writes step-N's commit marker.
    purge: kill half-way through deleting checkpoint step-`step`: locally shutil.rmtree of
        ".step-N.deleting", in object storage the recursive removal of step-N once its
        marker is gone; both after one of its files is removed.

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


def _listing(folder: Path | ObjectPath) -> dict[str, bool]:
    """Every entry of a checkpoint folder and whether it is a complete checkpoint, by the
    manager's own rule (files.is_complete: DCP's .metadata locally, the commit marker in
    object storage)."""
    if not folder.is_dir():
        return {}
    entries = sorted(folder.iterdir(), key=lambda entry: entry.name)
    return {entry.name: bool(_STEP_FOLDER.match(entry.name)) and is_complete(entry) for entry in entries}


def _die(
    fault: Fault, rank: int, dump_folder: Path | str, folder: Path | ObjectPath, where: str, kill_parent: bool = False
) -> None:
    """Record what the checkpoint folder holds right now (in the local dump folder), then
    SIGKILL this process (and, in DCP's writer process, the rank that started it first)."""
    record = {
        "fault": asdict(fault),
        "rank": rank,
        "where": where,
        "time": time.time(),
        "listing": _listing(folder),
    }
    (Path(dump_folder) / f"fault-fired-rank{rank}.json").write_text(json.dumps(record, indent=1))
    if kill_parent:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _written_step(path) -> int | None:
    """The step a writer's folder saves: ".step-N.partial" locally; in object storage the
    save writes step-N itself."""
    match = re.fullmatch(r"\.step-(\d+)\.partial|step-(\d+)", Path(str(path)).name)
    return int(match.group(1) or match.group(2)) if match else None


def install_fault(fault: Fault) -> None:
    """Monkeypatch this rank process so that it SIGKILLs itself at `fault`. Call before
    titanlite.train.main; only the object that `fault.point` names is patched."""
    rank = int(os.environ.get("RANK", "0"))
    if fault.rank is not None and fault.rank != rank:
        return
    config = parse_args(sys.argv[1:])
    dump = Path(config.job.dump_folder)
    folder = checkpoint_folder(config.job.dump_folder, config.checkpoint.folder)
    in_object_storage = isinstance(folder, ObjectPath)

    if fault.point == "step":
        train_step = train.Trainer.train_step

        def train_step_or_die(self):
            if self.step + 1 == fault.step:
                _die(fault, rank, dump, folder, f"entering train_step for step {fault.step}")
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
                    _die(fault, rank, dump, folder, f"DefaultStager._stage for step-{fault.step}")
                return super()._stage(state_dict, **kwargs)

        manager.CheckpointManager.save = save_remembering_step
        manager.DefaultStager = StagerThatDies
        manager.writer_for = _writer_factory(fault, rank, dump, folder)

    elif fault.point == "write":
        manager.writer_for = _writer_factory(fault, rank, dump, folder)

    elif fault.point == "rename" and not in_object_storage:
        replace_file = os.replace

        def replace_or_die(src, dst, *args, **kwargs):
            if _written_step(src) == fault.step and Path(dst).name == f"step-{fault.step}":
                _die(fault, rank, dump, folder, f"os.replace({Path(src).name}, {Path(dst).name})")
            return replace_file(src, dst, *args, **kwargs)

        os.replace = replace_or_die  # files.publish calls os.replace; patched in this process only

    elif fault.point == "commit" and in_object_storage:
        commit = files.commit

        def commit_or_die(step_folder):
            if step_folder.name == f"step-{fault.step}":
                _die(fault, rank, dump, folder, f"commit({step_folder.name}): every file written, no {COMMITTED} yet")
            return commit(step_folder)

        # Rank 0 alone commits, through files.publish; patched wherever the name is looked up
        # (the manager's namespace too, should it import the function).
        for module in (files, manager):
            if getattr(module, "commit", None) is commit:
                module.commit = commit_or_die

    elif fault.point == "purge" and not in_object_storage:
        rmtree = shutil.rmtree

        def rmtree_or_die(path, *args, **kwargs):
            if Path(path).name == f".step-{fault.step}.deleting":
                contents = sorted(p for p in Path(path).iterdir() if p.is_file())
                if contents:
                    contents[0].unlink()  # half-way: one file gone, the others still there
                where = f"shutil.rmtree({Path(path).name}) after deleting {len(contents[:1])} file(s)"
                _die(fault, rank, dump, folder, where)
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree_or_die  # files.delete_step_folder calls shutil.rmtree; patched in this process only

    elif fault.point == "purge" and in_object_storage:
        remove = ObjectPath.remove
        doomed = folder / f"step-{fault.step}"

        def remove_or_die(self, recursive=False):
            # files.delete_step_folder removes the marker, then the prefix (recursive). A save
            # also calls it first for its own step, which then holds no object: not a purge.
            objects = sorted(self.fs.find(self.path)) if recursive and self == doomed else []
            if objects:
                self.fs.rm_file(objects[0])  # half-way: one object gone, the others still there
                where = f"removing {self.name} (marker gone) after deleting {Path(objects[0]).name}"
                _die(fault, rank, dump, folder, where)
            return remove(self, recursive)

        ObjectPath.remove = remove_or_die  # patched in this process only

    else:
        raise ValueError(
            f"fault point {fault.point!r} cannot fire with checkpoints in {folder} "
            f"(expected one of {', '.join(OBJECT_FAULT_POINTS if in_object_storage else FAULT_POINTS)})"
        )


def _writer_factory(fault: Fault, rank: int, dump: Path, folder: Path | ObjectPath):
    """What the manager calls instead of files.writer_for: a copy of the writer it returns
    (FileSystemWriter locally, ObjectWriter in object storage) as the matching subclass
    below, which dies at the fault; every option production chose for the writer (sync_files,
    upload slots) is in the copied attributes."""
    writer_for = manager.writer_for

    def writer_for_or_die(step_folder, *args, **kwargs):
        writer = writer_for(step_folder, *args, **kwargs)
        # A copy, not a __class__ switch: Python refuses that with the mixin as the first base.
        dying = object.__new__(_DYING[type(writer)])
        dying.__dict__.update(vars(writer))
        # Plain strings: with async_with_pinned_mem DCP pickles the writer into its writer process.
        dying.fault, dying.fault_rank = fault, rank
        dying.fault_dump, dying.fault_folder = str(dump), str(folder)
        dying.rank_pid = os.getpid()
        return dying

    return writer_for_or_die


class DiesAtFault:
    """Mixed into DCP's writer: dies at the fault's staging or write. The classes using it
    are module-level: with async_with_pinned_mem DCP pickles the writer into its writer
    process, which imports this module to rebuild it."""

    base_name = ""  # the production writer's class, for the fault record

    def _die_here(self, where: str, kill_parent: bool = False) -> None:
        _die(self.fault, self.fault_rank, self.fault_dump, location(self.fault_folder), where, kill_parent)

    def stage(self, state_dict):
        # async_mode async stages through the writer, in the rank's main thread.
        if self.fault.point == "staging" and _written_step(self.path) == self.fault.step:
            self._die_here(f"{self.base_name}.stage for step-{self.fault.step}")
        return super().stage(state_dict)

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        if self.fault.point == "write" and _written_step(self.path) == self.fault.step:
            in_writer_process = os.getpid() != self.rank_pid
            where = f"{self.base_name}.write_data for step-{self.fault.step}, data written, no .metadata yet"
            if in_writer_process:
                where += " (in DCP's writer process: its rank is killed first)"
            self._die_here(where, kill_parent=in_writer_process)
        return written


class WriterThatDies(DiesAtFault, FileSystemWriter):
    """DCP's FileSystemWriter (a local folder), dying at the fault."""

    base_name = "FileSystemWriter"


class ObjectWriterThatDies(DiesAtFault, ObjectWriter):
    """titanlite's ObjectWriter (DCP's FsspecWriter, object storage), dying at the fault."""

    base_name = "ObjectWriter"


# The dying subclass of each class that files.writer_for returns.
_DYING = {FileSystemWriter: WriterThatDies, ObjectWriter: ObjectWriterThatDies}


# --- object storage ----------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectStore:
    """A bucket on the S3 server that object_store() started; trials write under prefixes of it."""

    endpoint: str
    bucket: str

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


# Any values: moto accepts every key. The jobs inherit them from this process's environment.
@contextlib.contextmanager
def object_store(bucket: str = "titanlite-faults"):
    """A bucket on moto's S3 server started in this process (tests/s3_server.py), which the
    jobs reach through the AWS_* variables they inherit, as an ObjectStore."""
    with s3_server(bucket) as environment:
        yield ObjectStore(environment["AWS_ENDPOINT_URL"], bucket)


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


def run_job(
    config: RunConfig,
    dump_folder: Path,
    fault: Fault | None,
    timeout: float,
    tag: str,
    checkpoint_url: str | None = None,
) -> Job:
    """Start the job's rank processes and wait until all exit. Once any rank has died
    (non-zero exit or a signal), SIGKILL every rank's process group at once.
    `checkpoint_url`: the checkpoint folder in object storage (None: the default local folder)."""
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
            ["-c", LAUNCHER, *config.args(dump_folder, checkpoint_url)],
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

    The async mode and the storage only change how checkpoints are written, not what is
    trained, so one run with async_mode disabled in a local folder serves every mode; each
    trial also checks the killed run's own losses (in its mode) against it, which would
    catch a difference."""
    key = replace(config, async_mode="disabled", storage="local")
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


def _load_error(path: Path | ObjectPath) -> str | None:
    """None if the folder's model weights load, else the error in one line."""
    try:
        load_model(str(path) if isinstance(path, ObjectPath) else path)  # a URL, as a user gives it
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
    # Object storage: what became of each uncommitted step-N the kill left (torn -> fate).
    torn: dict[str, str] = field(default_factory=dict)
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
        storage = "" if self.config.storage == "local" else f" storage={self.config.storage}"
        torn = "".join(f"; {name} {fate}" for name, fate in self.torn.items())
        text = (
            f"{self.fault} async_mode={self.config.async_mode}{storage}: {self.status.upper()}; complete before kill "
            f"{self.before_kill or '-'}, after kill {self.after_kill or '-'}; resumed from {resumed} "
            f"(expected {'fresh start' if not self.expected_resume else f'step-{self.expected_resume}'}){torn}; "
            f"losses compared at steps {_span(self.compared_steps)}; {self.seconds:.1f} s"
        )
        return text + "".join(f"\n    {problem}" for problem in self.problems)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def run_trial(
    config: RunConfig,
    fault: Fault,
    workdir: Path,
    reference: dict[int, float],
    keep: bool = False,
    store: "ObjectStore | None" = None,
) -> TrialResult:
    """Kill a run at `fault`, restart it without faults, and check the resume (see the
    module docstring). Never raises for what it finds: the result says what went wrong.
    With config.storage "s3" the checkpoints go to a prefix of `store`'s bucket named after
    the trial; the logs, metrics and fault records stay in the local trial folder."""
    if fault.step not in config.fault_steps(fault.point):
        raise ValueError(
            f"{fault} cannot fire in a run with {config} (possible steps: {config.fault_steps(fault.point)})"
        )
    if (config.storage == "s3") != (store is not None):
        raise ValueError(f"storage {config.storage} needs {'an' if store is None else 'no'} ObjectStore")
    start = time.monotonic()
    result = TrialResult(config, fault)
    name = f"trial-{fault.point}-{fault.step}-{'all' if fault.rank is None else fault.rank}-{config.async_mode}"
    dump = Path(workdir) / (name if store is None else f"{name}-{config.storage}")
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    url = None if store is None else store.url(dump.name)
    folder = dump / "checkpoint" if url is None else location(url)
    if url is not None:
        folder.remove(recursive=True)  # an earlier trial drawn alike
    try:
        _check_trial(config, fault, dump, folder, url, reference, result)
    finally:
        result.seconds = time.monotonic() - start
        if url is not None:
            if keep or not result.ok:  # the server's objects go with it: a copy to look at
                _download(folder, dump / "checkpoint")
            folder.remove(recursive=True)
    if result.ok and not keep:
        shutil.rmtree(dump, ignore_errors=True)
        for log in dump.parent.glob(f"{dump.name}.*.log"):
            log.unlink()
    return result


def _download(folder: ObjectPath, target: Path) -> None:
    """Copy every object under `folder` into the local folder `target`."""
    for source in folder.fs.find(folder.path):
        local = target / source[len(folder.path) :].lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        folder.fs.get_file(source, str(local))


def _check_trial(config, fault, dump, folder, url, reference, result) -> None:
    in_object_storage = url is not None
    # 1. The run, killed at the fault.
    job = run_job(config, dump, fault, timeout=180, tag="killed", checkpoint_url=url)
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
    incomplete = [name for name, complete in listing.items() if _STEP_FOLDER.match(name) and not complete]
    result.after_kill = [f"{name} (uncommitted)" if name in incomplete else name for name in listing]
    after = _complete(listing)
    if in_object_storage:
        # An uncommitted step-N is a save or a deletion cut short: allowed, but load_model must
        # refuse it even when DCP's .metadata is there. A committed one must hold everything,
        # the marker being written last.
        for name in incomplete:
            if _load_error(folder / name) is None:
                result.problem("corrupt", f"{name} has no commit marker, yet load_model loads it")
        for step in after:
            if not (folder / f"step-{step}" / ".metadata").is_file():
                result.problem("corrupt", f"step-{step} was committed without DCP's .metadata")
    else:
        for name in incomplete:
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
    job = run_job(config, dump, None, timeout=300, tag="restart", checkpoint_url=url)
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
    if in_object_storage:
        _check_uncommitted(folder, incomplete, final, job.outputs[0], result)
    else:
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


def _check_uncommitted(folder: ObjectPath, torn: list[str], final: dict[str, bool], output: str, result) -> None:
    """Object storage: the manager removes an uncommitted step-N (`torn`: those the kill left)
    only once a later step is committed, since a save may still be writing it, or when it
    saves that step again. So none older than the restart's newest commit may be left, and
    each torn one was removed (logged), saved again (and loads), or is left for lack of a
    later commit."""
    saved = [Path(path).name for path in _SAVED.findall(output)]
    newest = max((int(_STEP_FOLDER.match(name).group(1)) for name in saved), default=0)
    for name, complete in final.items():
        if _STEP_FOLDER.match(name) and not complete and int(_STEP_FOLDER.match(name).group(1)) < newest:
            result.problem("failed", f"{name}, uncommitted, is left although the restart committed step-{newest}")
    removed = {Path(path).name for path in result.removed_leftovers}
    for name in torn:
        if name in removed and name not in final:
            result.torn[name] = "purged"
        elif name in saved:
            result.torn[name] = "saved again"
            error = _load_error(folder / name) if final.get(name) else None
            if error:
                result.problem("corrupt", f"{name}, torn by the kill and saved again, does not load: {error}")
        elif final.get(name) is False:  # a problem above, unless no later step was committed
            result.torn[name] = "left" if int(_STEP_FOLDER.match(name).group(1)) < newest else "left (no later commit)"
        else:
            result.torn[name] = "gone"
            result.problem("failed", f"{name}, torn by the kill, is gone without the restart removing or saving it")


def random_trial(rng: random.Random, base: RunConfig = RunConfig()) -> tuple[RunConfig, Fault]:
    """A fault point, async mode, step and rank drawn from `rng`, among those that can fire
    with base.storage (a local seed draws the same trials as before object storage came)."""
    point = rng.choice(base.fault_points)
    modes = [m for m in ASYNC_MODES if m != "disabled"] if point == "staging" else list(ASYNC_MODES)
    config = replace(base, async_mode=rng.choice(modes))
    # Only rank 0 publishes and purges: a rename, commit or purge fault on another rank never fires.
    ranks = [0, None] if point in ("rename", "commit", "purge") else [*range(config.world_size), None]
    return config, Fault(point, rng.choice(config.fault_steps(point)), rng.choice(ranks))
