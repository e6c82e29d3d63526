"""Checkpoints on disk: the step-N layout, interrupted saves and purges, keep_latest_k,
the model-only last save, and stopping on SIGTERM.

Several tests run the real command line (``python -m titanlite.train`` or torchrun) in a
subprocess and kill or signal it; those use the debugmodel flavor with short sequences.
The in-process runs use the tiny flavor through ``run_on_ranks``, and the purge and
leftover rules drive a CheckpointManager directly on a small Linear model.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager

from tests.forked_scripts import kill_group, run_python, start_python
from tests.helpers import NoArgs, StepCounter, capture_log_lines, full_weights, tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.s3_server import BUCKET, s3_server
from titanlite.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelDescription,
    ModelState,
    complete_steps,
    stager,
    top_level_names,
)
from titanlite.checkpoint.files import reader_for
from titanlite.config import Checkpoint, parse_args
from titanlite.storage import ObjectPath, location
from titanlite.train import SYNC_EVERY, Trainer
from titanlite.train import main as train_main

REPO_ROOT = Path(__file__).resolve().parent.parent


DISTRIBUTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOG_RANK")
STEP_LINE = re.compile(r"\[titanlite\] step:\s+(\d+)\s+loss: (\S+)\s+grad_norm: (\S+)")
STOP_LINE = re.compile(r"stop signal received: saving step (\d+) and exiting")
MODEL_NAMES = {"tok_embeddings", "layers", "norm", "output"}
TRAINING_PARTS = {"optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
SUBPROCESS_TIMEOUT = 240

TINY_ARGS = tiny_args({"training.mixed_precision_param": None, "activation_checkpoint.mode": None})
# For the command line, in a subprocess: the debugmodel flavor. The whole run is warmup, so
# the learning rate of a step does not depend on training.steps and a restart with another
# training.steps follows the same trajectory.
CLI_ARGS = [
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "1000",
    "--metrics.log_freq",
    "1",
]


# --- helpers ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    # The checkout under test, not whichever titanlite happens to be installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _train_command(dump: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "titanlite.train", "--job.dump_folder", str(dump), *CLI_ARGS, *args]


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`command` (sys.executable first), forked from the fork server (tests/forked_scripts.py)."""
    return run_python(command[1:], cwd=cwd, env=_env(), timeout=SUBPROCESS_TIMEOUT)


def _describe(returncode: int, output: str) -> str:
    return f"exit {returncode}\n--- output (tail) ---\n{output[-6000:]}"


def _logged_steps(output: str) -> dict[int, tuple[str, str]]:
    """step -> (loss, grad_norm) exactly as the console printed them."""
    return {int(step): (loss, norm) for step, loss, norm in STEP_LINE.findall(output)}


def _load_everything(path: Path | ObjectPath) -> dict:
    """Every entry of a checkpoint, read on this one process into fresh tensors/objects."""
    metadata = reader_for(path).read_metadata()
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        for key, item in metadata.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=reader_for(path), no_dist=True)
    return state


def _train_on_ranks(args: list[str]) -> dict:
    """One Trainer run (inside run_on_ranks): where it started and the weights at both ends."""
    trainer = Trainer(parse_args(TINY_ARGS + args))
    start_step, start_weights = trainer.step, full_weights(trainer.model)
    records = trainer.train()
    result = {
        "start_step": start_step,
        "start_weights": start_weights,
        "steps": [record.step for record in records],
        "weights": full_weights(trainer.model),
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _manager(
    dump: Path, shared_by_groups: bool = False, **options
) -> tuple[CheckpointManager, torch.nn.Linear, StepCounter]:
    """A manager over a small Linear "model" and a step counter, as a trainer would build it."""
    model, train_state = torch.nn.Linear(4, 3), StepCounter()
    manager = CheckpointManager(
        {"model": ModelState(model, ModelDescription("linear", "4x3", NoArgs())), "train_state": train_state},
        Checkpoint(enable=True, **options),
        str(dump),
        shared_by_groups=shared_by_groups,
    )
    return manager, model, train_state


def _train_with_manager(manager, model, train_state, steps: int, after_each_save=None, model_only_last=False) -> None:
    """`steps` fake optimizer steps, each changing the weights, saving as the trainer does."""
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        train_state.step = step
        if manager.should_save(step, steps):
            manager.save(step, model_only=model_only_last and step == steps)
            if after_each_save is not None:
                after_each_save(step)
    manager.close()


# --- 1. layout -------------------------------------------------------------------------


def _step_folders(dump: str) -> list[str]:
    return sorted(entry.name for entry in (Path(dump) / "checkpoint").iterdir())


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict:
    """The module's 2-rank trainer runs, one launch: a plain run, and a model-only last
    save followed by its resume, with the step folders listed in between."""
    layout, model_only = tmp_path_factory.mktemp("layout"), tmp_path_factory.mktemp("model_only")
    interval = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    common = ["--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"]
    common += ["--job.dump_folder", str(model_only)]
    jobs = {
        "layout": Job(2, _train_on_ranks, (["--training.steps", "4", *interval, "--job.dump_folder", str(layout)],)),
        "trained": Job(2, _train_on_ranks, (["--training.steps", "4", "--checkpoint.interval", "2", *common],)),
        # Before the resume below writes its own (later) save.
        "before_resume": Job(1, _step_folders, (str(model_only),)),
        "resumed": Job(2, _train_on_ranks, (["--training.steps", "6", "--checkpoint.interval", "100", *common],)),
    }
    return {"layout_dump": layout, "model_only_dump": model_only, **run_jobs_on_ranks(2, jobs)}


@pytest.fixture(scope="module")
def two_rank_run(two_rank_runs):
    return two_rank_runs["layout_dump"], two_rank_runs["layout"][0]


def test_two_rank_run_writes_complete_step_folders(two_rank_run):
    dump, run = two_rank_run
    folder = dump / "checkpoint"
    # Only the published folders: no .step-N.partial (or .deleting) is left behind.
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-2", "step-4"]
    assert list(complete_steps(folder)) == [2, 4]
    weight_names = {name.split(".", 1)[0] for name in run["weights"]}
    assert MODEL_NAMES <= weight_names
    for step in (2, 4):
        path = folder / f"step-{step}"
        files = sorted(entry.name for entry in path.iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
        assert all((path / name).stat().st_size > 0 for name in files)
        names = top_level_names(path)
        # Model weights at the top level (not under "model."), next to the training parts.
        # The model's weights sit at the top level, beside its description and the parts.
        assert names == weight_names | {"model_args"} | TRAINING_PARTS, names
        assert "model" not in names


def test_two_rank_checkpoint_holds_both_shards_of_the_trained_weights(two_rank_run):
    dump, run = two_rank_run
    saved = _load_everything(dump / "checkpoint" / "step-4")
    assert saved["train_state.step"] == 4
    for name, value in run["weights"].items():
        assert saved[name].dtype == torch.float32, name
        assert torch.equal(saved[name], value), name
    # The weights did train: step-2 holds other values than step-4.
    earlier = _load_everything(dump / "checkpoint" / "step-2")
    assert earlier["train_state.step"] == 2
    assert not torch.equal(earlier["output.weight"], saved["output.weight"])


# --- 2. interrupted saves --------------------------------------------------------------


def _kill_during_a_save(dump: Path, min_step: int, deadline_s: float = 120) -> tuple[str | None, str]:
    """Train with a save every step and SIGKILL the process group once a save of step
    >= min_step is writing its data. Returns the name of the partial folder caught (None
    if none was caught before the run ended by itself) and the output."""
    folder = dump / "checkpoint"
    log_path = dump.with_suffix(".log")
    command = _train_command(
        dump,
        "--training.steps",
        str(min_step + 10),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "0",
    )
    caught = None
    process = start_python(command[1:], cwd=dump.parent, env=_env(), stdout=log_path, stderr=None)
    try:
        start = time.monotonic()
        while caught is None and process.exitcode is None and time.monotonic() - start < deadline_s:
            try:
                names = os.listdir(folder)
            except FileNotFoundError:
                names = []
            for name in names:
                match = re.fullmatch(r"\.step-(\d+)\.partial", name)
                if not match or int(match.group(1)) < min_step:
                    continue
                try:
                    inside = os.listdir(folder / name)
                except FileNotFoundError:  # just renamed to step-N
                    continue
                if any(entry.endswith(".distcp") for entry in inside) and ".metadata" not in inside:
                    caught = name
                    break
            time.sleep(0.001)
    finally:
        kill_group(process)
    return caught, log_path.read_text()


def test_save_killed_mid_write_leaves_only_loadable_step_folders(tmp_path):
    partial, output = None, ""
    for attempt in range(3):
        dump = tmp_path / f"attempt{attempt}"
        dump.mkdir()
        caught, output = _kill_during_a_save(dump, min_step=3)
        # The kill must have landed before the rename: the partial folder is still there.
        if caught is not None and (dump / "checkpoint" / caught).is_dir():
            partial = caught
            break
    assert partial is not None, f"never caught a save in the act in 3 attempts\n{output[-3000:]}"
    folder = dump / "checkpoint"
    partial_step = int(re.fullmatch(r"\.step-(\d+)\.partial", partial).group(1))

    # Every step-N folder on disk is complete and loads; the partial one is not among them.
    step_folders = {int(entry.name[5:]): entry for entry in folder.iterdir() if re.fullmatch(r"step-\d+", entry.name)}
    assert partial_step not in step_folders
    assert complete_steps(folder) == step_folders
    assert max(step_folders) == partial_step - 1, sorted(step_folders)
    for step, path in step_folders.items():
        assert _load_everything(path)["train_state.step"] == step

    # A new run removes the leftover at start-up and resumes from the newest complete step.
    newest = max(step_folders)
    result = _run(
        _train_command(
            dump,
            "--training.steps",
            str(newest + 2),
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1",
            "--checkpoint.keep_latest_k",
            "0",
        ),
        cwd=tmp_path,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, _describe(result.returncode, out)
    assert "Traceback" not in out, _describe(result.returncode, out)
    assert f"removed an incomplete checkpoint folder: {folder / partial}" in out, _describe(result.returncode, out)
    assert f"loaded checkpoint {folder / f'step-{newest}'} (" in out, _describe(result.returncode, out)
    assert sorted(_logged_steps(out)) == [newest + 1, newest + 2], _describe(result.returncode, out)
    assert not [entry.name for entry in folder.iterdir() if entry.name.startswith(".")]
    assert list(complete_steps(folder))[-2:] == [newest + 1, newest + 2]
    assert _load_everything(folder / f"step-{newest + 2}")["train_state.step"] == newest + 2


def test_partial_and_foreign_folders_are_never_loaded(tmp_path):
    manager, model, train_state = _manager(tmp_path, interval=5)
    _train_with_manager(manager, model, train_state, steps=5)
    saved_weight = model.weight.detach().clone()
    folder = tmp_path / "checkpoint"
    # A newer save that died mid-write, even one that got as far as a (junk) .metadata ...
    partial = folder / ".step-9.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    (partial / ".metadata").write_bytes(b"junk")
    # ... a folder with a step name but no metadata, and an unrelated one: not ours to touch.
    foreign = folder / "step-7"
    foreign.mkdir()
    (foreign / "__0_0.distcp").write_bytes(b"not a checkpoint")
    notes = folder / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me\n")
    assert list(complete_steps(folder)) == [5]

    resumed, resumed_model, resumed_state = _manager(tmp_path)  # start-up
    assert not partial.exists()
    assert (foreign / "__0_0.distcp").read_bytes() == b"not a checkpoint"
    assert (notes / "todo.txt").read_text() == "keep me\n"
    assert list(complete_steps(folder)) == [5]
    assert resumed.load() == ["model", "train_state"]
    assert resumed_state.step == 5
    assert torch.equal(resumed_model.weight, saved_weight)
    resumed.close()


def test_groups_sharing_the_folder_leave_a_newer_partial_save_alone(tmp_path):
    """Fault-tolerant replica groups write to one folder in turn. A group starting up must not
    remove a partial folder, which may be another group's save in progress; a save of step N
    removes what a dead saver left of older steps only."""
    folder = tmp_path / "checkpoint"
    older, newer = folder / ".step-3.partial", folder / ".step-9.partial"
    for partial in (older, newer):
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes(b"\0" * 100)
    manager, model, train_state = _manager(tmp_path, shared_by_groups=True, interval=5)
    assert older.exists() and newer.exists()  # start-up removed nothing
    _train_with_manager(manager, model, train_state, steps=5)
    assert not older.exists() and newer.exists()
    assert list(complete_steps(folder)) == [5]


# --- 3. keep_latest_k ------------------------------------------------------------------


def test_keep_latest_k_keeps_the_newest_folders(tmp_path):
    manager, model, train_state = _manager(tmp_path, interval=1, keep_latest_k=2)
    _train_with_manager(manager, model, train_state, steps=5)
    folder = tmp_path / "checkpoint"
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-4", "step-5"]
    resumed, _, resumed_state = _manager(tmp_path, keep_latest_k=2)
    assert resumed.load() == ["model", "train_state"]
    assert resumed_state.step == 5
    resumed.close()


def test_keep_every_spares_multiples_from_the_purge(tmp_path):
    manager, model, train_state = _manager(tmp_path, interval=1, keep_latest_k=2, keep_every=2)
    _train_with_manager(manager, model, train_state, steps=5)
    folder = tmp_path / "checkpoint"
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-2", "step-4", "step-5"]
    assert list(complete_steps(folder)) == [2, 4, 5]


def test_keep_latest_1_never_leaves_zero_checkpoints(tmp_path):
    folder = tmp_path / "checkpoint"
    seen = []

    def check(step):
        seen.append(list(complete_steps(folder)))

    manager, model, train_state = _manager(tmp_path, interval=1, keep_latest_k=1)
    _train_with_manager(manager, model, train_state, steps=3, after_each_save=check)
    assert seen == [[1], [2], [3]]
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-3"]


def test_keep_latest_1_keeps_the_newest_resumable_checkpoint_next_to_a_model_only_one(tmp_path):
    manager, model, train_state = _manager(tmp_path, interval=2, keep_latest_k=1)
    saved_weights = {}

    def remember(step):
        saved_weights[step] = model.weight.detach().clone()

    _train_with_manager(manager, model, train_state, steps=5, after_each_save=remember, model_only_last=True)
    folder = tmp_path / "checkpoint"
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-4", "step-5"]
    assert top_level_names(folder / "step-5") == {"weight", "bias", "model_args"}
    resumed, resumed_model, resumed_state = _manager(tmp_path, keep_latest_k=1)
    assert resumed.load() == ["model", "train_state"]
    assert resumed_state.step == 4
    assert torch.equal(resumed_model.weight, saved_weights[4])
    resumed.close()


def test_purge_interrupted_after_the_rename_is_cleaned_up_at_start_up(tmp_path):
    manager, model, train_state = _manager(tmp_path, interval=5)
    _train_with_manager(manager, model, train_state, steps=5)
    folder = tmp_path / "checkpoint"
    # What _delete leaves when killed between its rename and its rmtree.
    doomed = folder / ".step-3.deleting"
    doomed.mkdir()
    (doomed / "__0_0.distcp").write_bytes(b"\0" * 100)
    (doomed / ".metadata").write_bytes(b"junk")
    assert list(complete_steps(folder)) == [5]

    resumed, _, resumed_state = _manager(tmp_path)  # start-up
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-5"]
    assert resumed.load() == ["model", "train_state"]
    assert resumed_state.step == 5
    resumed.close()


# --- 4. model-only last save -----------------------------------------------------------


@pytest.fixture(scope="module")
def model_only_run(two_rank_runs):
    runs = two_rank_runs
    return runs["model_only_dump"], runs["trained"][0], runs["before_resume"][0], runs["resumed"][0]


def test_model_only_last_save_holds_bf16_weights_only(model_only_run):
    dump, trained, before_resume, _ = model_only_run
    assert before_resume == ["step-2", "step-4"]
    path = dump / "checkpoint" / "step-4"
    weights = trained["weights"]
    # The weights and the model's description, which export tools read, and nothing else.
    assert top_level_names(path) == {name.split(".", 1)[0] for name in weights} | {"model_args"}
    assert not top_level_names(path) & (TRAINING_PARTS | {"model"})
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {name: item for name, item in metadata.items() if not name.startswith("model_args.")}
    assert set(tensors) == set(weights)
    for name, item in tensors.items():
        assert item.properties.dtype == torch.bfloat16, (name, item.properties.dtype)
        assert tuple(item.size) == tuple(weights[name].shape), name

    # The values are the trained float32 weights rounded to bf16.
    loaded = {name: torch.empty(value.shape, dtype=torch.bfloat16) for name, value in weights.items()}
    dcp.load(loaded, storage_reader=FileSystemReader(str(path)), no_dist=True)
    for name, value in weights.items():
        assert value.dtype == torch.float32, name
        assert torch.equal(loaded[name], value.to(torch.bfloat16)), name

    # The save before the last one is a full float32 checkpoint.
    full = dump / "checkpoint" / "step-2"
    assert top_level_names(full) >= TRAINING_PARTS
    full_metadata = FileSystemReader(str(full)).read_metadata().state_dict_metadata
    assert all(full_metadata[name].properties.dtype == torch.float32 for name in weights)


def test_resume_skips_the_model_only_save(model_only_run):
    dump, _, _, resumed = model_only_run
    assert resumed["start_step"] == 2
    assert resumed["steps"][0] == 3
    step2 = _load_everything(dump / "checkpoint" / "step-2")
    for name, value in resumed["start_weights"].items():
        assert torch.equal(value, step2[name]), name


# --- 5. SIGTERM ------------------------------------------------------------------------

# Runs each torchrun worker under bash to record its own exit status: torchrun reports
# none of them after it was signalled. The trap defers bash's own exit until the trainer
# (which gets the signal too: torchrun signals each worker's process group) has exited.
WORKER_WRAPPER = (
    'trap : TERM INT; "$0" -m titanlite.train "$@"; code=$?; echo "$code" > "$EXIT_DIR/rank-$RANK"; exit "$code"'
)


def _torchrun_command(dump: Path, log_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--log-dir",
        str(log_dir),
        "--tee",
        "3",
        "--no-python",
        "bash",
        "-c",
        WORKER_WRAPPER,
        sys.executable,
        "--job.dump_folder",
        str(dump),
        *CLI_ARGS,
        *args,
    ]


def _signal_after_step(command: list[str], env: dict, after_step: int) -> tuple[int, str, int | None]:
    """Start `command`, send it SIGTERM once it has logged `after_step`, and return its
    exit status, its output and the last step logged before the signal was sent."""
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(SUBPROCESS_TIMEOUT, process.terminate)
    watchdog.start()
    lines, signalled_after = [], None
    try:
        for line in process.stdout:
            lines.append(line)
            match = STEP_LINE.search(line)
            if signalled_after is None and match and int(match.group(1)) >= after_step:
                signalled_after = int(match.group(1))
                process.send_signal(signal.SIGTERM)
        returncode = process.wait()
    finally:
        watchdog.cancel()
    return returncode, "".join(lines), signalled_after


def _main_on_rank(argv: list[str]) -> tuple[int, str]:
    """train.py's main(argv) on this rank: its exit status and its log as console lines."""
    log = capture_log_lines()
    status = train_main(argv)
    return status, "".join(f"[titanlite] {line}\n" for line in log.lines)


def _worker_logs(log_dir: Path, rank: int) -> str:
    files = sorted(log_dir.glob(f"*/attempt_0/{rank}/std*.log"))
    assert len(files) == 2, files
    return "".join(path.read_text() for path in files)


def _stopped_torchrun_run(tmp_path: Path, *args: str) -> tuple[Path, Path, dict, int, str, int]:
    """Train on 2 ranks under torchrun with `args` until SIGTERM, sent to torchrun once step 3
    is logged, and check that every worker exited 0. Returns the dump folder, the log folder,
    the environment, torchrun's status, the output and the step logged before the signal."""
    dump, logs, exits = tmp_path / "run", tmp_path / "logs", tmp_path / "exits"
    exits.mkdir()
    env = dict(_env(), EXIT_DIR=str(exits))
    returncode, output, signalled_after = _signal_after_step(_torchrun_command(dump, logs, *args), env, after_step=3)
    assert signalled_after is not None, _describe(returncode, output)
    assert sorted(path.name for path in exits.iterdir()) == ["rank-0", "rank-1"], _describe(returncode, output)
    for rank in (0, 1):
        assert (exits / f"rank-{rank}").read_text().strip() == "0", _describe(returncode, output)
    return dump, logs, env, returncode, output, signalled_after


def test_sigterm_on_torchrun_saves_and_the_restart_continues_the_same_run(tmp_path):
    long_run = ["--training.steps", "150", "--checkpoint.enable", "--checkpoint.interval", "1000"]
    dump, logs, _, returncode, output, signalled_after = _stopped_torchrun_run(tmp_path, *long_run)

    # Every worker finished the step it was in, saved it, and exited 0 without a traceback.
    for rank in (0, 1):
        worker_output = _worker_logs(logs, rank)
        assert "Traceback" not in worker_output, worker_output[-4000:]
    stops = [int(step) for step in STOP_LINE.findall(output)]
    assert len(stops) == 2 and len(set(stops)) == 1, _describe(returncode, output)  # both ranks, the same step
    saved = stops[0]
    # The ranks compare their stop flags every SYNC_EVERY steps, not at every step.
    assert saved >= signalled_after and saved % SYNC_EVERY == 0, _describe(returncode, output)
    assert sorted(_logged_steps(output)) == list(range(1, saved + 1)), _describe(returncode, output)
    folder = dump / "checkpoint"
    assert f"checkpoint saved: {folder / f'step-{saved}'}" in output
    assert sorted(entry.name for entry in folder.iterdir()) == [f"step-{saved}"]
    assert list(complete_steps(folder)) == [saved]
    # torchrun itself turns the signal into exit status 1 with its own SignalException
    # traceback (torch 2.13), whatever the workers did; that is not asserted here.

    # Restart the same command for 3 more steps; an uninterrupted run of it for comparison.
    # Both run train.py's main on 2 forked ranks each (one launch) instead of under torchrun:
    # what torchrun adds (its signal handling) was tested above, and 6 more interpreters
    # importing torch would cost the suite about 18 s of CPU.
    until = ["--training.steps", str(saved + 3), "--checkpoint.enable", "--checkpoint.interval", "1000"]
    runs = {
        name: Job(2, _main_on_rank, (["--job.dump_folder", str(run_dump), *CLI_ARGS, *until],))
        for name, run_dump in (("restart", dump), ("reference", tmp_path / "reference"))
    }
    results = {name: ranks[0] for name, ranks in run_jobs_on_ranks(4, runs).items()}
    for name, (returncode, out) in results.items():
        assert returncode == 0, f"{name}: " + _describe(returncode, out)

    restart_out, reference_out = results["restart"][1], results["reference"][1]
    assert f"loaded checkpoint {folder / f'step-{saved}'} (" in restart_out, restart_out[-4000:]
    restarted = _logged_steps(restart_out)
    reference = _logged_steps(reference_out)
    following = [saved + 1, saved + 2, saved + 3]
    assert sorted(restarted) == following, restart_out[-4000:]
    assert sorted(reference) == list(range(1, saved + 4)), reference_out[-4000:]
    assert [restarted[step] for step in following] == [reference[step] for step in following]
    # The interrupted run itself matched the reference up to the step it saved.
    interrupted = _logged_steps(output)
    assert [interrupted[step] for step in range(1, saved + 1)] == [reference[step] for step in range(1, saved + 1)]


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_sigterm_with_async_with_pinned_mem_still_saves_and_exits_0(tmp_path, storage):
    """torchrun passes SIGTERM to each worker's process group (Slurm to every process of the
    step), so DCP's writer processes of async_with_pinned_mem die with any save they were
    writing. The stop saves in the rank processes instead: every rank exits 0 with a
    complete checkpoint no older than the last save begun before the signal; in object
    storage (a real S3 server) as well, an upload in flight included."""
    args = ["--training.steps", "150", "--checkpoint.enable", "--checkpoint.interval", "2"]
    args += ["--checkpoint.async_mode", "async_with_pinned_mem"]
    with s3_server() if storage == "s3" else contextlib.nullcontext():
        folder_url = f"s3://{BUCKET}/sigterm" if storage == "s3" else None
        dump, _, _, returncode, output, signalled_after = _stopped_torchrun_run(
            tmp_path, *args, *(["--checkpoint.folder", folder_url] if folder_url else [])
        )
        assert output.count("stop signal received") == 2, _describe(returncode, output)
        folder = location(folder_url) if folder_url else dump / "checkpoint"
        steps = list(complete_steps(folder))
        assert steps and steps[-1] >= signalled_after - signalled_after % 2, _describe(returncode, output)
        assert _load_everything(folder / f"step-{steps[-1]}")["train_state.step"] == steps[-1]


def test_sigterm_on_a_single_process_saves_and_exits_0(tmp_path):
    dump = tmp_path / "run"
    command = _train_command(dump, "--training.steps", "150", "--checkpoint.enable", "--checkpoint.interval", "1000")
    returncode, output, signalled_after = _signal_after_step(command, _env(), after_step=2)
    assert signalled_after is not None, _describe(returncode, output)
    assert returncode == 0, _describe(returncode, output)
    assert "Traceback" not in output, _describe(returncode, output)
    stops = [int(step) for step in STOP_LINE.findall(output)]
    assert len(stops) == 1 and stops[0] >= signalled_after, _describe(returncode, output)
    saved = stops[0]
    assert max(_logged_steps(output)) == saved
    folder = dump / "checkpoint"
    assert list(complete_steps(folder)) == [saved]
    assert _load_everything(folder / f"step-{saved}")["train_state.step"] == saved
    # How long the stop took, against the time the launchers would give it.
    assert re.search(r"stop signal: saved \d+\.\d s after it, of the 300 s the launchers give", output), output


# --- 6. async_with_pinned_mem under torch before 2.13 ------------------------------------


def _close_after_every_staging(monkeypatch) -> None:
    """DefaultStager as torch before 2.13 runs it: its staging.py differs from 2.13's (and
    its _state_dict_stager.py in nothing but an assert's form) in that _stage ends by
    closing the inner StateDictStager, as this does."""
    stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)


@pytest.mark.parametrize("kept_open", [True, False], ids=["kept-open", "as-torch-leaves-it"])
def test_async_with_pinned_mem_saves_again_under_torch_before_2_13(tmp_path, monkeypatch, kept_open):
    """The manager keeps its one stager open between saves where torch would close it; left
    as torch leaves it, the second save fails as it did on the lent GPU machines (2.11), as
    one CheckpointError whether the copy failed before async_save returned or after."""
    _close_after_every_staging(monkeypatch)
    monkeypatch.setattr(stager, "CLOSES_AFTER_EVERY_STAGING", kept_open)
    manager, model, train_state = _manager(tmp_path, interval=1, async_mode="async_with_pinned_mem")
    if not kept_open:
        with pytest.raises(
            CheckpointError, match=re.escape("step-2 in") + ".*" + re.escape("KeyError: <class 'type'>")
        ):
            _train_with_manager(manager, model, train_state, steps=2)
        return
    _train_with_manager(manager, model, train_state, steps=3)
    assert list(complete_steps(tmp_path / "checkpoint")) == [1, 2, 3]
    resumed, resumed_model, resumed_state = _manager(tmp_path)
    assert resumed.load() == ["model", "train_state"]
    assert resumed_state.step == 3
    assert torch.equal(resumed_model.weight, model.weight)  # step 3's weights, not an earlier save's
    resumed.close()
