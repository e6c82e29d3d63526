"""Float8 against bf16 training on one GPU: step time and loss of an 8B-shaped stack of
Llama 3 blocks, compiled, trained by titanlite's Trainer.

    python benchmarks/gpu_float8.py                          # on a machine with a CUDA GPU
    python benchmarks/gpu_float8.py --recipes tensorwise --layers 8 --steps 40
    python benchmarks/gpu_float8.py --cpu-dry-run            # the same code on the CPU, emulated

Without a CUDA device (and without --cpu-dry-run) it prints "no GPU: skipped" and exits 0.

The model is Llama 3 8B's shape (dim 4096, 32 heads, 8 key/value heads, SwiGLU hidden 14336,
vocabulary 128256) with `--layers` blocks (default 4). Each run is its own process: the
same Trainer, seed and data (the built-in python_stdlib text), seq `--seq-len` (default
8192), batch 1, bf16 autocast over float32 weights, per-op selective activation
checkpointing, each block and the loss compiled. The float8 runs are the trainer's own
(`--model.converters float8`, `--quantize.linear.float8.recipe_name` each of `--recipes`,
torchao's recipe names): the layers whose shapes float8 does not speed up and the output
projection stay in bf16, as the start-up lines say. Reported per run: the median step time and tokens/s of
the steps after `--warmup`, the largest max-active memory, and the mean loss of the last
5 steps, with float8 / bf16 ratios.

--cpu-dry-run runs every line on the CPU with the tiny model (seq 64, 4 steps, no compile, torchao's
emulated float8, every layer of a size divisible by 16 converted), except the lines marked
"# cuda-only" (gpu_check.CUDA_ONLY); its numbers mean nothing.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import _read_metrics  # noqa: E402
from rank_process import free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

from titanlite.metrics import tags  # noqa: E402
from titanlite.models.llama import LLAMA3_FLAVORS  # noqa: E402

FLAVOR, DRY_RUN_FLAVOR = "float8stack", "tiny"
LOSS_STEPS = 5  # the loss compared: the mean of the last this many steps
STEP_TIME = "time_metrics/end_to_end(s)"


def register_flavor(layers: int) -> None:
    LLAMA3_FLAVORS[FLAVOR] = dataclasses.replace(LLAMA3_FLAVORS["8B"], n_layers=layers)


def trainer_argv(options: argparse.Namespace, dump: str, recipe: str) -> list[str]:
    argv = [
        *("--model.flavor", DRY_RUN_FLAVOR if options.cpu_dry_run else FLAVOR, "--job.dump_folder", dump),
        *("--training.seq_len", str(options.seq_len), "--training.local_batch_size", "1"),
        *("--training.steps", str(options.steps), "--training.mixed_precision_param", "bfloat16"),
        *("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
        *("--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "1"),
    ]
    argv += ["--compile.enable", "--compile.components", "model,loss"] if not options.cpu_dry_run else []
    argv += ["--metrics.peak_tflops", "1"] if options.cpu_dry_run else []
    if recipe == "bf16":
        return argv
    argv += ["--model.converters", "float8", "--quantize.linear.float8.recipe_name", recipe]
    # The dry run's tiny layers are all below torchao's size thresholds: take every one float8 can.
    dry_run = ["--quantize.linear.float8.emulate", "--quantize.linear.float8.skip_small_layers", "false"]
    return argv + (dry_run if options.cpu_dry_run else [])


def _worker(_, argv: list[str], port: int, dry_run: bool, layers: int) -> None:
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    torchrun_environment(0, 1, port, LOG_RANK="")
    if dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    register_flavor(layers)
    quiet_every_rank_lines()
    trainer = Trainer(parse_args(argv))
    # What is timed is the trainer's own conversion (model.converters), never a swap of ours.
    converted = sum(type(module).__name__.endswith("Float8Linear") for module in trainer.model.modules())
    assert ("--model.converters" in argv) == (converted > 0), f"gpu_float8: {converted} layers converted for {argv}"
    trainer.train()


def print_float8_layers(argv: list[str], layers: int) -> None:
    """The trainer's start-up lines on the layers float8 converts (its ranks log nothing here)."""
    from titanlite.config import parse_args
    from titanlite.plan import meta_model, run_model_args
    from titanlite.quantize import float8_layer_choice

    register_flavor(layers)
    job_config = parse_args(argv)
    float8 = job_config.quantize.linear.float8
    model = meta_model(job_config, run_model_args(job_config))
    print("\n".join(float8_layer_choice(model, float8).lines(float8)))


def dry_run_sized(options: argparse.Namespace) -> argparse.Namespace:
    """The options, with a CPU dry run's short sequence and few steps."""
    if options.cpu_dry_run:
        options.seq_len, options.steps, options.warmup = 64, 4, 1
    return options


def measure(options: argparse.Namespace, recipe: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="titanlite-gpu-float8-") as dump:
        argv = trainer_argv(options, dump, recipe)
        if recipe != "bf16":
            print_float8_layers(argv, options.layers)
        mp.start_processes(
            _worker,
            args=(argv, free_port(), options.cpu_dry_run, options.layers),
            nprocs=1,
            start_method="spawn",
            join=True,
        )
        records = _read_metrics(Path(dump))
    steady = [r for r in records if r["step"] > options.warmup]
    memory = [r[tags.MAX_ACTIVE_GIB] for r in steady if tags.MAX_ACTIVE_GIB in r]
    return {
        "recipe": recipe,
        "step_s": statistics.median(r[STEP_TIME] for r in steady),
        "tokens_per_s": statistics.median(r[tags.TPS] for r in steady),
        "loss": statistics.mean(r[tags.LOSS] for r in records[-LOSS_STEPS:]),
        "max_active_gib": max(memory) if memory else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="tensorwise,rowwise", help="torchao float8 recipes, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="blocks of the 8B shape")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same code on the CPU, emulated float8")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available() and not options.cpu_dry_run:
        print("no GPU: skipped")
        return 0
    results = [measure(dry_run_sized(options), recipe) for recipe in ["bf16", *options.recipes.split(",")]]
    device = "CPU (dry run, emulated float8)" if options.cpu_dry_run else torch.cuda.get_device_name(0)
    print(f"titanlite float8 vs bf16 on {device}, torch {torch.__version__}")
    compiled = "not compiled" if options.cpu_dry_run else "compiled"
    shape = f"{options.layers} blocks of Llama 3 8B's shape, seq {options.seq_len}, batch 1"
    print(f"{shape}, {compiled}, {options.steps} steps")
    print("| run | step s | tokens/s | speed-up | max active GiB | loss (last 5) | loss gap |")
    print("|---|---|---|---|---|---|---|")
    base = results[0]
    for r in results:
        memory = f"{r['max_active_gib']:.1f}" if r["max_active_gib"] is not None else "n/a"
        print(
            f"| {r['recipe']} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | {base['step_s'] / r['step_s']:.2f}x | "
            f"{memory} | {r['loss']:.4f} | {100 * (r['loss'] / base['loss'] - 1):+.2f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
