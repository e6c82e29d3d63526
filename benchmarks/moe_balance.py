"""Expert load over training with and without load balancing: max / mean tokens per expert
of qwen3 debugmodel_moe, trained by the trainer in one process on the CPU.

    python benchmarks/moe_balance.py                      # 3 settings x 100 steps (about 30 minutes on 2 busy vCPUs)
    python benchmarks/moe_balance.py --quick              # tiny_moe, 4 steps each (seconds)
    python benchmarks/moe_balance.py --steps 200 --seq-len 128 --batch 8
    python benchmarks/moe_balance.py --settings bias --bias-rate 0.01

Each setting trains the same model from the same seed on the same batches (the built-in
python_stdlib data, train_configs/debug_model.toml's optimizer and schedule, float32):
  none  no balancing (model.moe_bias_update_rate = 0, model.moe_aux_loss_coef = 0);
  bias  the auxiliary-loss-free expert bias at --bias-rate (default DeepSeek-V3's 1e-3), no
        auxiliary loss;
  aux   transformers' auxiliary loss at --aux-coef (default 0.01), no bias.
After every optimizer step the trainer's balancer holds each MoE layer's max / mean of the
step's (token, expert) pairs per expert (1: even; at most n_experts / top_k = 4 here); the
benchmark keeps the largest over the layers. Printed per setting: that load at step 1, its
mean over the first and over the last `--window` steps, the first step from which it stays
below 1.5 (or "never"), and the last step's loss. The last line is

    max/mean expert load, mean of the last W steps: none A, bias B, aux C (none / bias R)

(only the settings run; the ratio where both ran).
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titanlite.config import parse_args  # noqa: E402
from titanlite.train import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def settings(bias_rate: float, aux_coef: float) -> dict[str, dict]:
    return {
        "none": {"model.moe_bias_update_rate": 0, "model.moe_aux_loss_coef": 0},
        "bias": {"model.moe_bias_update_rate": bias_rate, "model.moe_aux_loss_coef": 0},
        "aux": {"model.moe_bias_update_rate": 0, "model.moe_aux_loss_coef": aux_coef},
    }


EVEN_ENOUGH = 1.5  # the bound for the balanced run


def train_setting(overrides: dict, flavor: str, steps: int, seq_len: int, batch: int) -> tuple[list[float], float]:
    """(largest max / mean over the layers at each step, the last step's loss)."""
    options = {
        "model.name": "qwen3",
        "model.flavor": flavor,
        "training.steps": steps,
        "training.seq_len": seq_len,
        "training.local_batch_size": batch,
        "lr_scheduler.warmup_steps": max(1, steps // 20),
        "parallelism.data_parallel_shard_degree": 1,
        "metrics.log_freq": steps,
        "metrics.enable_jsonl": False,
        **overrides,
    }
    with tempfile.TemporaryDirectory() as dump:
        argv = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--job.dump_folder", dump]
        trainer = Trainer(parse_args(argv + [f"--{key}={value}" for key, value in options.items()]))
        loads = []
        # Runs after the balancer's own hook (registered first): the step's loads are kept.
        trainer.optimizer.register_step_post_hook(lambda *_: loads.append(trainer.balancer.step_load.max()))
        records = trainer.train()
    return torch.stack(loads).tolist(), records[-1].loss


def first_step_staying_below(loads: list[float], bound: float) -> str:
    for step in range(len(loads), 0, -1):
        if loads[step - 1] >= bound:
            return str(step + 1) if step < len(loads) else "never"
    return "1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--window", type=int, default=20, help="steps averaged at the start and at the end")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="the bias setting's rate")
    parser.add_argument("--aux-coef", type=float, default=0.01, help="the aux setting's coefficient")
    parser.add_argument("--settings", default="none,bias,aux", help="which of none, bias, aux to run")
    parser.add_argument("--quick", action="store_true", help="tiny_moe, 4 steps of 2 x 16 tokens")
    args = parser.parse_args()
    flavor = "debugmodel_moe"
    if args.quick:
        flavor, args.steps, args.seq_len, args.batch, args.window = "tiny_moe", 4, 16, 2, 2
    window = min(args.window, args.steps)
    print(f"qwen3 {flavor}, {args.steps} steps of {args.batch} x {args.seq_len} tokens, one CPU process")
    first, last = f"first {window}", f"last {window}"
    print(f"{'setting':8} {'step 1':>7} {first:>9} {last:>8} {'< 1.5 from':>11} {'loss':>7}")
    chosen = args.settings.split(",")
    ends = {}
    for name, overrides in settings(args.bias_rate, args.aux_coef).items():
        if name not in chosen:
            continue
        loads, loss = train_setting(overrides, flavor, args.steps, args.seq_len, args.batch)
        start, end = statistics.fmean(loads[:window]), statistics.fmean(loads[-window:])
        ends[name] = end
        below = first_step_staying_below(loads, EVEN_ENOUGH)
        print(f"{name:8} {loads[0]:7.2f} {start:9.2f} {end:8.2f} {below:>11} {loss:7.4f}", flush=True)
    loads = ", ".join(f"{name} {end:.2f}" for name, end in ends.items())
    ratio = f" (none / bias {ends['none'] / ends['bias']:.2f})" if {"none", "bias"} <= ends.keys() else ""
    print(f"max/mean expert load, mean of the last {window} steps: {loads}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
