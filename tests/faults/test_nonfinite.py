"""A NaN or inf in a step: training stops before applying it, names the step, and never
checkpoints it; with training.skip_nonfinite_steps the step is skipped instead."""

import pytest
import torch

from tests.helpers import full_weights, tiny_args
from tests.host_syncs import HostSyncs
from titanlite.config import parse_args
from titanlite.errors import NonFiniteError
from titanlite.train import Trainer


def make_trainer(dump, overrides: dict | None = None) -> Trainer:
    """The tiny model for 5 steps (unless `overrides` says otherwise), writing into `dump`."""
    return Trainer(parse_args(tiny_args({"training.steps": 5, "job.dump_folder": str(dump), **(overrides or {})})))


def poison_step(trainer: Trainer, step: int, value: float = float("nan")) -> None:
    """Make the forward of `step` (1-based) produce `value` everywhere."""

    def hook(module, inputs, output):
        return output * value if trainer.step == step - 1 else output

    trainer.model.register_forward_hook(hook)


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_a_nan_stops_training_before_it_is_applied_or_saved(tmp_path, implementation):
    overrides = {"checkpoint.enable": True, "checkpoint.interval": 1, "optimizer.implementation": implementation}
    trainer = make_trainer(tmp_path, overrides)
    poison_step(trainer, 3)
    with pytest.raises(
        NonFiniteError,
        match=r"^step 3: gradient norm nan, this rank's loss share nan; "
        r"its update was not applied",
    ):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1", "step-2"]
    assert all(torch.isfinite(v).all() for v in full_weights(trainer.model).values())


def test_between_reads_the_device_skips_and_the_next_save_point_stops(tmp_path):
    # The host reads the flags only at log steps, save points and every SYNC_EVERY steps;
    # the steps in between never wait for the device, yet none applies a NaN or is saved.
    overrides = {"training.steps": 12, "metrics.log_freq": 100, "checkpoint.enable": True}
    overrides |= {"checkpoint.interval": 5, "training.skip_nonfinite_steps": 1, "ema.enable": True}
    trainer = make_trainer(tmp_path, overrides)
    trainer.train_step()  # step 1 is a log step: let it read, then watch the quiet ones
    trainer.read_unread_steps()
    poison_step(trainer, 2)
    poison_step(trainer, 3)
    with HostSyncs() as syncs:  # counted at the dispatcher: C++'s reads too
        trainer.train_step()
        trainer.train_step()
        trainer.train_step()
    assert syncs.syncs == {}, syncs.report()  # steps 2-4 queued their work without reading anything back
    assert syncs.other_ops["aten._fused_adamw_"] == 3
    with pytest.raises(
        NonFiniteError,
        match=r"^step 3: gradient norm nan, .*; its update was not applied, .*; "
        r"found at step 5, and no step after it was saved",
    ):
        trainer.train()
    assert trainer.step == 5
    assert list((tmp_path / "checkpoint").glob("step-*")) == []
    assert all(torch.isfinite(v).all() for v in full_weights(trainer.model).values())


def test_an_inf_is_named_too(tmp_path):
    trainer = make_trainer(tmp_path)
    poison_step(trainer, 1, float("inf"))
    with pytest.raises(NonFiniteError, match=r"^step 1: gradient norm (inf|nan)"):
        trainer.train()


def test_skipping_leaves_the_weights_and_optimizer_alone_then_goes_on(tmp_path):
    trainer = make_trainer(tmp_path, {"training.skip_nonfinite_steps": 1, "ema.enable": True, "ema.decay": 0.5})
    poison_step(trainer, 3)
    poison_step(trainer, 5)
    trainer.train_step()
    trainer.train_step()
    before = full_weights(trainer.model)
    moments = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    averages = {k: v.clone() for k, v in trainer.ema.state_dict().items()}
    trainer.train_step()  # step 3: NaN, skipped
    assert trainer.step == 3
    for name, value in full_weights(trainer.model).items():
        assert torch.equal(value, before[name]), name
    for key, value in trainer.optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, moments[key]), key
    for name, value in trainer.ema.state_dict().items():
        assert torch.equal(value, averages[name]), name
    trainer.train_step()  # step 4: finite, applied
    assert not torch.equal(full_weights(trainer.model)["norm.weight"], before["norm.weight"])
    trainer.train_step()  # step 5: NaN again, but not in a row: skipped
    assert trainer.step == 5


def test_too_many_skips_in_a_row_stop(tmp_path):
    trainer = make_trainer(tmp_path, {"training.skip_nonfinite_steps": 1})
    poison_step(trainer, 2)
    poison_step(trainer, 3)
    with pytest.raises(NonFiniteError, match=r"^step 3: "):
        trainer.train()
