"""SIGKILL a 2-rank CPU training run at each fault point, restart it, and check that it
resumes from the newest complete checkpoint, that no incomplete folder is loaded, that no
complete checkpoint is lost or corrupt, and that its losses equal an uninterrupted run's
exactly. The harness is tests/faults/harness.py; tests/faults/chaos.py draws random trials.

Each trial starts the job twice (killed, then restarted), a few seconds each; one
uninterrupted reference run serves the whole module.
"""

import random

import pytest

from tests.faults.harness import FAULT_POINTS, Fault, RunConfig, random_trial, reference_losses, run_trial

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_losses(RunConfig(), tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("fault, async_mode", TRIALS)
def test_a_killed_run_resumes_from_its_newest_complete_checkpoint(fault, async_mode, reference, tmp_path):
    result = run_trial(RunConfig(async_mode=async_mode), fault, tmp_path, reference)
    print(result.summary())
    assert result.fired, result.summary()
    assert result.ok, result.summary()


def test_the_random_trials_only_draw_faults_that_can_fire():
    rng = random.Random(0)
    drawn = [random_trial(rng) for _ in range(200)]
    assert {fault.point for _, fault in drawn} == set(FAULT_POINTS)
    for config, fault in drawn:
        assert fault.step in config.fault_steps(fault.point), (config, fault)
        if fault.point == "staging":
            assert config.async_mode != "disabled"
        if fault.point in ("rename", "purge"):  # only rank 0 renames and purges
            assert fault.rank in (0, None)
