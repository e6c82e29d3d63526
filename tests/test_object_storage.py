"""Checkpoints in object storage (s3:// on a real S3 server, moto's, started by this module)
behave as in a local folder: a run saved at steps 5 and 10 and resumed to 15 trains like one
that never stopped, bit for bit at the same layout (FSDP 2) and within 1e-5 resharded to one
process and to TP 2; a step without its commit marker is never loaded and is purged only
once a later step is committed, never a newer one a save may still be writing; keep_latest_k
deletes committed steps only; the export and generate read straight from the bucket and
give what they give from a local copy.

One launch of 2 ranks runs every training job (tests.rank_jobs.run_jobs_on_ranks).
"""

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
import torch

from tests.helpers import free_ports, full_weights, tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.s3_server import BUCKET, s3_server
from tests.test_checkpoint_resume import Session, layout, train_to_end
from titanlite.checkpoint import complete_steps
from titanlite.checkpoint.files import COMMITTED, commit, describe_failure
from titanlite.checkpoint.hf_export import export_to_hf
from titanlite.checkpoint.load import load_model
from titanlite.checkpoint.manifest import MANIFEST
from titanlite.storage import location, upload_slot

REPO = Path(__file__).resolve().parent.parent
URL = f"s3://{BUCKET}"
STEPS, SAVED = 15, 10
# Saved at 5 and 10 (and 15, the last step); the runs' checkpoints are kept unless said. The
# manifest is written from the bucket's files and its checksums checked before every load.
SAVING = (
    "--checkpoint.interval=5",
    "--checkpoint.async_mode=async",
    f"--training.steps={STEPS}",
    "--checkpoint.verify_integrity",
)
# A torn save of an older step, and a save of a newer step still being written (by a process
# of an earlier launch, say): neither is loaded; the older one goes once step 5 is committed.
TORN, UPLOADING = 3, 40


def fsdp2_worker(dump: str, ports: list[int]) -> dict:
    session, fsdp2, out = Session(ports), layout(2), {}
    out["straight"] = train_to_end(
        session.trainer(fsdp2, *SAVING, f"--checkpoint.folder={URL}/straight", f"--job.dump_folder={dump}/straight")
    )
    # Staged in shared memory and written by DCP's writer processes, which take the writer along.
    pinned = "--checkpoint.async_mode=async_with_pinned_mem"
    resumed = (fsdp2, *SAVING, pinned, f"--checkpoint.folder={URL}/resumed", "--checkpoint.keep_latest_k=1")
    trainer = session.trainer(*resumed, f"--job.dump_folder={dump}/a")
    out["first_step"] = trainer.step  # the planted steps are no checkpoint to start from
    while trainer.step < SAVED:  # stopped after the save of step 10, as a preempted job is
        trainer.train_step()
        if trainer.checkpointer.should_save(trainer.step, STEPS):
            trainer.checkpointer.save(trainer.step)
    trainer.checkpointer.close()
    out["resumed"] = train_to_end(session.trainer(*resumed, f"--job.dump_folder={dump}/b"))
    tp2 = ["--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=8"]
    out["tp2"] = train_to_end(
        session.trainer(tp2, *SAVING, f"--checkpoint.folder={copied(SAVED, 'tp2')}", f"--job.dump_folder={dump}/tp2")
    )
    session.end()
    return out


def single_worker(dump: str) -> dict:
    session = Session([0] * 4)  # one process: no process group
    trainer = session.trainer(
        layout(1), *SAVING, f"--checkpoint.folder={copied(SAVED, 'single')}", f"--job.dump_folder={dump}"
    )
    out = train_to_end(trainer)
    # load_step sets the newer steps aside: copied server-side (marker last), then deleted.
    trainer = session.trainer(
        layout(1),
        *SAVING,
        f"--checkpoint.folder={URL}/single",
        "--checkpoint.load_step=10",
        f"--job.dump_folder={dump}",
    )
    out["load_step_at"] = trainer.step
    trainer.checkpointer.close()
    return out


def copied(step: int, name: str) -> str:
    """A run folder holding a copy of the straight run's step (copied by rank 0, server-side)."""
    straight, target = location(f"{URL}/straight/step-{step}"), location(f"{URL}/{name}/step-{step}")
    if os.environ.get("RANK", "0") == "0":
        straight.copy_to(target, last=COMMITTED)
    return f"{URL}/{name}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dump = tmp_path_factory.mktemp("object_storage")
    with s3_server():
        plant = fsspec.filesystem("s3", skip_instance_cache=True)
        for step in (TORN, UPLOADING):
            plant.pipe_file(f"{BUCKET}/resumed/step-{step}/__0_0.distcp", b"torn")
            plant.pipe_file(f"{BUCKET}/resumed/step-{step}/.metadata", b"torn")
        results = run_jobs_on_ranks(
            2,
            {
                "fsdp2": Job(2, fsdp2_worker, (str(dump / "fsdp2"), free_ports(8))),
                # After the FSDP-2 job (it shares a rank with it): its step-10 exists.
                "single": Job(1, single_worker, (str(dump / "single"),)),
            },
        )
        yield results["fsdp2"][0] | {"single": results["single"][0]}, dump


def after(result: dict, step: int) -> dict:
    """Losses and grad norms of the steps after `step`."""
    keep = [i for i, s in enumerate(result["steps"]) if s > step]
    return {key: [result[key][i] for i in keep] for key in ("steps", "loss", "grad_norm")}


def test_a_resume_from_the_bucket_trains_like_a_run_that_never_stopped(runs):
    out, _ = runs
    straight = out["straight"]
    assert straight["steps"] == list(range(1, STEPS + 1))
    # Same layout: bit for bit, weights included. The planted steps were never loaded: the
    # first run started from scratch.
    assert out["first_step"] == 0
    assert after(out["resumed"], SAVED) == after(straight, SAVED)
    assert out["resumed"]["steps"][0] == SAVED + 1
    for name, tensor in straight["weights"].items():
        assert torch.equal(out["resumed"]["weights"][name], tensor), name
    # Resharded: one process, and TP 2.
    for name in ("single", "tp2"):
        other = after(out[name], SAVED)
        assert other["steps"] == list(range(SAVED + 1, STEPS + 1)), name
        torch.testing.assert_close(other["loss"], after(straight, SAVED)["loss"], rtol=1e-5, atol=1e-5)
        for weight, tensor in straight["weights"].items():
            torch.testing.assert_close(out[name]["weights"][weight], tensor, rtol=1e-5, atol=1e-5)


def test_only_committed_steps_count_and_torn_ones_go_only_after_a_later_commit(runs):
    folder = location(f"{URL}/resumed")
    names = sorted(entry.name for entry in folder.iterdir())
    # keep_latest_k=1 left the newest committed step; the torn older one was purged after a
    # later commit; the newer one, which a save may still be writing, is untouched.
    assert names == [f"step-{STEPS}", f"step-{UPLOADING}"], names
    assert list(complete_steps(folder)) == [STEPS]
    assert (folder / f"step-{STEPS}" / COMMITTED).is_file()
    assert (folder / f"step-{STEPS}" / MANIFEST).is_file()
    # The marker is what counts: without it, the same files are no checkpoint.
    copy = location(f"{URL}/marker/step-{STEPS}")
    (folder / f"step-{STEPS}").copy_to(copy, last=COMMITTED)
    (copy / COMMITTED).remove()
    assert complete_steps(copy.parent) == {}
    with pytest.raises(ValueError, match=r"the save did not finish \(no \.committed marker\)"):
        load_model(str(copy))
    commit(copy)
    assert list(complete_steps(copy.parent)) == [STEPS]


def test_load_step_sets_the_newer_committed_steps_aside(runs):
    out, _ = runs
    assert out["single"]["load_step_at"] == SAVED
    folder = location(f"{URL}/single")
    assert list(complete_steps(folder)) == [SAVED]
    (aside,) = [entry for entry in folder.iterdir() if entry.name.startswith(f"abandoned-after-step-{SAVED}-")]
    assert list(complete_steps(aside)) == [STEPS]


def test_export_and_generate_read_straight_from_the_bucket(runs, tmp_path):
    step = f"{URL}/resumed/step-{STEPS}"
    local = tmp_path / "local" / f"step-{STEPS}"
    fsspec.filesystem("s3", skip_instance_cache=True).get(step.removeprefix("s3://") + "/", str(local), recursive=True)
    remote_model, _ = load_model(step)
    local_model, _ = load_model(local)
    assert full_weights(remote_model).keys() == full_weights(local_model).keys()
    for name, tensor in full_weights(local_model).items():
        assert torch.equal(full_weights(remote_model)[name], tensor), name

    export_to_hf(step, tmp_path / "from_bucket")
    export_to_hf(local, tmp_path / "from_local")
    exported = sorted(path.name for path in (tmp_path / "from_local").iterdir())
    assert sorted(path.name for path in (tmp_path / "from_bucket").iterdir()) == exported
    for name in exported:
        assert (tmp_path / "from_bucket" / name).read_bytes() == (tmp_path / "from_local" / name).read_bytes(), name

    def generated(checkpoint: str) -> str:
        command = [sys.executable, str(REPO / "scripts" / "generate.py"), "--checkpoint", checkpoint]
        command += ["--prompt", "The ", "--max_new_tokens", "12"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert generated(step) == generated(str(local))


def test_a_local_run_never_imports_fsspec(tmp_path):
    script = f"""
import sys
from titanlite.train import main
run = ["--job.dump_folder", {str(tmp_path)!r}, *{tiny_args({"checkpoint.enable": True})!r}]
assert main(run + ["--training.steps=2"]) == 0 and main(run + ["--training.steps=3"]) == 0  # saves, resumes
print(sorted(name for name in ("fsspec", "s3fs", "gcsfs") if name in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded checkpoint" in done.stdout + done.stderr  # the second run resumed
    assert done.stdout.splitlines()[-1] == "[]", done.stdout[-2000:]


def _hold_a_slot(folder: str, slots: int, spans, index: int) -> None:
    with upload_slot(folder, slots):
        start = time.monotonic()
        time.sleep(0.3)
        spans[index] = (start, time.monotonic())


def test_at_most_uploads_per_node_ranks_upload_at_once():
    """Four processes of a node, two slots: never more than two hold one at a time, and two do
    (the slots bound the uploads, they do not serialise them)."""
    context = multiprocessing.get_context("fork")
    spans = context.Manager().dict()
    workers = [
        context.Process(target=_hold_a_slot, args=(f"s3://{BUCKET}/slots-{os.getpid()}", 2, spans, i)) for i in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    events = sorted([(start, 1) for start, _ in spans.values()] + [(end, -1) for _, end in spans.values()])
    holding, most = 0, 0
    for _, change in events:
        holding += change
        most = max(most, holding)
    assert most == 2, dict(spans)


def test_an_error_line_never_carries_the_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEJr-token")
    error = RuntimeError("PUT refused: signature of wJalrXUtnFEMI-secret with FwoGZXIvYXdzEJr-token")
    line = describe_failure(error)
    assert "wJalrXUtnFEMI" not in line and "FwoGZXIvYXdzEJr" not in line, line
    assert line == "RuntimeError: PUT refused: signature of <redacted> with <redacted>"
