"""training.skip_spike_steps and training.z_loss_coef.

A spike step is skipped on the device like a non-finite one; the runs here inject one bad
batch (every token of every sequence 0, as a corrupted shard of one repeated byte would give)
and compare with a run that never saw it. The window's statistics are checked on their own,
and the window through a checkpoint resume. The z-loss under FSDP x TP loss parallel and its
equality with one process ride the multi-rank launch of tests/test_host_syncs.py.
"""

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import capture_log_lines, full_weights, tiny_args
from titanlite.config import parse_args
from titanlite.loss import cross_entropy_and_z_sums
from titanlite.metrics import tags
from titanlite.nonfinite import SpikeError
from titanlite.spikes import SpikeWindow
from titanlite.train import Trainer

# --- the window's statistics, on their own ---------------------------------------------------


def fed(window: SpikeWindow, losses: list[float], norms: list[float] | None = None) -> list[bool]:
    """Judge one step per loss (gradient norm 1 unless given); the skip flags."""
    norms = norms or [1.0] * len(losses)
    finite, steps = torch.tensor(False), zip(losses, norms, strict=True)
    return [bool(window.judge(torch.tensor(loss), torch.tensor(norm), finite)) for loss, norm in steps]


def test_the_statistics_are_those_of_the_last_accepted_steps_around_the_ring():
    window = SpikeWindow(size=8, sigmas=6.0, device=torch.device("cpu"))
    losses = [3.0 + 0.1 * (i % 5) - 0.01 * i for i in range(13)]  # wraps the ring of 8
    assert fed(window, losses) == [False] * 13
    mean, std = window.statistics()
    last = torch.tensor(losses[-8:])
    torch.testing.assert_close(mean[0], last.mean())
    torch.testing.assert_close(std[0], last.std())  # the sample standard deviation
    assert (mean[1], std[1]) == (1.0, 0.0)
    assert int(window.accepted) == 13 and int(window.skipped) == 0


def test_a_spike_counts_only_after_half_a_window_and_never_enters_it():
    window = SpikeWindow(size=8, sigmas=6.0, device=torch.device("cpu"))
    # Three accepted steps: still warming up, a huge loss is accepted (and enters the window).
    assert fed(window, [3.0, 3.1, 2.9, 50.0]) == [False] * 4
    window = SpikeWindow(size=8, sigmas=6.0, device=torch.device("cpu"))
    assert fed(window, [3.0, 3.1, 2.9, 3.05]) == [False] * 4
    before = window.values.clone()
    assert fed(window, [50.0]) == [True]
    assert torch.equal(window.values, before) and int(window.accepted) == 4 and int(window.skipped) == 1
    flag, loss, z_score = window.last.tolist()
    mean, std = window.statistics()
    assert (flag, loss) == (1.0, 50.0) and z_score == pytest.approx(float((50.0 - mean[0]) / std[0]))
    # Just under mean + 6 sigma is accepted; the gradient norm alone can make a spike.
    assert fed(window, [float(mean[0] + 5.9 * std[0])]) == [False]
    assert fed(window, [3.0], norms=[40.0]) == [True]
    assert int(window.skipped) == 2


def test_a_nonfinite_step_is_skipped_but_not_counted_as_a_spike():
    window = SpikeWindow(size=4, sigmas=6.0, device=torch.device("cpu"))
    fed(window, [3.0, 3.1, 2.9])
    skip = window.judge(torch.tensor(float("nan")), torch.tensor(float("nan")), torch.tensor(True))
    assert bool(skip) and int(window.skipped) == 0 and int(window.accepted) == 3


# --- training runs with one bad batch ---------------------------------------------------------

BAD = 10  # the step whose batch is bad
STEPS = 14
SPIKE_RUN = {
    "training.steps": STEPS,
    "training.skip_spike_steps": True,
    "training.spike_window": 8,  # active from the 5th step on
    # A constant learning rate: the schedule moves on at a skipped step, as at a non-finite one,
    # so only then is a run with the step skipped the run without it.
    "lr_scheduler.warmup_steps": 0,
    "lr_scheduler.decay_ratio": 0.0,
    "metrics.log_freq": 100,
}


def spike_trainer(dump, overrides: dict | None = None, bad: tuple[int, ...] = (), dropped: tuple[int, ...] = ()):
    """The tiny model with spike skipping; the batches of steps `bad` (1-based, as counted by
    the trainer) all zeros; the batches read at steps `dropped` read and thrown away first."""
    trainer = Trainer(parse_args(tiny_args({**SPIKE_RUN, "job.dump_folder": str(dump), **(overrides or {})})))
    read = trainer.loader.next_batch
    read_batches = []

    def next_batch():
        if len(read_batches) + 1 in dropped:
            read_batches.append(read())
        inputs, labels = read()
        read_batches.append((inputs, labels))
        if trainer.step + 1 in bad:
            return torch.zeros_like(inputs), torch.zeros_like(labels)
        return inputs, labels

    trainer.loader.next_batch = next_batch
    return trainer


def run(trainer: Trainer) -> dict:
    """Train; each step's loss and skip flag (read at the end), the weights, the optimizer's
    state and the window."""
    losses, flags = [], []
    train_step = trainer.train_step

    def recorded_step():
        loss_share, grad_norm = train_step()
        losses.append(loss_share)
        flags.append(trainer.spikes.last[0])
        return loss_share, grad_norm

    trainer.train_step = recorded_step
    trainer.train()  # saves and reads the steps (their warnings) where it is due
    return {
        "losses": torch.stack(losses).tolist(),
        "skipped": [step + 1 for step, flag in enumerate(torch.stack(flags).tolist()) if flag],
        "weights": full_weights(trainer.model),
        "moments": trainer.optimizer.state_dict()["state"],
        "window": {name: value.clone() for name, value in trainer.spikes.state_dict().items()},
    }


def assert_equal_states(got: dict, want: dict) -> None:
    for name, value in want["weights"].items():
        assert torch.equal(got["weights"][name], value), name
    for index, state in want["moments"].items():
        for key, value in state.items():
            assert torch.equal(got["moments"][index][key], value), (index, key)
    for name in ("values", "accepted"):  # the skipped count is checked on its own
        assert torch.equal(got["window"][name], want["window"][name]), name


def test_a_bad_batch_is_skipped_and_training_equals_the_run_without_it(tmp_path):
    lines = capture_log_lines()
    with_bad = run(spike_trainer(tmp_path / "bad", bad=(BAD,)))
    without = run(spike_trainer(tmp_path / "without", {"training.steps": STEPS - 1}, dropped=(BAD,)))
    assert with_bad["skipped"] == [BAD] and without["skipped"] == []
    assert with_bad["losses"][BAD - 1] > max(with_bad["losses"][: BAD - 1])  # the bad batch's loss
    # Bit for bit: the same kernels on the same numbers in the same order, on one CPU process.
    # The skipped step left the weights, Adam's moments and step count and the window as they
    # were (fused AdamW's found_inf), and the learning rate is constant: every later step is
    # the run without the batch's step, one step later.
    assert with_bad["losses"][: BAD - 1] + with_bad["losses"][BAD:] == without["losses"]
    assert_equal_states(with_bad, without)
    assert int(with_bad["moments"][0]["step"]) == STEPS - 1
    assert int(with_bad["window"]["skipped"]) == 1 and int(with_bad["window"]["accepted"]) == STEPS - 1
    assert any(line.startswith(f"step {BAD} skipped as a loss spike") for line in lines.warnings()), lines.warnings()


def test_the_window_survives_a_resume_bit_for_bit(tmp_path):
    # Bad batches before and after the save at step 8; the resumed run has seen 3 accepted steps
    # after it when the second comes, too few to judge without the saved window.
    overrides = {"checkpoint.enable": True, "checkpoint.interval": 8}
    whole = run(spike_trainer(tmp_path, overrides, bad=(6, 12)))
    resumed_trainer = spike_trainer(tmp_path, {**overrides, "checkpoint.load_step": 8}, bad=(6, 12))
    assert resumed_trainer.step == 8
    resumed = run(resumed_trainer)
    assert whole["skipped"] == [6, 12] and resumed["skipped"] == [12 - 8]
    assert resumed["losses"] == whole["losses"][8:]
    assert_equal_states(resumed, whole)
    assert int(resumed["window"]["skipped"]) == 2


def test_spikes_in_a_row_past_the_limit_stop_training(tmp_path):
    trainer = spike_trainer(tmp_path, {"training.spike_max_in_a_row": 2, "metrics.log_freq": 1}, bad=(7, 8, 9))
    with pytest.raises(SpikeError, match=r"^step 9: a loss spike again \(loss .*\), 3 in a row"):
        trainer.train()


def test_the_spike_metrics_are_logged(tmp_path):
    trainer = spike_trainer(tmp_path, {"training.steps": BAD, "metrics.log_freq": BAD}, bad=(BAD,))
    logged = []
    log_step = trainer.metrics.log_step
    trainer.metrics.log_step = lambda *args: logged.append(log_step(*args)) or logged[-1]
    trainer.train()
    assert logged[-1][tags.SPIKE_SKIPPED] == 1.0
    z_score = logged[-1][tags.SPIKE_Z_SCORE]
    assert z_score == trainer.spikes.last[2].item() and z_score > 6.0


# --- the output z-loss ------------------------------------------------------------------------

Z_LOSS_COEF = 1e-2


def test_the_z_loss_is_the_hand_computed_one_and_the_logged_loss_stays_the_cross_entropy(tmp_path):
    args = {"training.steps": 1, "job.dump_folder": str(tmp_path)}
    trainer = Trainer(parse_args(tiny_args({**args, "training.z_loss_coef": Z_LOSS_COEF})))
    plain = Trainer(parse_args(tiny_args(args)))
    batches = []
    read = trainer.loader.next_batch
    trainer.loader.next_batch = lambda: batches.append(read()) or batches[-1]
    logged = []
    log_step = trainer.metrics.log_step
    trainer.metrics.log_step = lambda *args: logged.append(log_step(*args)) or logged[-1]
    with torch.no_grad():
        weights_before = {name: p.clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    plain_records = plain.train()

    inputs, labels = batches[0]
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            p.copy_(weights_before[name])
        logits = trainer.model(inputs).float()
    by_hand = Z_LOSS_COEF * torch.logsumexp(logits, dim=-1).square().mean()
    assert logged[0][tags.Z_LOSS] == pytest.approx(by_hand.item(), rel=1e-5)
    # The cross-entropy is logged as the loss, bit for bit the run's without a z-loss; the
    # z-loss still trains: the weights differ.
    assert logged[0][tags.LOSS] == plain_records[0].loss
    assert not torch.equal(full_weights(trainer.model)["norm.weight"], full_weights(plain.model)["norm.weight"])


def test_the_z_loss_gradient_is_the_hand_computed_one():
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 16) * 3).requires_grad_()
    labels = torch.randint(0, 16, (2, 5))
    labels[0, 1] = -100  # ignored: in neither loss
    cross_entropy, z_sum = cross_entropy_and_z_sums(logits, labels)
    (cross_entropy + Z_LOSS_COEF * z_sum).backward()
    reference = logits.detach().clone().requires_grad_()
    kept = labels != -100
    want_z = (torch.logsumexp(reference, dim=-1).square() * kept).sum()
    want = torch.nn.functional.cross_entropy(reference.flatten(0, 1), labels.flatten(), reduction="sum")
    (want + Z_LOSS_COEF * want_z).backward()
    assert cross_entropy.item() == want.item()
    torch.testing.assert_close(z_sum, want_z)
    torch.testing.assert_close(logits.grad, reference.grad)


def autograd_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The z-loss as first written, all through autograd: the logsumexp at the first vocabulary
    entry of logits - log_softmax(logits)."""
    logits = logits.float()
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
    cross_entropy = torch.nn.functional.nll_loss(log_probs.flatten(0, 1), labels.flatten(), reduction="sum")
    log_sum_exp = logits[..., 0] - log_probs[..., 0]
    return cross_entropy, (log_sum_exp.square() * (labels != -100)).sum()


def loss_and_grad(sums, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The trainer's combination (cross-entropy and z-loss over the tokens), its parts and the
    logits' gradient."""
    logits = logits.detach().clone().requires_grad_()
    cross_entropy, z_sum = sums(logits, labels)
    (cross_entropy / labels.numel() + Z_LOSS_COEF * z_sum / labels.numel()).backward()
    return cross_entropy.detach(), z_sum.detach(), logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_z_loss_equals_the_autograd_one(dtype):
    torch.manual_seed(1)
    logits = (torch.randn(3, 7, 50) * 4 + 5).to(dtype)  # logsumexp far from 0: the z-loss matters
    labels = torch.randint(0, 50, (3, 7))
    labels[1, :3] = -100
    cross_entropy, z_sum, grad = loss_and_grad(cross_entropy_and_z_sums, logits, labels)
    want_cross_entropy, want_z_sum, want_grad = loss_and_grad(autograd_sums, logits, labels)
    # The same forward kernels: the values bit for bit.
    assert torch.equal(cross_entropy, want_cross_entropy) and torch.equal(z_sum, want_z_sum)
    assert grad.dtype == dtype
    assert torch.equal(grad[1, :3], torch.zeros_like(grad[1, :3]))  # ignored tokens: no gradient
    # The gradient summed in another order: float32 rounding (and bf16's, after the cast).
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {}
    torch.testing.assert_close(grad, want_grad, **tolerance)
    assert (grad - want_grad).abs().max() < 1e-3 * want_grad.abs().max()


class NewLogitSizedTensors(TorchDispatchMode):
    """Counts the tensors of the logits' size that operators allocate (not in place, not a
    view of an input)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.numel() == self.numel and t.untyped_storage().data_ptr() not in inputs:
                self.count += 1
        return out


@pytest.mark.parametrize(("sums", "allocated"), [(cross_entropy_and_z_sums, 1), (autograd_sums, 6)])
def test_the_z_loss_backward_makes_one_logit_sized_gradient(sums, allocated):
    # The gradient itself, made in place. Through autograd (which the counter must see): the
    # zeros of the two select backwards and of nll_loss's, log_softmax's backward, two sums.
    logits = torch.randn(2, 5, 64, requires_grad=True)
    labels = torch.randint(0, 64, (2, 5))
    cross_entropy, z_sum = sums(logits, labels)
    with NewLogitSizedTensors(logits.numel()) as counter:
        (cross_entropy + Z_LOSS_COEF * z_sum).backward()
    assert counter.count == allocated
