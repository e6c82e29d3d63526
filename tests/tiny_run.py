"""A tiny model trained for a few steps in this process, with checkpoints: the common
starting point of the export, loading and generation tests."""

from pathlib import Path
from typing import NamedTuple

import torch

from tests.multiprocess import register_tiny_flavor
from titanlite.config import parse_args
from titanlite.train import Trainer

STEPS = 3
TRAIN_ARGS = [
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    f"--training.steps={STEPS}",
    "--training.mixed_precision_param",
    "float32",
    "--activation_checkpoint.mode",
    "none",
    "--optimizer.lr",
    "3e-3",
    "--checkpoint.enable",
    "--metrics.log_freq",
    "1",
]


class TinyRun(NamedTuple):
    step_dir: Path  # the checkpoint written after the last step
    tokens: torch.Tensor  # a fixed input batch
    logits: torch.Tensor  # the trained model's logits on it
    weights: dict  # the trained weights
    ema: dict | None  # the EMA averages, when EMA was on


def train_tiny(dump: Path, extra: list[str] = ()) -> TinyRun:
    register_tiny_flavor()
    trainer = Trainer(parse_args(TRAIN_ARGS + list(extra) + ["--job.dump_folder", str(dump)]))
    trainer.train()
    model = trainer.model.eval()
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens)
    ema = None if trainer.ema is None else {k: v.detach().clone() for k, v in trainer.ema.averages.items()}
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return TinyRun(dump / "checkpoint" / f"step-{STEPS}", tokens, logits, weights, ema)
