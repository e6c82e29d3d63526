"""A run stopped after a checkpoint and resumed trains exactly like one that never stopped.

Every run trains the tiny model for 8 steps (global batch 8, float32, EMA with decay 0.9).
A run is interrupted the way a preempted job is: train_step() 4 times, save, and a new
Trainer on the same dump folder, which loads the newest checkpoint in its constructor and
whose train() runs the remaining steps. Its steps must match an uninterrupted run's:
bit for bit at the same layout, within 1e-5 at another world size. The reference for a
change of world size is the uninterrupted single-process run; the parity tests show that
every layout matches it within 1e-5.

Starting processes costs seconds, so one launch of 4 processes runs every scenario, each
a job on the ranks of its world size (tests.rank_jobs.run_jobs_on_ranks), one Trainer
(and process group) after another, and the tests compare what the four fixtures below
return:

* two_rank (FSDP over 2 ranks): the uninterrupted run, which saves every 2 steps; the
  same-layout resume for each async_mode; exclude_from_loading; load_step; initial_load_path.
* four_rank: an FSDP-4 run saved at step 4; the FSDP-2 step-4 checkpoint resumed on FSDP-4
  and on HSDP 2x2.
* single: the uninterrupted single-process run, with the full weights and EMA after every
  step; the FSDP-2 step-4 checkpoint resumed on one process.
* four_to_two: the FSDP-4 step-4 checkpoint resumed on 2 ranks.
* float8: an FSDP-2 float8 run (torchao, emulated; float8 all-gathers) saved at steps 4 and 8;
  its step-4 checkpoint resumed without float8. Its step-8 checkpoint is compared with the
  plain FSDP-2 run's and exported, in this process.
"""

import faulthandler
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import capture_log_lines, free_ports, full_tensor, full_weights, hf_tensors, tiny_args
from tests.rank_jobs import Job, forget_dtensor_caches, run_jobs_on_ranks
from titanlite.checkpoint import complete_steps
from titanlite.checkpoint.hf_export import export_to_hf
from titanlite.checkpoint.load import load_model
from titanlite.config import LRScheduler, parse_args
from titanlite.optim import wsd_factor
from titanlite.train import Trainer

STEPS = 8
SAVE_AT = 4
GLOBAL_BATCH = 8
LR = 3e-3
WARMUP = 2
EMA_DECAY = 0.9
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
# A worker that hangs (a rank waiting on a dead peer) dumps its stack and exits instead.
WORKER_TIMEOUT_S = 500

BASE_ARGS = tiny_args(
    {
        "training.local_batch_size": None,  # layout() sets it
        "training.global_batch_size": GLOBAL_BATCH,
        "training.steps": STEPS,
        "training.max_norm": 0.5,
        "optimizer.lr": LR,
        "lr_scheduler.warmup_steps": WARMUP,
        "ema.enable": True,
        "ema.decay": EMA_DECAY,
        "checkpoint.enable": True,
        # train() then saves only after the last step, unless a run asks for more.
        "checkpoint.interval": 1000,
        "comm.init_timeout_seconds": 120,
    }
)
# The train_state and data position a resume must restore.
POSITION_KEYS = ("step", "tokens_seen", "windows_consumed")


def layout(world_size: int, replicate: int = 1) -> list[str]:
    """The global batch stays 8 sequences: each data-parallel rank reads 8 / world_size of it."""
    args = [f"--training.local_batch_size={GLOBAL_BATCH // world_size}"]
    if replicate > 1:
        args.append(f"--parallelism.data_parallel_replicate_degree={replicate}")
    return args


# --- what runs inside the rank processes ------------------------------------------------


class Session:
    """Builds Trainers one after another in a rank process, each in a process group of its
    own. Re-creating the default group on the same port can hang, so each gets a new port."""

    def __init__(self, ports: list[int]):
        self.ports = list(ports)
        faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)

    def trainer(self, *args: list[str] | str) -> Trainer:
        self.end()
        os.environ["MASTER_PORT"] = str(self.ports.pop())
        flat = [arg for group in args for arg in ([group] if isinstance(group, str) else group)]
        trainer = Trainer(parse_args(BASE_ARGS + flat))
        # The trainer turns SIGTERM into "save and stop"; when another rank fails, the
        # launcher's SIGTERM must end this one.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return trainer

    def end(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_dtensor_caches()


def position(trainer: Trainer) -> dict:
    return {
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "windows_consumed": trainer.loader.windows_consumed,
    }


def optimizer_summary(trainer: Trainer) -> dict:
    states = trainer.optimizer.state.values()
    return {
        "state_keys": sorted({key for state in states for key in state}),
        "adam_steps": sorted({int(full_tensor(state["step"]).item()) for state in states if "step" in state}),
        "param_group_lr": trainer.optimizer.param_groups[0]["lr"],
        "scheduler_lr": trainer.lr_scheduler.get_last_lr()[0],
    }


def loaded_state(trainer: Trainer) -> dict:
    """What a freshly built Trainer holds: read before its first step."""
    return (
        position(trainer)
        | optimizer_summary(trainer)
        | {"weights": full_weights(trainer.model), "ema": full_weights(trainer.ema)}
    )


def record_batches(trainer: Trainer) -> dict:
    """step -> the rows of `inputs` this rank trained on in that step (all micro-batches)."""
    batches = {}
    next_batch = trainer.loader.next_batch

    def recording_next_batch():
        inputs, labels = next_batch()
        batches.setdefault(trainer.step + 1, []).extend(tuple(row) for row in inputs.tolist())
        return inputs, labels

    trainer.loader.next_batch = recording_next_batch
    return batches


def record_after_each_step(trainer: Trainer) -> list:
    """The position, full weights and full EMA after every train_step, and the learning rate
    it ran at, in step order."""
    after = []
    train_step = trainer.train_step

    def recording_train_step():
        lr = trainer.optimizer.param_groups[0]["lr"]
        result = train_step()
        weights = {"weights": full_weights(trainer.model), "ema": full_weights(trainer.ema)}
        after.append(position(trainer) | weights | {"lr": lr})
        return result

    trainer.train_step = recording_train_step
    return after


def train_to_end(trainer: Trainer) -> dict:
    batches = record_batches(trainer)
    records = trainer.train()
    return {
        "steps": [r.step for r in records],
        "loss": [r.loss for r in records],
        "grad_norm": [r.grad_norm for r in records],
        "lr": [r.lr for r in records],
        "batches": batches,
        "end": position(trainer),
        "weights": full_weights(trainer.model),
        "ema": full_weights(trainer.ema),
    }


def uninterrupted(session: Session, *args) -> dict:
    trainer = session.trainer(*args)
    initial = {"initial": full_weights(trainer.model), "initial_ema": full_weights(trainer.ema)}
    after = record_after_each_step(trainer)
    return train_to_end(trainer) | initial | {"after": after}


def copy_folder(source: str | Path, destination: str | Path) -> None:
    """Rank 0 copies and renames into place; the other ranks wait until the copy appears."""
    destination = Path(destination)
    if os.environ.get("RANK", "0") == "0":
        partial = destination.with_name(destination.name + ".copying")
        shutil.copytree(source, partial)
        os.replace(partial, destination)
        return
    deadline = time.monotonic() + 120
    while not destination.exists():
        assert time.monotonic() < deadline, f"rank 0 did not copy {source} to {destination}"
        time.sleep(0.05)


def copy_checkpoint(step_folder: str, dump_folder: str) -> str:
    """A new dump folder whose checkpoint folder holds a copy of `step_folder` only."""
    (Path(dump_folder) / "checkpoint").mkdir(parents=True, exist_ok=True)
    copy_folder(step_folder, Path(dump_folder) / "checkpoint" / Path(step_folder).name)
    return dump_folder


def resume(session: Session, *args) -> dict:
    trainer = session.trainer(*args)
    loaded = loaded_state(trainer)
    return train_to_end(trainer) | {"loaded": loaded}


def interrupt_after_save(trainer: Trainer) -> None:
    for _ in range(SAVE_AT):
        trainer.train_step()
    trainer.checkpointer.save(trainer.step)
    # Train on while an async save may still be writing: the checkpoint must hold step 4.
    trainer.train_step()
    trainer.train_step()
    trainer.checkpointer.close()


def two_rank_worker(dump: str, ports: list[int]) -> dict:
    session, fsdp2, out = Session(ports), layout(2), {}
    out["straight"] = uninterrupted(session, fsdp2, "--checkpoint.interval=2", f"--job.dump_folder={dump}/straight")

    for mode in ASYNC_MODES:
        args = (fsdp2, f"--checkpoint.async_mode={mode}", f"--job.dump_folder={dump}/{mode}")
        interrupt_after_save(session.trainer(*args))
        out[mode] = resume(session, *args)

    saved = f"{dump}/straight/checkpoint/step-{SAVE_AT}"
    trainer = session.trainer(
        fsdp2,
        "--checkpoint.exclude_from_loading=optimizer,lr_scheduler",
        f"--job.dump_folder={copy_checkpoint(saved, f'{dump}/exclude')}",
    )
    loaded = loaded_state(trainer)
    batches = record_batches(trainer)
    loss_share, grad_norm = trainer.train_step()
    out["exclude"] = {
        "loaded": loaded,
        "batches": batches,
        "loss": trainer.global_loss(loss_share)[0],
        "grad_norm": grad_norm.item(),
        "after_step": optimizer_summary(trainer),
    }
    trainer.checkpointer.close()

    # Every checkpoint of the uninterrupted run (steps 2, 4, 6, 8): load_step must pick step 2.
    Path(dump, "load_step").mkdir(exist_ok=True)
    copy_folder(f"{dump}/straight/checkpoint", f"{dump}/load_step/checkpoint")
    available = sorted(complete_steps(Path(dump) / "load_step" / "checkpoint"))
    args = (fsdp2, "--checkpoint.interval=2", f"--job.dump_folder={dump}/load_step")
    out["load_step"] = resume(session, *args, "--checkpoint.load_step=2") | {"available": available}
    try:
        session.trainer(*args, "--checkpoint.load_step=3").checkpointer.close()
        out["missing_load_step"] = {"type": "no error", "message": ""}
    except Exception as error:
        out["missing_load_step"] = {"type": type(error).__name__, "message": str(error)}

    initial = f"--checkpoint.initial_load_path={saved}"
    args = (fsdp2, initial, f"--job.dump_folder={dump}/initial_model_only")
    trainer = session.trainer(*args)
    first = loaded_state(trainer)
    trainer.train_step()
    trainer.train_step()
    own = position(trainer) | {"weights": full_weights(trainer.model)}
    trainer.checkpointer.save(trainer.step)
    trainer.checkpointer.close()
    trainer = session.trainer(*args)
    out["initial_model_only"] = {"loaded": first, "own": own, "reloaded": loaded_state(trainer)}
    trainer.checkpointer.close()

    out["initial_full"] = resume(
        session, fsdp2, initial, "--checkpoint.initial_load_model_only=false", f"--job.dump_folder={dump}/initial_full"
    )
    session.end()
    return out


def four_rank_worker(dump: str, ports: list[int], fsdp2_step_folder: str) -> dict:
    session, out = Session(ports), {}
    trainer = session.trainer(layout(4), f"--job.dump_folder={dump}/fsdp4")
    for _ in range(SAVE_AT):
        trainer.train_step()
    out["saved"] = position(trainer) | {"weights": full_weights(trainer.model), "ema": full_weights(trainer.ema)}
    trainer.checkpointer.save(trainer.step)
    trainer.checkpointer.close()
    for name, replicate in (("fsdp4", 1), ("hsdp2x2", 2)):
        folder = copy_checkpoint(fsdp2_step_folder, f"{dump}/from_fsdp2_to_{name}")
        out[name] = resume(session, layout(4, replicate), f"--job.dump_folder={folder}")
    session.end()
    return out


def single_worker(dump: str, fsdp2_step_folder: str) -> dict:
    session = Session([0] * 16)  # no process group on one rank: the ports go unused
    log = capture_log_lines()
    out = {
        "straight": uninterrupted(session, layout(1), f"--job.dump_folder={dump}/straight"),
        "resumed": resume(
            session, layout(1), f"--job.dump_folder={copy_checkpoint(fsdp2_step_folder, f'{dump}/from_fsdp2')}"
        ),
    }
    out["resumed"]["warnings"] = log.warnings()
    out |= changed_schedule(session, dump)
    # With global_batch_size -1, one rank's batch is half the two ranks' batch of the checkpoint.
    log = capture_log_lines()
    folder = copy_checkpoint(fsdp2_step_folder, f"{dump}/half_batch")
    session.trainer(layout(1), HALF_BATCH, f"--job.dump_folder={folder}").checkpointer.close()
    out["half_batch_warnings"] = log.warnings()
    # One process has no process group: every async mode must still save and resume.
    for mode in ASYNC_MODES:
        args = (layout(1), f"--checkpoint.async_mode={mode}", f"--job.dump_folder={dump}/{mode}")
        interrupt_after_save(session.trainer(*args))
        out[mode] = resume(session, *args)
    return out


# Steps 1-4 run at the same rates under both schedules (warmup 2, then the peak); at step 5
# the old one is decaying (decay over the last 4 of 8 steps) and the new one is not (last 5 of 10).
OLD_SCHEDULE = ["--training.steps=8", "--lr_scheduler.decay_ratio=0.5"]
NEW_STEPS = 10
NEW_SCHEDULE = [f"--training.steps={NEW_STEPS}", "--lr_scheduler.decay_ratio=0.5", "--metrics.log_freq=4"]
HALF_BATCH = ["--training.global_batch_size=-1", f"--training.local_batch_size={GLOBAL_BATCH // 2}"]


def changed_schedule(session: Session, dump: str) -> dict:
    """The first 5 steps of a run with the new schedule from the start, and a run of the old
    schedule saved at step 4 and resumed with the new one."""
    trainer = session.trainer(layout(1), NEW_SCHEDULE, f"--job.dump_folder={dump}/new_schedule")
    new = record_after_each_step(trainer)
    for _ in range(SAVE_AT + 1):
        trainer.train_step()
    trainer.checkpointer.close()
    trainer = session.trainer(layout(1), OLD_SCHEDULE, f"--job.dump_folder={dump}/old_schedule")
    old = record_after_each_step(trainer)
    for _ in range(SAVE_AT + 1):  # the fifth only for its rate: the save holds step 4
        trainer.train_step()
        if trainer.step == SAVE_AT:
            trainer.checkpointer.save(trainer.step)
    trainer.checkpointer.close()
    trainer = session.trainer(layout(1), NEW_SCHEDULE, f"--job.dump_folder={dump}/old_schedule")
    loaded, after = loaded_state(trainer), record_after_each_step(trainer)
    resumed = train_to_end(trainer) | {"loaded": loaded, "after": after}
    return {"new_schedule": new, "old_schedule": old, "schedule_changed": resumed}


def four_to_two_worker(dump: str, ports: list[int], fsdp4_step_folder: str) -> dict:
    session = Session(ports)
    out = {"resumed": resume(session, layout(2), f"--job.dump_folder={copy_checkpoint(fsdp4_step_folder, dump)}")}
    session.end()
    return out


# FSDP 2 with torchao's float8 (emulated on the CPU; every linear layer but the output), its
# weights all-gathered in float8 with their scales worked out after each optimizer step: the
# layout where the weights are float8-aware tensor subclasses.
FLOAT8 = [
    "--model.converters=float8",
    "--quantize.linear.float8.emulate",
    "--quantize.linear.float8.skip_small_layers=false",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
]


def float8_worker(dump: str, ports: list[int]) -> dict:
    """The float8 run, saving after steps 4 and 8; its step-4 checkpoint resumed without float8."""
    session = Session(ports)
    out = {
        "float8": uninterrupted(
            session, layout(2), FLOAT8, f"--checkpoint.interval={SAVE_AT}", f"--job.dump_folder={dump}/float8"
        )
    }
    folder = copy_checkpoint(f"{dump}/float8/checkpoint/step-{SAVE_AT}", f"{dump}/float8_to_plain")
    out["float8_to_plain"] = resume(session, layout(2), f"--job.dump_folder={folder}")
    session.end()
    return out


# --- fixtures: every scenario in one launch of 4 processes ---------------------------------


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """The four scenarios, as jobs of one launch; each job's dump folder and its results."""
    names = ("two_rank", "four_rank", "single", "four_to_two", "float8")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    fsdp2_step_folder = str(dumps["two_rank"] / "straight" / "checkpoint" / f"step-{SAVE_AT}")
    fsdp4_step_folder = str(dumps["four_rank"] / "fsdp4" / "checkpoint" / f"step-{SAVE_AT}")
    jobs = {  # in dependency order: a job's ranks take it after their earlier ones
        "two_rank": Job(2, two_rank_worker, (str(dumps["two_rank"]), free_ports(20))),
        "four_rank": Job(4, four_rank_worker, (str(dumps["four_rank"]), free_ports(6), fsdp2_step_folder)),
        "single": Job(1, single_worker, (str(dumps["single"]), fsdp2_step_folder)),
        "four_to_two": Job(2, four_to_two_worker, (str(dumps["four_to_two"]), free_ports(4), fsdp4_step_folder)),
        "float8": Job(2, float8_worker, (str(dumps["float8"]), free_ports(4))),
    }
    results = run_jobs_on_ranks(4, jobs)
    return {name: (dumps[name], results[name]) for name in jobs}


@pytest.fixture(scope="module")
def two_rank(launch):
    return launch["two_rank"]


@pytest.fixture(scope="module")
def four_rank(launch):
    return launch["four_rank"]


@pytest.fixture(scope="module")
def single(launch):
    return launch["single"]


@pytest.fixture(scope="module")
def four_to_two(launch):
    return launch["four_to_two"]


@pytest.fixture(scope="module")
def float8(launch):
    return launch["float8"]


# --- checks ------------------------------------------------------------------------------


def positions(state: dict) -> dict:
    return {key: state[key] for key in POSITION_KEYS}


def assert_bit_identical(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max diff {(actual[name] - value).abs().max().item()}"


def assert_close_tensors(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=atol, msg=name)


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a if a[name].is_floating_point())


def test_uninterrupted_runs_change_every_step(two_rank, single):
    # Guards every comparison below: runs that did not move would match trivially.
    for straight in (two_rank[1][0]["straight"], single[1][0]["straight"]):
        assert straight["steps"] == list(range(1, STEPS + 1))
        assert straight["loss"][-1] < straight["loss"][0] - 0.1
        assert len(set(straight["loss"])) == STEPS
        snapshots = [straight["initial"]] + [after["weights"] for after in straight["after"]]
        for before, after in zip(snapshots, snapshots[1:], strict=False):
            assert max_difference(before, after) > 1e-4
        # Different data every step.
        rows = [tuple(sorted(straight["batches"][step])) for step in range(1, STEPS + 1)]
        assert len(set(rows)) == STEPS


# 1. Exact resume at the same world size ---------------------------------------------------


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_resume_same_world_size_is_bit_identical(two_rank, mode):
    for rank in two_rank[1]:
        assert_resumed_like_straight(rank["straight"], rank[mode])


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_resume_single_process_is_bit_identical(single, mode):
    assert_resumed_like_straight(single[1][0]["straight"], single[1][0][mode])


def assert_resumed_like_straight(straight: dict, resumed: dict) -> None:
    at_save = straight["after"][SAVE_AT - 1]
    assert positions(resumed["loaded"]) == positions(at_save)
    assert resumed["loaded"]["windows_consumed"] == SAVE_AT * GLOBAL_BATCH
    assert resumed["loaded"]["tokens_seen"] == SAVE_AT * GLOBAL_BATCH * 32
    # The checkpoint holds step 4 although the run trained on while it was written.
    assert_bit_identical(resumed["loaded"]["weights"], at_save["weights"])
    assert resumed["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed["loss"] == straight["loss"][SAVE_AT:]
    assert resumed["grad_norm"] == straight["grad_norm"][SAVE_AT:]
    assert resumed["lr"] == straight["lr"][SAVE_AT:]
    assert resumed["batches"] == {step: straight["batches"][step] for step in range(SAVE_AT + 1, STEPS + 1)}
    assert_bit_identical(resumed["weights"], straight["weights"])
    assert resumed["end"] == straight["end"]


# 2. Resume at another world size ------------------------------------------------------------

# name -> (fixture, key of the resumed run in its result, where the checkpoint came from)
WORLD_SIZE_CHANGES = {
    "fsdp4_to_fsdp2": ("four_to_two", "resumed", "fsdp4"),
    "fsdp2_to_fsdp4": ("four_rank", "fsdp4", "fsdp2"),
    "fsdp2_to_hsdp2x2": ("four_rank", "hsdp2x2", "fsdp2"),
    "fsdp2_to_single": ("single", "resumed", "fsdp2"),
}


def saved_state(request, source: str) -> dict:
    """Position, weights and EMA of the run that wrote the step-4 checkpoint, as it saved them."""
    if source == "fsdp2":
        return request.getfixturevalue("two_rank")[1][0]["straight"]["after"][SAVE_AT - 1]
    return request.getfixturevalue("four_rank")[1][0]["saved"]


@pytest.mark.parametrize("change", WORLD_SIZE_CHANGES)
def test_resume_at_another_world_size(request, single, change):
    fixture, key, source = WORLD_SIZE_CHANGES[change]
    runs = [rank[key] for rank in request.getfixturevalue(fixture)[1]]
    reference = single[1][0]["straight"]  # the uninterrupted single-process run
    saved = saved_state(request, source)
    for run in runs:
        assert positions(run["loaded"]) == positions(reference["after"][SAVE_AT - 1]) == positions(saved)
        # Resharding moves the saved numbers, it does not recompute them.
        assert_bit_identical(run["loaded"]["weights"], saved["weights"])
        assert run["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert run["end"] == reference["end"]
    run = runs[0]
    torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(reference["loss"][SAVE_AT:]), rtol=1e-5, atol=0)
    torch.testing.assert_close(
        torch.tensor(run["grad_norm"]), torch.tensor(reference["grad_norm"][SAVE_AT:]), rtol=1e-5, atol=0
    )
    # The same global batches: the union over ranks and micro-steps, as a multiset of rows.
    for step in range(SAVE_AT + 1, STEPS + 1):
        global_batch = sorted(row for rank_run in runs for row in rank_run["batches"][step])
        assert global_batch == sorted(reference["batches"][step]), f"step {step}"
    assert_close_tensors(run["weights"], reference["weights"], atol=1e-5)


# 3. EMA ------------------------------------------------------------------------------------


def test_ema_is_the_running_average_of_the_weights(single):
    straight = single[1][0]["straight"]
    floating = [name for name, value in straight["initial"].items() if value.is_floating_point()]
    assert sorted(straight["initial_ema"]) == sorted(floating)
    expected = {name: straight["initial"][name].double() for name in floating}
    for step, after in enumerate(straight["after"], start=1):
        for name in floating:
            expected[name] = EMA_DECAY * expected[name] + (1 - EMA_DECAY) * after["weights"][name].double()
        assert sorted(after["ema"]) == sorted(floating)
        for name in floating:
            torch.testing.assert_close(
                after["ema"][name], expected[name].float(), rtol=1e-6, atol=1e-6, msg=f"step {step} {name}"
            )
    # The average lags well behind the weights, so the check above is not one of the weights.
    last = straight["after"][-1]
    assert max_difference(last["ema"], last["weights"]) > 1e-3


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_ema_survives_resume_same_world_size(two_rank, mode):
    for rank in two_rank[1]:
        straight, resumed = rank["straight"], rank[mode]
        assert_bit_identical(resumed["loaded"]["ema"], straight["after"][SAVE_AT - 1]["ema"])
        assert_bit_identical(resumed["ema"], straight["ema"])


def test_ema_survives_resume_two_ranks_to_one(two_rank, single):
    saved = two_rank[1][0]["straight"]["after"][SAVE_AT - 1]
    reference, resumed = single[1][0]["straight"], single[1][0]["resumed"]
    assert_bit_identical(resumed["loaded"]["ema"], saved["ema"])
    # A fresh EMA (the initial weights) would be far from the saved one.
    assert max_difference(saved["ema"], reference["initial_ema"]) > 1e-3
    assert_close_tensors(resumed["ema"], reference["ema"], atol=1e-5)


# 4. exclude_from_loading --------------------------------------------------------------------


def test_exclude_from_loading_keeps_a_fresh_optimizer_and_schedule(two_rank):
    for rank in two_rank[1]:
        straight, normal, excluded = rank["straight"], rank["disabled"]["loaded"], rank["exclude"]
        at_save, loaded = straight["after"][SAVE_AT - 1], excluded["loaded"]
        # The model and the data position are loaded.
        assert positions(loaded) == positions(at_save)
        assert_bit_identical(loaded["weights"], at_save["weights"])
        # A normal resume brings back Adam's moments and the step-5 learning rate ...
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(normal["state_keys"])
        assert normal["adam_steps"] == [SAVE_AT]
        assert normal["param_group_lr"] == normal["scheduler_lr"] == straight["lr"][SAVE_AT]
        # ... this one starts both afresh: no moments, warmup's first learning rate.
        assert loaded["state_keys"] == [] and loaded["adam_steps"] == []
        first_warmup_lr = LR * 1 / (WARMUP + 1)
        assert loaded["param_group_lr"] == pytest.approx(first_warmup_lr, rel=1e-12)
        assert loaded["scheduler_lr"] == pytest.approx(first_warmup_lr, rel=1e-12)
        assert straight["lr"][SAVE_AT] != pytest.approx(first_warmup_lr)
        # Step 5 sees the step-4 weights and the step-5 batch, and is Adam's first step.
        assert excluded["batches"] == {SAVE_AT + 1: straight["batches"][SAVE_AT + 1]}
        assert excluded["loss"] == straight["loss"][SAVE_AT]
        assert excluded["grad_norm"] == straight["grad_norm"][SAVE_AT]
        assert {"exp_avg", "exp_avg_sq"} <= set(excluded["after_step"]["state_keys"])
        assert excluded["after_step"]["adam_steps"] == [1]


# 5. load_step ------------------------------------------------------------------------------


def test_load_step_resumes_from_that_step(two_rank):
    for rank in two_rank[1]:
        straight, run = rank["straight"], rank["load_step"]
        # Newer checkpoints exist, so the newest-first default would not pick step 2.
        assert 2 in run["available"] and max(run["available"]) > 2
        assert positions(run["loaded"]) == positions(straight["after"][1])
        assert_bit_identical(run["loaded"]["weights"], straight["after"][1]["weights"])
        assert run["steps"] == list(range(3, STEPS + 1))
        assert run["loss"] == straight["loss"][2:]
        assert run["grad_norm"] == straight["grad_norm"][2:]
        assert run["batches"] == {step: straight["batches"][step] for step in range(3, STEPS + 1)}
        assert_bit_identical(run["weights"], straight["weights"])


def test_missing_load_step_is_a_checkpoint_error(two_rank):
    folder = str(two_rank[0] / "load_step" / "checkpoint")
    for rank in two_rank[1]:
        error = rank["missing_load_step"]
        assert error["type"] == "CheckpointError", error
        assert "checkpoint.load_step" in error["message"]
        assert folder in error["message"]


# 6. initial_load_path ----------------------------------------------------------------------


def test_initial_load_path_loads_model_weights_only_by_default(two_rank):
    for rank in two_rank[1]:
        straight, loaded = rank["straight"], rank["initial_model_only"]["loaded"]
        assert positions(loaded) == {"step": 0, "tokens_seen": 0, "windows_consumed": 0}
        assert loaded["state_keys"] == []
        assert loaded["scheduler_lr"] == pytest.approx(LR / (WARMUP + 1), rel=1e-12)
        assert_bit_identical(loaded["weights"], straight["after"][SAVE_AT - 1]["weights"])
        assert max_difference(loaded["weights"], straight["initial"]) > 1e-4
        # The EMA starts at the loaded weights, not at the random initial ones.
        assert_bit_identical(loaded["ema"], {name: loaded["weights"][name] for name in loaded["ema"]})


def test_initial_load_path_with_everything_continues_the_run(two_rank):
    for rank in two_rank[1]:
        straight, run = rank["straight"], rank["initial_full"]
        assert positions(run["loaded"]) == positions(straight["after"][SAVE_AT - 1])
        assert run["loaded"]["adam_steps"] == [SAVE_AT]
        assert run["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert run["loss"] == straight["loss"][SAVE_AT:]
        assert run["grad_norm"] == straight["grad_norm"][SAVE_AT:]
        assert run["batches"] == {step: straight["batches"][step] for step in range(SAVE_AT + 1, STEPS + 1)}
        assert_bit_identical(run["weights"], straight["weights"])
        assert_bit_identical(run["ema"], straight["ema"])


def test_own_checkpoint_wins_over_initial_load_path(two_rank):
    for rank in two_rank[1]:
        run = rank["initial_model_only"]
        assert positions(run["reloaded"]) == positions(run["own"])
        assert run["reloaded"]["step"] == 2
        assert_bit_identical(run["reloaded"]["weights"], run["own"]["weights"])
        # Reloading initial_load_path instead would give these weights back.
        assert max_difference(run["own"]["weights"], run["loaded"]["weights"]) > 1e-4


# 6. A resume that changes the schedule or the global batch ------------------------------------


def test_a_resume_with_a_changed_schedule_runs_its_first_step_on_the_new_schedule(single):
    out = single[1][0]
    new, old, resumed = out["new_schedule"], out["old_schedule"], out["schedule_changed"]
    new_schedule = LRScheduler(warmup_steps=WARMUP, decay_ratio=0.5)
    # The two schedules agree up to the save and part at step 5, where the old one decays.
    assert [after["lr"] for after in new[:SAVE_AT]] == [after["lr"] for after in old[:SAVE_AT]]
    assert old[SAVE_AT]["lr"] < new[SAVE_AT]["lr"] == LR * wsd_factor(SAVE_AT, NEW_STEPS, new_schedule) == LR
    assert_bit_identical(resumed["loaded"]["weights"], new[SAVE_AT - 1]["weights"])
    # The first resumed step runs at the new schedule's rate, logged as such, and makes the
    # same update as the run that had the new schedule from the start; the steps after
    # follow the new schedule.
    assert resumed["after"][0]["lr"] == resumed["lr"][0] == new[SAVE_AT]["lr"]
    assert_bit_identical(resumed["after"][0]["weights"], new[SAVE_AT]["weights"])
    expected = [LR * wsd_factor(step, NEW_STEPS, new_schedule) for step in range(SAVE_AT, NEW_STEPS)]
    assert [after["lr"] for after in resumed["after"]] == pytest.approx(expected, rel=1e-12)


def test_a_resumed_run_logs_its_first_step(single):
    # log_freq 4: the first resumed step is logged, then steps 8 and the last.
    assert single[1][0]["schedule_changed"]["steps"] == [SAVE_AT + 1, 8, NEW_STEPS]


def test_a_resume_that_changes_the_global_batch_warns_once(single):
    out = single[1][0]
    (warning,) = [line for line in out["half_batch_warnings"] if "global batch" in line]
    assert f"a global batch of {GLOBAL_BATCH // 2} sequences where the checkpoint's run used {GLOBAL_BATCH}" in warning
    assert f"training.global_batch_size = {GLOBAL_BATCH}" in warning
    # The same global batch on another number of ranks: no warning.
    assert not any("global batch" in line for line in out["resumed"]["warnings"])


# --- a float8 checkpoint ---------------------------------------------------------------------


def test_a_float8_checkpoint_resumes_without_float8(float8):
    out = float8[1][0]
    straight, resumed = out["float8"], out["float8_to_plain"]
    assert straight["loss"][-1] < straight["loss"][0] - 0.1  # the float8 run learns
    # What the float8 run held at its save comes back whole, into plain Linear layers ...
    assert positions(resumed["loaded"]) == positions(straight["after"][SAVE_AT - 1])
    assert_bit_identical(resumed["loaded"]["weights"], straight["after"][SAVE_AT - 1]["weights"])
    assert_bit_identical(resumed["loaded"]["ema"], straight["after"][SAVE_AT - 1]["ema"])
    # ... and trains on in high precision, close to where float8 went.
    assert resumed["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
    assert resumed["loss"] == pytest.approx(straight["loss"][SAVE_AT:], rel=2e-2)
    assert resumed["loss"] != straight["loss"][SAVE_AT:]


def test_a_float8_checkpoint_and_its_export_are_a_plain_runs(float8, two_rank, tmp_path):
    """Same names, shapes and dtypes in the checkpoint as an FSDP run without float8 saves, and
    an export that holds the float8 run's high-precision weights."""
    float8_step, plain_step = (
        fixture[0] / run / "checkpoint" / f"step-{STEPS}"
        for fixture, run in ((float8, "float8"), (two_rank, "straight"))
    )
    entries = [FileSystemReader(str(step)).read_metadata().state_dict_metadata for step in (float8_step, plain_step)]
    assert entries[0].keys() == entries[1].keys()
    for name, entry in entries[1].items():
        if hasattr(entry, "size"):
            assert (entries[0][name].size, entries[0][name].properties.dtype) == (entry.size, entry.properties.dtype), (
                name
            )
    # The weights, moments and EMA copies torchao wraps in a subclass are stored as the plain
    # tensors they wrap: no file needs torchao to be read.
    assert not any(b"torchao" in file.read_bytes() for file in float8_step.glob("*.distcp"))
    model, _ = load_model(float8_step)
    assert_bit_identical(full_weights(model), float8[1][0]["float8"]["weights"])
    exported = [
        hf_tensors(export_to_hf(step, tmp_path / step.parent.parent.name)) for step in (float8_step, plain_step)
    ]
    assert {name: (t.shape, t.dtype) for name, t in exported[0].items()} == {
        name: (t.shape, t.dtype) for name, t in exported[1].items()
    }
    weights = full_weights(model)  # float32, as the export writes them by default
    assert torch.equal(exported[0]["model.layers.0.mlp.down_proj.weight"], weights["layers.0.feed_forward.w2.weight"])
