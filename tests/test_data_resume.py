"""A run on a shuffled mixture of prepared folders, stopped at 4 ranks and resumed at 2 and at
3, trains on exactly the same token ids and matches the uninterrupted run's losses.

The uninterrupted run is the 4-rank run itself: it trains 6 steps and saves after step 3. Its
step-3 checkpoint is copied into new dump folders and resumed on 2 ranks (local batch 6) and
on 3 ranks (local batch 4), so every global batch is 12 windows of 32 + 1 tokens whatever the
layout. The model is tiny and float32, so losses agree to within 1e-5 (FSDP sums gradients in
another order at each world size). The ranks are built with the checkpoint-resume tests'
Session, whose base arguments ARGS overrides where they differ.
"""

import pytest
import torch

from tests.helpers import free_ports, tiny_args
from tests.prepared_data import make_documents, prepare_documents
from tests.rank_jobs import Job, run_jobs_in_fewest_launches
from tests.test_checkpoint_resume import Session, copy_checkpoint, record_batches

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 12
ARGS = tiny_args(
    {
        "training.local_batch_size": None,  # train() sets it per world size
        "training.steps": STEPS,
        "training.global_batch_size": GLOBAL_BATCH,
        "optimizer.lr": 3e-3,
        "lr_scheduler.warmup_steps": 2,
        "checkpoint.enable": True,
        "checkpoint.interval": SAVE_AT,
        "comm.init_timeout_seconds": 120,
        "training.dataset": "prepared",
        "data.seed": 7,
    }
)


def train(dump: str, ports: list[int], dataset_path: str, world_size: int) -> dict:
    session = Session(ports)
    trainer = session.trainer(
        ARGS,
        f"--training.dataset_path={dataset_path}",
        f"--job.dump_folder={dump}",
        f"--training.local_batch_size={GLOBAL_BATCH // world_size}",
    )
    first_step = trainer.step
    batches = record_batches(trainer)
    records = trainer.train()
    session.end()
    return {"first_step": first_step, "loss": {r.step: r.loss for r in records}, "batches": batches}


def resume(step_folder: str, dump: str, ports: list[int], dataset_path: str, world_size: int) -> dict:
    """train() from a copy of the 4-rank run's checkpoint `step_folder` in a new dump folder."""
    return train(copy_checkpoint(step_folder, dump), ports, dataset_path, world_size)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches, not three: the 4-rank run, then on 2 of its ranks the 2-rank resume; a
    launch of 3 for the 3-rank resume (3 does not divide 4). A launch's start-up costs more
    than the tiny model's steps."""
    root = tmp_path_factory.mktemp("data_resume")
    web = prepare_documents(root / "web", make_documents(1, 400), shard_tokens=5000)
    code = prepare_documents(root / "code", make_documents(2, 150), shard_tokens=5000)
    mixture = f"{web}:0.7,{code}:0.3"
    step_folder = str(root / "four" / "checkpoint" / f"step-{SAVE_AT}")
    jobs = {4: Job(4, train, (str(root / "four"), free_ports(2), mixture, 4))}
    for world_size in (2, 3):
        dump = str(root / f"resumed_on_{world_size}")
        jobs[world_size] = Job(world_size, resume, (step_folder, dump, free_ports(2), mixture, world_size))
    return run_jobs_in_fewest_launches(jobs)


def global_batch(ranks: list[dict], step: int) -> list[tuple]:
    """The step's windows in global order: rank 0's rows, then rank 1's, ..."""
    return [row for rank in ranks for row in rank["batches"][step]]


def test_the_uninterrupted_run_trains_on_new_windows_every_step(runs):
    straight = runs[4]
    assert straight[0]["first_step"] == 0
    batches = [global_batch(straight, step) for step in range(1, STEPS + 1)]
    assert all(len(batch) == GLOBAL_BATCH for batch in batches)
    assert len({row for batch in batches for row in batch}) == STEPS * GLOBAL_BATCH
    assert len(set(straight[0]["loss"].values())) == STEPS


@pytest.mark.parametrize("world_size", [2, 3])
def test_resume_at_another_world_size_replays_the_same_token_ids_and_losses(runs, world_size):
    straight, resumed = runs[4], runs[world_size]
    assert all(rank["first_step"] == SAVE_AT for rank in resumed)
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert global_batch(resumed, step) == global_batch(straight, step), f"step {step}"
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    assert sorted(resumed[0]["loss"]) == steps
    torch.testing.assert_close(
        torch.tensor([resumed[0]["loss"][s] for s in steps]),
        torch.tensor([straight[0]["loss"][s] for s in steps]),
        rtol=1e-5,
        atol=0,
    )
