"""What training.z_loss_coef costs: the loss's forward and backward alone, and a training step.

    OMP_NUM_THREADS=1 python benchmarks/z_loss.py                # both parts (~1 min)
    OMP_NUM_THREADS=1 python benchmarks/z_loss.py --vocab 2048 --repeats 5 --steps 12

Part 1 times the trainer's loss (titanlite.loss.TrainingLoss, eager) forward and backward on
float32 logits of shape [8, 128, vocab] with random labels: without the z-loss (the plain
summed cross-entropy) and with it (z_loss_coef 1e-4). Each figure is the fastest of
`--repeats` rounds of 20 calls, the two settings taking turns so that other work on a shared
machine slows both alike.

Part 2 trains the debug model (train_configs/debug_model.toml: one process, 8 x 128 tokens a
step) with the z-loss off and on, in turns, and reports the median step time after the first
2 steps of each run, and the fastest of the runs' medians.
"""

import argparse
import statistics
import tempfile
import time

import torch

from titanlite.loss import TrainingLoss

CALLS = 20
Z_LOSS_COEF = 1e-4


def loss_seconds(z_loss_coef: float, logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Seconds for CALLS forward + backward calls of the trainer's loss."""
    objective = TrainingLoss(z_loss_coef, labels.numel(), compiled=False, device=logits.device)
    start = time.perf_counter()
    for _ in range(CALLS):
        objective(logits, labels).backward()
        logits.grad = None
    return time.perf_counter() - start


def time_loss(vocab: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    logits = (torch.randn(8, 128, vocab) * 2).requires_grad_()
    labels = torch.randint(0, vocab, (8, 128))
    best = {"off": float("inf"), "on": float("inf")}
    for _ in range(repeats):
        for name, coef in (("off", 0.0), ("on", Z_LOSS_COEF)):
            best[name] = min(best[name], loss_seconds(coef, logits, labels) / CALLS)
    return best


def step_median(z_loss_coef: float, steps: int) -> float:
    """The median step time of a debug-model run with this z-loss coefficient."""
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    with tempfile.TemporaryDirectory() as dump:
        argv = [
            "--job.config_file=train_configs/debug_model.toml",
            f"--job.dump_folder={dump}",
            f"--training.steps={steps}",
            f"--training.z_loss_coef={z_loss_coef}",
            "--metrics.log_freq=1000",
        ]
        trainer = Trainer(parse_args(argv))
        times = []
        train_step = trainer.train_step

        def timed_step():
            start = time.perf_counter()
            result = train_step()
            times.append(time.perf_counter() - start)
            return result

        trainer.train_step = timed_step
        trainer.train()
    return statistics.median(times[2:])


def time_steps(runs: int, steps: int) -> dict[str, float]:
    best = {"off": float("inf"), "on": float("inf")}
    for _ in range(runs):
        for name, coef in (("off", 0.0), ("on", Z_LOSS_COEF)):
            best[name] = min(best[name], step_median(coef, steps))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2048, help="the logits' last dimension (the debug model's)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of 20 loss calls per setting")
    parser.add_argument("--runs", type=int, default=2, help="training runs per setting")
    parser.add_argument("--steps", type=int, default=12, help="steps per training run")
    options = parser.parse_args()
    loss = time_loss(options.vocab, options.repeats)
    print(f"loss forward + backward, [8, 128, {options.vocab}] float32, z-loss off / on:")
    print(f"  {loss['off'] * 1e3:.2f} ms / {loss['on'] * 1e3:.2f} ms ({loss['on'] / loss['off']:.2f}x)")
    steps = time_steps(options.runs, options.steps)
    print("debug model training step (8 x 128 tokens, one process), z-loss off / on:")
    print(f"  {steps['off'] * 1e3:.1f} ms / {steps['on'] * 1e3:.1f} ms ({steps['on'] / steps['off']:.2f}x)")


if __name__ == "__main__":
    main()
