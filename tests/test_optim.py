"""The warmup-stable-decay schedule, the optimizer options and the weight average's update."""

import math
from collections import Counter

import pytest
import torch

from tests.host_syncs import HostSyncs
from titanlite.checkpoint import OptimizerState
from titanlite.config import LRScheduler, Optimizer
from titanlite.optim import build_lr_scheduler, build_optimizer, wsd_factor
from titanlite.optim.ema import EMA


def factors(total: int, **config) -> list[float]:
    return [wsd_factor(step, total, LRScheduler(**config)) for step in range(total)]


def test_warmup_rises_linearly_from_above_zero_to_the_peak():
    f = factors(20, warmup_steps=4, decay_ratio=0.5)
    assert f[:5] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5, 1.0])


def test_stable_phase_then_decay_over_the_last_fraction():
    f = factors(20, warmup_steps=4, decay_ratio=0.5, decay_type="linear")
    assert f[4:10] == [1.0] * 6  # warmup 4, stable until step 10
    assert f[10] < 1.0
    assert all(a > b for a, b in zip(f[10:], f[11:], strict=False))
    assert f[-1] == pytest.approx(1 / 11)  # the last step still learns; zero comes after it


def test_decay_without_ratio_covers_every_step_after_warmup():
    f = factors(10, warmup_steps=2, decay_type="linear")
    assert f[2] == pytest.approx(1 - 1 / 9)
    assert f[-1] == pytest.approx(1 / 9)


@pytest.mark.parametrize(
    "decay_type, shape",
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_decay_shapes_end_at_min_lr_factor(decay_type, shape):
    total, min_lr = 12, 0.1
    f = factors(total, warmup_steps=2, decay_type=decay_type, min_lr_factor=min_lr)
    for step in range(2, total):
        progress = (step - 2 + 1) / (total - 2 + 1)
        assert f[step] == pytest.approx(min_lr + (1 - min_lr) * shape(progress))
    assert min_lr < f[-1] < f[-2]


def test_warmup_longer_than_the_run_never_decays_below_warmup():
    f = factors(5, warmup_steps=10)
    assert f == pytest.approx([(s + 1) / 11 for s in range(5)])


def test_scheduler_drives_the_optimizer_learning_rate():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer([param], Optimizer(lr=1e-2))
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=3, decay_ratio=0.5), total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [1e-2 * f for f in factors(10, warmup_steps=3, decay_ratio=0.5)]
    assert seen == pytest.approx(expected)


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_optimizer_options_reach_torch(name, implementation):
    param = torch.nn.Parameter(torch.ones(4))
    config = Optimizer(
        name=name, lr=0.5, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2, implementation=implementation
    )
    optimizer = build_optimizer([param], config)
    assert type(optimizer).__name__ == name
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.5, (0.8, 0.9), 1e-6, 0.2)
    assert group["foreach"] is (implementation == "foreach")
    assert bool(group["fused"]) is (implementation == "fused")
    param.grad = torch.ones(4)
    optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(4))


def move_weights(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))


@pytest.mark.parametrize("decay", [0.3, 0.5, 0.9, 0.9999])  # both of lerp's formulas (weight below and above 0.5)
def test_ema_update_is_one_fused_step_without_a_host_sync(decay):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.LayerNorm(48), torch.nn.Linear(48, 3))
    ema = EMA(model, decay)
    move_weights(model)
    weights = [weight.clone() for weight in ema.weights.values()]
    expected = [average.clone() for average in ema.state_dict().values()]
    torch._foreach_lerp_(expected, weights, 1.0 - decay)  # the Python-number overload
    with HostSyncs() as syncs:
        ema.update(skip=torch.tensor(False))
    assert syncs.syncs == {}, syncs.report()
    assert syncs.other_ops["aten._fused_sgd_"] == 1
    for average, want in zip(ema.state_dict().values(), expected, strict=True):
        if decay > 0.5:  # a lerp weight below 0.5, lerp's formula average + w (weight - average)
            assert torch.equal(average, want)  # bit for bit on the CPU
        else:  # lerp computes weight - (weight - average)(1 - w) then: the same within a rounding
            assert torch.allclose(average, want, rtol=2**-23, atol=2**-23)
    assert all(torch.equal(weight, now) for weight, now in zip(weights, ema.weights.values(), strict=True))
    # A skipped step leaves the average alone, still without reading the flag.
    before = [average.clone() for average in ema.state_dict().values()]
    move_weights(model)
    with HostSyncs() as syncs:
        ema.update(skip=torch.tensor(True))
    assert syncs.syncs == {}, syncs.report()
    for average, want in zip(ema.state_dict().values(), before, strict=True):
        assert torch.equal(average, want)


def test_ema_update_makes_as_many_calls_for_any_number_of_tensors():
    """The update is one multi-tensor call per device and dtype: a model with ten times the
    tensors makes the same operator calls (on CUDA, one launch per chunk of tensors instead
    of one per tensor)."""

    def calls(layers: int) -> Counter:
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers)))
        model.append(torch.nn.Linear(4, 4).to(torch.float64))  # a second dtype: a second group
        ema = EMA(model, 0.9)
        with HostSyncs() as mode:
            ema.update(skip=torch.tensor(False))
        assert mode.syncs == {}, mode.report()
        return mode.other_ops

    few, many = calls(2), calls(20)
    assert len(EMA(torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(20))), 0.9).averages) == 40
    assert few == many
    assert few["aten._fused_sgd_"] == 2  # float32 and float64


# --- resuming under a changed config -------------------------------------------------------

OLD_SCHEDULE, OLD_STEPS = LRScheduler(warmup_steps=2, decay_ratio=0.5), 8
OLD_OPTIMIZER = Optimizer(lr=1e-2, weight_decay=0.1)


def trained_four_steps() -> tuple[torch.nn.Linear, dict, dict]:
    """(model, optimizer state, scheduler state) after 4 steps of the old schedule."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model.parameters(), OLD_OPTIMIZER)
    scheduler = build_lr_scheduler(optimizer, OLD_SCHEDULE, OLD_STEPS)
    for _ in range(4):
        model(torch.ones(3)).sum().backward()
        optimizer.step()
        scheduler.step()
    return model, OptimizerState(model, optimizer).state_dict(), scheduler.state_dict()


@pytest.mark.parametrize("scheduler_first", [False, True], ids=["optimizer-first", "scheduler-first"])
@pytest.mark.parametrize(
    "schedule, steps, optimizer_config",
    [
        (LRScheduler(warmup_steps=2, decay_ratio=0.5), 12, OLD_OPTIMIZER),  # more steps: decay starts later
        (LRScheduler(warmup_steps=6, decay_ratio=0.5), OLD_STEPS, OLD_OPTIMIZER),  # longer warmup
        (OLD_SCHEDULE, OLD_STEPS, Optimizer(lr=3e-2, weight_decay=0.3)),  # another peak rate and decay
    ],
    ids=["steps", "warmup", "optimizer"],
)
def test_a_resume_runs_its_first_step_on_the_new_config(schedule, steps, optimizer_config, scheduler_first):
    """The checkpoint gives the position and Adam's moments; rate and settings are the new run's
    from its first step, whichever part loads first."""
    model, optimizer_state, scheduler_state = trained_four_steps()
    moments = {key: value.clone() for key, value in optimizer_state["state"]["weight"].items()}
    optimizer = build_optimizer(model.parameters(), optimizer_config)
    scheduler = build_lr_scheduler(optimizer, schedule, steps)
    parts = [(OptimizerState(model, optimizer), optimizer_state), (scheduler, scheduler_state)]
    for state, saved in reversed(parts) if scheduler_first else parts:
        state.load_state_dict(saved)
    new_rate = optimizer_config.lr * wsd_factor(4, steps, schedule)
    old_rate = OLD_OPTIMIZER.lr * wsd_factor(4, OLD_STEPS, OLD_SCHEDULE)
    assert new_rate != pytest.approx(old_rate)
    group = optimizer.param_groups[0]
    assert group["lr"] == scheduler.get_last_lr()[0] == pytest.approx(new_rate, rel=1e-12)
    assert group["weight_decay"] == optimizer_config.weight_decay
    assert scheduler.last_epoch == 4
    for key, value in moments.items():
        assert torch.equal(optimizer.state[model.weight][key], value)
    # The step after it goes on with the new schedule.
    model(torch.ones(3)).sum().backward()
    optimizer.step()
    scheduler.step()
    assert group["lr"] == pytest.approx(optimizer_config.lr * wsd_factor(5, steps, schedule), rel=1e-12)
