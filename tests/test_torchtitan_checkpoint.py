"""A checkpoint laid out the way torchtitan writes one (a step-N DCP folder, model keys
flattened at the top level, beside optimizer / lr_scheduler / dataloader / train_state,
and no titanlite model_args) starts a titanlite run through initial_load_path."""

import io
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.helpers import TINY, full_weights, tiny_args
from tests.rank_jobs import run_on_ranks
from titanlite.config import parse_args
from titanlite.models.llama import Transformer
from titanlite.train import Trainer

ARGS = tiny_args({"training.local_batch_size": None, "training.steps": 2, "metrics.log_freq": None})


# Weight names torchtitan's main of 2026-08 spells differently from 0.2 (and titanlite).
LATER_NAMES = {"output.weight": "lm_head.weight"} | {
    f"layers.{layer}.attention.{projection}.weight": f"layers.{layer}.attention.qkv_linear.{projection}.weight"
    for layer in range(TINY.n_layers)
    for projection in ("wq", "wk", "wv")
}


def torchtitan_layout(folder: Path, full: bool, later_names: bool = False) -> tuple[Path, dict]:
    """step-3 with the model's keys at the top level and, for a full checkpoint, the other
    parts under torchtitan's names (their contents only need to be plausible: a model-only
    initial load must not read them). later_names: the weights named as torchtitan's main of
    2026-08 names them; the returned weights keep titanlite's names."""
    model = Transformer(TINY)
    model.init_weights(seed=11)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    state = {LATER_NAMES.get(name, name) if later_names else name: tensor for name, tensor in weights.items()}
    assert len(state) == len(weights)
    if full:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        optimizer.step()
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        state["lr_scheduler"] = {"lr_scheduler_0": {"last_epoch": 3, "_step_count": 4}}
        state["dataloader"] = {"dp_rank_0": io.BytesIO(b"torchtitan loader state")}
        state["train_state"] = {"step": 3, "ntokens_seen": 96, "log_steps": [1, 2, 3]}
    step = folder / "checkpoint" / "step-3"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(step), no_dist=True)
    return step, weights


def seeded_weights(step: str, dump: str, extra: list[str]) -> dict:
    trainer = Trainer(parse_args(ARGS + ["--checkpoint.initial_load_path", step, "--job.dump_folder", dump] + extra))
    weights = full_weights(trainer.model)
    trainer.train()  # and it trains from there
    if dist.is_initialized():
        dist.destroy_process_group()
    return weights


@pytest.mark.parametrize(
    "full, later_names", [(False, False), (True, False), (True, True)], ids=["model-only", "full", "full-2026-08"]
)
def test_a_torchtitan_checkpoint_starts_a_run(tmp_path, full, later_names):
    step, expected = torchtitan_layout(tmp_path / "torchtitan", full, later_names)
    loaded = seeded_weights(str(step), str(tmp_path / "run"), ["--training.local_batch_size=2"])
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


def test_two_ranks_reshard_a_torchtitan_checkpoint(tmp_path):
    # The later names: the renaming and the resharding together (the single-process cases
    # above read both spellings; one launch of two ranks is enough for the suite's time).
    step, expected = torchtitan_layout(tmp_path / "torchtitan", full=True, later_names=True)
    ranks = run_on_ranks(2, seeded_weights, str(step), str(tmp_path / "run"), ["--training.local_batch_size=1"])
    for loaded in ranks:
        for name, value in expected.items():
            assert torch.equal(loaded[name], value), name


def test_a_missing_weight_is_still_an_error(tmp_path):
    step, expected = torchtitan_layout(tmp_path / "torchtitan", full=False)
    state = {k: v for k, v in expected.items() if k != "norm.weight"}
    broken = tmp_path / "broken" / "step-3"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(broken), no_dist=True)
    from titanlite.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"step-3.*norm\.weight"):
        seeded_weights(str(broken), str(tmp_path / "run"), ["--training.local_batch_size=2"])
