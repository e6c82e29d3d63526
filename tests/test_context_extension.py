"""Context extension: a model trained at a short seq_len resumes at 4 x the seq_len with RoPE
scaling set in [model] (model.rope_scaling_factor), its checkpoint's weights loaded as saved,
the RoPE tables stretched, and the refusals of families and settings without it. One process."""

import pytest
import torch

from tests.helpers import full_weights, tiny_args
from titanlite.config import ConfigError, parse_args
from titanlite.models.llama.model import rope_tables
from titanlite.plan import plan_run
from titanlite.train import Trainer

SHORT = 32


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_a_short_context_checkpoint_resumes_at_four_times_the_seq_len(tmp_path, name, quiet_process_state):
    family = {"model.name": name}
    short = tiny_args(
        {**family, "training.steps": 2, "checkpoint.enable": True, "job.dump_folder": str(tmp_path / "a")}
    )
    trainer = Trainer(parse_args(short))
    trainer.train()
    saved = full_weights(trainer.model)
    long_run = {
        **family,
        "training.seq_len": 4 * SHORT,
        "training.steps": 2,
        "model.rope_scaling_factor": 4,
        "model.rope_original_seq_len": SHORT,
        "checkpoint.initial_load_path": str(tmp_path / "a" / "checkpoint" / "step-2"),
        "job.dump_folder": str(tmp_path / "b"),
    }
    resumed = Trainer(parse_args(tiny_args(long_run)))
    # The weights are the checkpoint's (RoPE scaling changes none), the tables stretched.
    loaded = full_weights(resumed.model)
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    args = resumed.plan.model_args
    assert args.max_seq_len == 4 * SHORT and args.rope_scaling.factor == 4
    assert args.rope_scaling.original_max_position_embeddings == SHORT
    if name == "llama3":
        unscaled, _ = rope_tables(trainer.plan.model_args.with_seq_len(4 * SHORT))
        assert not torch.allclose(resumed.model.rope_cos, unscaled)
    records = resumed.train()
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r.loss)) for r in records)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.name": "qwen3", "model.rope_scaling_factor": 4}, r"rope_scaling_factor \(4.0\): qwen3 has no RoPE"),
        ({"model.rope_original_seq_len": 32}, r"rope_original_seq_len applies with model.rope_scaling_factor only"),
    ],
    ids=["qwen3", "original_alone"],
)
def test_rope_scaling_settings_without_meaning_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_run(parse_args(tiny_args(overrides)), 1)
