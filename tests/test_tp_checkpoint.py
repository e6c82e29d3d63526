"""Checkpoints of tensor-parallel runs."""

import pytest

from tests.helpers import tiny_args
from titanlite.checkpoint import CheckpointError
from titanlite.checkpoint.files import stored_keys
from titanlite.config import parse_args
from titanlite.train import Trainer

# --- a checkpoint from before tensor parallelism ------------------------------------------


def test_a_checkpoint_without_the_tp_record_still_resumes(tmp_path, monkeypatch, quiet_process_state):
    """Checkpoints written before TP existed have no train_state.tp; they must resume (as
    written by a layout without TP), while a missing entry a resume needs is still an error."""
    args = tiny_args({"training.steps": 2, "checkpoint.enable": True, "job.dump_folder": str(tmp_path)})
    written_by = Trainer.state_dict

    def without(*keys):
        return lambda self: {key: value for key, value in written_by(self).items() if key not in keys}

    monkeypatch.setattr(Trainer, "state_dict", without("tp"))
    Trainer(parse_args(args)).train()
    assert {"train_state.step", "train_state.world_size"} <= set(stored_keys(tmp_path / "checkpoint" / "step-2"))
    assert "train_state.tp" not in stored_keys(tmp_path / "checkpoint" / "step-2")
    monkeypatch.setattr(Trainer, "state_dict", written_by)
    resumed = Trainer(parse_args(args))
    assert (resumed.step, resumed.tokens_seen) == (2, 2 * 2 * 32)
    resumed.checkpointer.close()

    other = tmp_path / "other"
    monkeypatch.setattr(Trainer, "state_dict", without("tp", "tokens_seen"))
    Trainer(parse_args(args + [f"--job.dump_folder={other}"])).train()
    monkeypatch.setattr(Trainer, "state_dict", written_by)
    with pytest.raises(CheckpointError, match="train_state.tokens_seen"):
        Trainer(parse_args(args + [f"--job.dump_folder={other}"]))
