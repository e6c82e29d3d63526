"""SIGKILL a 2-rank CPU training run at each fault point, restart it, and check that it
resumes from the newest complete checkpoint, that no incomplete folder is loaded, that no
complete checkpoint is lost or corrupt, and that its losses equal an uninterrupted run's
exactly. The harness is tests/faults/harness.py; tests/faults/chaos.py draws random trials.

Each trial starts the job twice (killed, then restarted), a few seconds each; one
uninterrupted reference run serves the whole module, and one S3 server (moto's, in this
process) every trial with its checkpoints in object storage.
"""

import random

import pytest

from tests.faults.harness import (
    FAULT_POINTS,
    OBJECT_FAULT_POINTS,
    Fault,
    RunConfig,
    object_store,
    random_trial,
    reference_losses,
    run_trial,
)

# (fault, async mode): every fault point once, the whole job dying there, plus one trial in
# which a single rank dies and the harness then ends the others (as torchrun would).
TRIALS = [
    # During step 5, after step-4's save; with async the write may still be in flight.
    pytest.param(Fault("step", 5), "async", id="step-5-all-async"),
    # While the pinned-memory stager copies step-4's state in its background thread.
    pytest.param(Fault("staging", 4), "async_with_pinned_mem", id="staging-4-all-pinned"),
    # step-6's data files written on both ranks, DCP's .metadata not yet.
    pytest.param(Fault("write", 6), "async", id="write-6-all-async"),
    # step-4 complete in .step-4.partial, not yet renamed to step-4.
    pytest.param(Fault("rename", 4, rank=0), "disabled", id="rename-4-rank0-disabled"),
    # Half-way through deleting step-4 (keep_latest_k=2) after the last save, step-8.
    pytest.param(Fault("purge", 4), "async", id="purge-4-all-async"),
    # Only rank 1 dies, in DCP's writer process while it writes step-4; rank 0 lives on
    # until the harness ends the job.
    pytest.param(Fault("write", 4, rank=1), "async_with_pinned_mem", id="write-4-rank1-pinned"),
]

# Checkpoints in object storage, where a step is written in place and committed by its marker:
# (fault, async mode, what becomes of the uncommitted step-N the kill leaves). The points that
# differ from a local folder; the others (step, staging) are chaos.py --storage s3's.
OBJECT_TRIALS = [
    # A save killed mid-upload: rank 1's data file of step-6 is in the bucket, rank 0's and
    # the .metadata may not be; the restart resumes from step-4 and writes step-6 afresh.
    pytest.param(Fault("write", 6, rank=1), "async", {"step-6": "saved again"}, id="write-6-rank1-async-s3"),
    # Every file of step-4 uploaded, the marker not: never loaded, saved again by the restart.
    pytest.param(Fault("commit", 4, rank=0), "disabled", {"step-4": "saved again"}, id="commit-4-rank0-disabled-s3"),
    # step-2's marker deleted by the purge after step-6's commit, one object more, not the
    # rest: left uncommitted, and purged by the restart once it commits step-8.
    pytest.param(Fault("purge", 2), "async", {"step-2": "purged"}, id="purge-2-all-async-s3"),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_losses(RunConfig(), tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def store():
    with object_store() as started:
        yield started


@pytest.mark.parametrize("fault, async_mode", TRIALS)
def test_a_killed_run_resumes_from_its_newest_complete_checkpoint(fault, async_mode, reference, tmp_path):
    result = run_trial(RunConfig(async_mode=async_mode), fault, tmp_path, reference)
    print(result.summary())
    assert result.fired, result.summary()
    assert result.ok, result.summary()


@pytest.mark.parametrize("fault, async_mode, torn", OBJECT_TRIALS)
def test_a_killed_run_resumes_from_its_newest_committed_checkpoint_in_object_storage(
    fault, async_mode, torn, reference, store, tmp_path
):
    result = run_trial(RunConfig(async_mode=async_mode, storage="s3"), fault, tmp_path, reference, store=store)
    print(result.summary())
    assert result.fired, result.summary()
    assert result.ok, result.summary()
    assert result.torn == torn, result.summary()


@pytest.mark.parametrize("storage, points", [("local", FAULT_POINTS), ("s3", OBJECT_FAULT_POINTS)])
def test_the_random_trials_only_draw_faults_that_can_fire(storage, points):
    rng = random.Random(0)
    drawn = [random_trial(rng, RunConfig(storage=storage)) for _ in range(200)]
    assert {fault.point for _, fault in drawn} == set(points)
    for config, fault in drawn:
        assert config.storage == storage
        assert fault.step in config.fault_steps(fault.point), (config, fault)
        if fault.point == "staging":
            assert config.async_mode != "disabled"
        if fault.point in ("rename", "commit", "purge"):  # only rank 0 publishes and purges
            assert fault.rank in (0, None)
