"""Damaged checkpoints and failed saves: every case ends in a CheckpointError that names the
file or the step (or, by choice, in a loud log line), never in silence or a traceback.

* Corruption: a truncated shard, a shard whose zip structure is damaged, a damaged
  .metadata, and a bit flipped in tensor data, which only the integrity manifest
  (checkpoint.verify_integrity) catches.
* Write errors: ENOSPC or EIO injected into DCP's filesystem writer during a synchronous and
  an asynchronous save; the partial folder is removed, the earlier checkpoint stays and a
  new run resumes from it; with continue_on_save_error training goes on, unless the
  failed save is the run's final one (last step or stop signal).
* The save on a stop signal: a save still being written is waited for and is the last one
  (the resume from it is exact); one that fails is replaced by a save of the stop's step.

Most tests drive a CheckpointManager over a small Linear model in this process; the last
ones run the trainer's main() on the tiny model.
"""

import errno
import json
import logging
import os
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint import FileSystemWriter

import titanlite.checkpoint.manager as manager_module
from tests.helpers import NoArgs, StepCounter, tiny_args
from tests.rank_jobs import run_on_ranks
from titanlite.checkpoint import CheckpointError, CheckpointManager, ModelDescription, ModelState, complete_steps
from titanlite.config import Checkpoint

SHARD = "__0_0.distcp"


class Run:
    """A Linear "model" and a step counter under a CheckpointManager, as a trainer has them."""

    def __init__(self, dump: Path, **options):
        torch.manual_seed(0)
        self.model, self.train_state = torch.nn.Linear(8, 8), StepCounter()
        states = {
            "model": ModelState(self.model, ModelDescription("linear", "8x8", NoArgs())),
            "train_state": self.train_state,
        }
        self.manager = CheckpointManager(states, Checkpoint(enable=True, keep_latest_k=0, **options), str(dump))
        self.saved: dict[int, torch.Tensor] = {}

    def step_and_save(self, step: int, sync: bool = False) -> None:
        with torch.no_grad():
            self.model.weight.add_(1.0)
        self.train_state.step = step
        self.saved[step] = self.model.weight.detach().clone()
        self.manager.save(step, sync=sync)


def _saved_run(dump: Path, steps=(2, 4), **options) -> Run:
    run = Run(dump, **options)
    for step in steps:
        run.step_and_save(step)
    run.manager.close()
    return run


def _resume(dump: Path, **options) -> Run:
    run = Run(dump, **options)
    run.manager.load()
    return run


def _step_folder(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


def _flip_bit_in_weights(shard: Path, weight: torch.Tensor) -> None:
    """Flip one bit in the middle of the stored bytes of `weight` (raw float32 in the zip)."""
    data = bytearray(shard.read_bytes())
    start = bytes(data).find(weight.numpy().tobytes())
    assert start >= 0, "the weight's bytes are not stored verbatim in the shard"
    data[start + weight.numel() * 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _dotted(path: Path) -> str:
    return re.escape(f"{path.parent.name}/{path.name}")


# --- corruption --------------------------------------------------------------------------


def test_truncated_shard_is_named_and_an_earlier_step_still_loads(tmp_path):
    run = _saved_run(tmp_path)
    shard = _step_folder(tmp_path, 4) / SHARD
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=_dotted(shard) + r": truncated, \d+ bytes but .* up to byte \d+"):
        _resume(tmp_path)
    resumed = _resume(tmp_path, load_step=2)  # the message's advice
    assert resumed.train_state.step == 2
    assert torch.equal(resumed.model.weight, run.saved[2])


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_metadata_is_named(tmp_path, damage):
    _saved_run(tmp_path)
    metadata = _step_folder(tmp_path, 4) / ".metadata"
    if damage == "truncated":
        os.truncate(metadata, 50)
    else:
        metadata.write_bytes(metadata.read_bytes()[:40] + b"\xff" * 20 + metadata.read_bytes()[60:])
    with pytest.raises(CheckpointError, match=_dotted(metadata) + ": cannot read the checkpoint metadata"):
        _resume(tmp_path)


def test_shard_with_a_damaged_zip_structure_is_named_by_the_reader(tmp_path):
    _saved_run(tmp_path)
    shard = _step_folder(tmp_path, 4) / SHARD
    data = bytearray(shard.read_bytes())
    data[-22:] = b"\0" * 22  # the end record of the last item's zip archive; the size stays the same
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=_dotted(shard) + r": cannot be read, the file is damaged \(\w+Error"):
        _resume(tmp_path)


def test_bit_flip_in_tensor_data_loads_silently_without_the_manifest(tmp_path):
    """DCP stores tensors without a checksum: a flipped bit in the data loads as a changed
    weight. This is what verify_integrity is for."""
    run = _saved_run(tmp_path)
    _flip_bit_in_weights(_step_folder(tmp_path, 4) / SHARD, run.saved[4])
    resumed = _resume(tmp_path)
    assert resumed.train_state.step == 4
    differs = resumed.model.weight != run.saved[4]
    assert differs.sum() == 1


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    _saved_run(tmp_path, verify_integrity=True)
    folder = _step_folder(tmp_path, 4)
    manifest = json.loads((folder / ".manifest.json").read_text())
    assert sorted(manifest) == [".metadata", SHARD]
    for name, entry in manifest.items():
        assert entry["size"] == (folder / name).stat().st_size
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])


def test_manifest_catches_a_bit_flip_with_verify_integrity(tmp_path, caplog):
    run = _saved_run(tmp_path, verify_integrity=True)
    shard = _step_folder(tmp_path, 4) / SHARD
    # Unchanged, it loads and says it was verified.
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert _resume(tmp_path, verify_integrity=True).train_state.step == 4
    assert "matches its integrity manifest (sizes and sha256" in caplog.text
    _flip_bit_in_weights(shard, run.saved[4])
    message = _dotted(shard) + r": sha256 mismatch \(the file changed after it was saved\); .*checkpoint.load_step"
    with pytest.raises(CheckpointError, match=message):
        _resume(tmp_path, verify_integrity=True)


def test_manifest_sizes_are_checked_even_without_verify_integrity(tmp_path):
    _saved_run(tmp_path, verify_integrity=True)
    shard = _step_folder(tmp_path, 4) / SHARD
    size = shard.stat().st_size
    with open(shard, "ab") as file:  # longer: DCP's own byte ranges would not notice
        file.write(b"\0" * 7)
    message = (
        _dotted(shard) + rf": size mismatch, {size + 7} bytes instead of {size} \(the file was truncated or changed"
    )
    with pytest.raises(CheckpointError, match=message):
        _resume(tmp_path)


def test_damaged_manifest_is_named(tmp_path):
    _saved_run(tmp_path, verify_integrity=True)
    manifest = _step_folder(tmp_path, 4) / ".manifest.json"
    manifest.write_text('{"__0_0.distcp": {"size": 1')
    with pytest.raises(CheckpointError, match=_dotted(manifest) + ": the integrity manifest is damaged"):
        _resume(tmp_path)


# --- write errors ------------------------------------------------------------------------


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_writes(monkeypatch, error_number: int) -> None:
    """DCP's writer gets error_number after writing a few bytes of its first item."""

    def write_item(transforms, stream, *args, **kwargs):
        stream.write(b"\0" * 64)
        raise OSError(error_number, os.strerror(error_number))

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)


def _assert_step_2_is_the_newest(dump: Path, run: Run) -> None:
    folder = dump / "checkpoint"
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-2"]
    resumed = _resume(dump)
    assert resumed.train_state.step == 2
    assert torch.equal(resumed.model.weight, run.saved[2])


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_disk_full_fails_the_save_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, async_mode):
    run = Run(tmp_path, async_mode=async_mode)
    run.step_and_save(2)
    run.manager.wait()
    _fail_writes(monkeypatch, errno.ENOSPC)
    message = (
        r"saving checkpoint step-4 in .* failed on rank 0: OSError: \[Errno 28\] No space left on device .*removed"
    )
    with pytest.raises(CheckpointError, match=message):
        run.step_and_save(4)
        run.manager.wait()  # an asynchronous save reports at the next wait (or save)
    run.manager.close()
    monkeypatch.undo()
    _assert_step_2_is_the_newest(tmp_path, run)


def test_io_error_writing_the_metadata_fails_the_save(tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.step_and_save(2)

    def finish(self, metadata, results):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(FileSystemWriter, "finish", finish)
    with pytest.raises(CheckpointError, match=r"step-4 .* failed on rank 0: OSError: \[Errno 5\] Input/output error"):
        run.step_and_save(4)
    monkeypatch.undo()
    _assert_step_2_is_the_newest(tmp_path, run)


def test_disk_full_writing_the_manifest_fails_the_save(tmp_path, monkeypatch):
    run = Run(tmp_path, verify_integrity=True)
    run.step_and_save(2)
    monkeypatch.setattr(manager_module, "write_manifest", _disk_full)
    with pytest.raises(CheckpointError, match=r"step-4 .* failed OSError: \[Errno 28\] No space left on device"):
        run.step_and_save(4)
    monkeypatch.undo()
    _assert_step_2_is_the_newest(tmp_path, run)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_continue_on_save_error_logs_and_goes_on(tmp_path, monkeypatch, caplog, async_mode):
    run = Run(tmp_path, async_mode=async_mode, continue_on_save_error=True)
    run.step_and_save(2)
    run.manager.wait()
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR, logger="titanlite"):
        _fail_writes(patch, errno.ENOSPC)
        run.step_and_save(4)
        run.manager.wait()
    assert re.search(
        r"CHECKPOINT NOT SAVED: saving checkpoint step-4 .*No space left on device.*Training goes on "
        r"\(checkpoint.continue_on_save_error\); the newest checkpoint on disk is step-2",
        caplog.text,
    )
    run.step_and_save(6)
    run.manager.close()
    assert sorted(entry.name for entry in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-6"]


def _save_failing_on_rank_0(dump: str) -> dict:
    """On 2 ranks: saves whose manifest write fails on rank 0 alone, synchronous and then
    asynchronous, and one with continue_on_save_error. Returns what each rank saw."""
    dist.init_process_group("gloo")
    run, seen = Run(Path(dump), verify_integrity=True, async_mode="async"), {}
    run.step_and_save(2, sync=True)
    real_write_manifest = manager_module.write_manifest
    if dist.get_rank() == 0:
        manager_module.write_manifest = _disk_full
    for name, step, sync in (("sync", 4, True), ("async", 6, False)):
        try:
            run.step_and_save(step, sync=sync)
            run.manager.wait()
            seen[name] = "no error"
        except CheckpointError as error:
            seen[name] = str(error)
    run.manager.config.continue_on_save_error = True
    run.step_and_save(8, sync=True)
    manager_module.write_manifest = real_write_manifest
    run.step_and_save(10, sync=True)
    run.manager.close()
    seen["steps"] = sorted(entry.name for entry in (Path(dump) / "checkpoint").iterdir())
    dist.destroy_process_group()
    return seen


def test_a_failure_on_rank_0_alone_stops_every_rank(tmp_path):
    for rank in run_on_ranks(2, _save_failing_on_rank_0, str(tmp_path)):
        for name, step in (("sync", 4), ("async", 6)):
            assert re.search(rf"step-{step} .* failed OSError: \[Errno 28\] No space left on device", rank[name]), rank
        assert rank["steps"] == ["step-10", "step-2"], rank


# --- the trainer -------------------------------------------------------------------------

TRAIN_ARGS = tiny_args({"training.mixed_precision_param": None, "checkpoint.enable": True, "checkpoint.interval": 2})


@pytest.fixture
def trainer_main():
    """titanlite.train.main in this process, with the signal handlers put back after it."""
    from titanlite.train import main

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield lambda dump, *args: main(TRAIN_ARGS + ["--job.dump_folder", str(dump), *args])
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _fail_saves_of(monkeypatch, step: int) -> None:
    """DCP's filesystem writer finds the disk full while writing step-N."""
    real_write_item = dcp_filesystem._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if f".step-{step}.partial" in getattr(stream, "name", ""):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)


def test_trainer_stops_on_a_full_disk_and_the_next_run_resumes(tmp_path, monkeypatch, capsys, trainer_main):
    _fail_saves_of(monkeypatch, 4)
    assert trainer_main(tmp_path, "--training.steps", "6") == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"titanlite: checkpoint error at step 4: saving checkpoint step-4 in \S+ failed on rank 0: "
        r"OSError: \[Errno 28\] No space left on device \(its partial folder .*",
        line,
    ), line
    folder = tmp_path / "checkpoint"
    assert sorted(entry.name for entry in folder.iterdir()) == ["step-2"]

    monkeypatch.undo()
    assert trainer_main(tmp_path, "--training.steps", "4") == 0
    output = capsys.readouterr()
    assert f"loaded checkpoint {folder / 'step-2'} (" in output.out + output.err
    assert list(complete_steps(folder)) == [2, 4]


@pytest.mark.parametrize("failing_step, status, left", [(2, 0, ["step-4"]), (4, 1, ["step-2"])])
def test_continue_on_save_error_fails_the_run_only_when_its_last_save_fails(
    tmp_path, monkeypatch, capsys, trainer_main, failing_step, status, left
):
    """A failed save mid-run is made up for by a later one; a failed last save is not, and
    an exit status of 0 would tell a job chain that the final state is on disk."""
    _fail_saves_of(monkeypatch, failing_step)
    assert trainer_main(tmp_path, "--training.steps", "4", "--checkpoint.continue_on_save_error") == status
    output = capsys.readouterr()  # the trainer's log goes to stdout, the failure line to stderr
    assert f"CHECKPOINT NOT SAVED: saving checkpoint step-{failing_step}" in output.out
    if status:
        line = output.err.strip().splitlines()[-1]
        assert re.fullmatch(
            r"titanlite: checkpoint error at step 4: saving checkpoint step-4 in \S+ failed on rank 0: "
            r"OSError: \[Errno 28\] No space left on device \(its partial folder .*\); the newest "
            r"checkpoint on disk is step-2 \(the run's last save: nothing later can make up for it, so "
            r"the run fails even with checkpoint.continue_on_save_error\)",
            line,
        ), line
    assert sorted(entry.name for entry in (tmp_path / "checkpoint").iterdir()) == left


@pytest.mark.parametrize("interval, async_mode", [(2, "async"), (10, "disabled")])
def test_a_failed_save_on_a_stop_signal_fails_the_run_even_with_continue_on_save_error(
    tmp_path, monkeypatch, capsys, trainer_main, interval, async_mode
):
    """The stop arrives at step 2: with interval 2 a save point, where the stop saves step 2
    itself (synchronously, instead of the asynchronous interval save); with interval 10 an
    ordinary step. Either way the save fails, and so does the run."""
    from titanlite.train import Trainer

    monkeypatch.setattr(Trainer, "stop_requested", lambda trainer: trainer.step == 2)
    _fail_saves_of(monkeypatch, 2)
    assert (
        trainer_main(
            tmp_path,
            "--training.steps",
            "6",
            "--checkpoint.continue_on_save_error",
            "--checkpoint.interval",
            str(interval),
            "--checkpoint.async_mode",
            async_mode,
        )
        == 1
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"titanlite: checkpoint error at step 2: saving checkpoint step-2 in \S+ failed .*; the newest "
        r"checkpoint on disk is none \(the save on a stop signal: nothing later can make up for it, so "
        r"the run fails even with checkpoint.continue_on_save_error\)",
        line,
    ), line
    assert not list((tmp_path / "checkpoint").iterdir())


def _weights_and_moments(step_folder: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    single_file = tmp_path / f"{step_folder.parent.parent.name}-{step_folder.name}.pt"
    dcp_to_torch_save(str(step_folder), str(single_file))
    state = torch.load(single_file, weights_only=False)
    return {"optimizer": state.pop("optimizer")["state"], **{k: v for k, v in state.items() if "." in k}}


@pytest.mark.parametrize("written_at_the_stop", [False, True])
def test_a_stop_waits_for_a_save_still_being_written_and_the_resume_is_exact(
    tmp_path, monkeypatch, capsys, trainer_main, written_at_the_stop
):
    """The stop arrives at step 3 while the asynchronous save of step 2 is in flight. Still
    being written (its data held back until the stop has decided), it becomes the last save
    and step 3 is not written; already on disk, the stop saves step 3. Either way a resume
    to step 4 ends with the weights and moments of a run that was never stopped."""
    import threading

    from titanlite.train import Trainer

    monkeypatch.setattr(Trainer, "stop_requested", lambda trainer: trainer.step == 3)
    real_write_item, real_save_at_stop = dcp_filesystem._write_item, CheckpointManager.save_at_stop
    real_on_any_rank = CheckpointManager.on_any_rank
    looked = threading.Event()

    def write_item(transforms, stream, *args, **kwargs):
        if written_at_the_stop and ".step-2.partial" in getattr(stream, "name", ""):
            assert looked.wait(timeout=60), "the stop never looked at the save in flight"
        return real_write_item(transforms, stream, *args, **kwargs)

    def on_any_rank(manager, flag):
        answer = real_on_any_rank(manager, flag)
        looked.set()  # the stop has seen step-2 unwritten: let its write go on
        return answer

    def save_at_stop(manager, step):
        if not written_at_the_stop:
            manager.wait()  # step-2 reaches the disk before the stop looks at it
        real_save_at_stop(manager, step)

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    monkeypatch.setattr(CheckpointManager, "on_any_rank", on_any_rank)
    monkeypatch.setattr(CheckpointManager, "save_at_stop", save_at_stop)
    run, reference = tmp_path / "run", tmp_path / "reference"
    assert trainer_main(run, "--training.steps", "4", "--checkpoint.async_mode", "async") == 0
    out = capsys.readouterr().out
    last = 2 if written_at_the_stop else 3
    if written_at_the_stop:
        assert "stop signal received at step 3: the save of step 2, still being written, is the last one" in out, out
    else:
        assert "stop signal received: saving step 3 and exiting" in out, out
    assert sorted(entry.name for entry in (run / "checkpoint").iterdir()) == sorted({"step-2", f"step-{last}"})

    monkeypatch.undo()
    assert trainer_main(run, "--training.steps", "4") == 0
    assert f"loaded checkpoint {run / 'checkpoint' / f'step-{last}'} (" in capsys.readouterr().out
    assert trainer_main(reference, "--training.steps", "4") == 0
    resumed = _weights_and_moments(run / "checkpoint" / "step-4", tmp_path)
    uninterrupted = _weights_and_moments(reference / "checkpoint" / "step-4", tmp_path)
    assert resumed.keys() == uninterrupted.keys() and len(resumed) > 2
    for name, value in uninterrupted.items():
        if name == "optimizer":
            for weight, moments in value.items():
                for moment, tensor in moments.items():
                    assert torch.equal(resumed[name][weight][moment], tensor), (weight, moment)
        else:
            assert torch.equal(resumed[name], value), name


def test_a_failed_save_in_flight_at_a_stop_is_replaced_by_a_save_of_the_stop_step(
    tmp_path, monkeypatch, capsys, trainer_main
):
    """As when a stop signal kills the writer processes of async_with_pinned_mem: the save of
    step 2, in flight at the stop at step 3, fails; the stop saves step 3 instead and the
    run ends with status 0, with its final state on disk."""
    from titanlite.train import Trainer

    monkeypatch.setattr(Trainer, "stop_requested", lambda trainer: trainer.step == 3)
    _fail_saves_of(monkeypatch, 2)
    assert trainer_main(tmp_path, "--training.steps", "6", "--checkpoint.async_mode", "async") == 0
    out = capsys.readouterr().out
    assert re.search(
        r"saving checkpoint step-2 in \S+ failed on rank 0: OSError: \[Errno 28\] .*; saving step 3 for "
        r"the stop instead",
        out,
    ), out
    assert sorted(entry.name for entry in (tmp_path / "checkpoint").iterdir()) == ["step-3"]
