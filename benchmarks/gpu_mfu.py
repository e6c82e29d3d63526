"""Model FLOPs utilisation (MFU) of a ~1 B-parameter Llama 3 on one GPU, trained with
bf16, torch.compile and selective activation checkpointing.

    python benchmarks/gpu_mfu.py                         # on a machine with a CUDA GPU
    python benchmarks/gpu_mfu.py --batch 2 --steps 30 --ac-option 2
    python benchmarks/gpu_mfu.py --cpu-dry-run           # the same code on CPU, the tiny model

Without a CUDA device the script prints "no GPU: skipped" and exits 0.

With one, it starts one fresh process (torch.multiprocessing, spawn; one rank, so no
process group and no FSDP: the trainer casts to bf16 with autocast) that builds titanlite's
own Trainer for a flavor registered inside the worker, "bench1b": dim 2048, 16 blocks,
16 heads of 128 with 8 key/value heads, SwiGLU hidden 8192, vocabulary 128256 (the Llama 3
tokenizer's size; the byte tokenizer feeds it ids below 258, which costs the same FLOPs):
1.53 B parameters, of which the blocks hold 1.01 B, the output projection 0.26 B and
the token embedding (a lookup, not counted in the FLOPs) 0.26 B. Training: seq 2048, local batch
`--batch` (default 4: about 45 GB with float32 master weights, gradients and AdamW state
on an 80 GB H100), bf16 compute with float32 parameters, each block compiled (and the
loss), selective activation checkpointing per op (matmul and attention outputs kept,
the rest recomputed; `--ac-option`), metrics logged at every step.

The figures are the trainer's own metrics, read back from the JSONL it writes
(dump_folder/metrics/<run>/metrics.jsonl): "throughput(tps)", "tflops" and "mfu(%)" per
step, where MFU counts model FLOPs only (titanlite.metrics.flops: recomputation is work
done, not useful work) against the GPU's dense bf16 peak from the table in
titanlite.metrics.flops (`--peak-tflops` for a GPU the table lacks). The first
`--warmup` steps (compilation, allocator growth) are dropped and the median of the
rest is reported, with the largest step's peak memory. Beside it, the step-time
estimator's prediction for the same job config (titanlite.estimate.estimate_for_job_config,
its default efficiency) when the GPU is one of its hardware rows; the last line is

    MFU = X.X% of P TFLOPs (measured / estimated = R.RR)

`--cpu-dry-run` runs every line of the same code on CPU with the tiny model (seq 128,
batch 2, 6 steps, bf16 autocast, selective AC, no compile: tests/test_parity.py covers
compile on CPU) against a nominal 1 TFLOPs peak, except the lines marked "# cuda-only"
(gpu_check.CUDA_ONLY); tests/test_gpu_check.py runs it under coverage. Its numbers mean
nothing.

MFU is printed twice: with attention counted causally (the trainer's figure) and counted
whole, as torchtitan and most published MFU figures do (docs/metrics.md).

Options: --steps (default 20), --warmup (default 3), --seq-len (default 2048), --batch
(default 4), --ac-option (default op), --peak-tflops, --no-compile, --cpu-dry-run. Expected time on an
H100: about 2 minutes (compilation ~1 minute, 20 steps of 8k tokens). The dump folder is
a temporary folder, removed at the end.
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import free_port, quiet_every_rank_lines  # noqa: E402

from titanlite.metrics.flops import peak_flops_per_device  # noqa: E402
from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs  # noqa: E402

FLAVOR = "bench1b"
DRY_RUN_FLAVOR = "tiny"
MODEL_ARGS = LlamaArgs(
    dim=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=1024,
    ffn_dim_multiplier=1.5,
    rope_theta=500000.0,
)
TPS, TFLOPS, MFU, STEP_TIME, MAX_ACTIVE = (
    "throughput(tps)",
    "tflops",
    "mfu(%)",
    "time_metrics/end_to_end(s)",
    "memory/max_active(GiB)",
)


def register_flavor(heads: int) -> None:
    """bench1b with `heads` query heads (the head size is dim / heads; gpu_check's model has 32)."""
    LLAMA3_FLAVORS[FLAVOR] = dataclasses.replace(MODEL_ARGS, n_heads=heads)


def trainer_argv(options: argparse.Namespace, dump: str) -> list[str]:
    argv = [
        "--model.flavor",
        DRY_RUN_FLAVOR if options.cpu_dry_run else FLAVOR,
        "--job.dump_folder",
        dump,
        "--training.seq_len",
        str(options.seq_len),
        "--training.local_batch_size",
        str(options.batch),
        "--training.steps",
        str(options.steps),
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        options.ac_option,
        "--lr_scheduler.warmup_steps",
        "5",
        "--metrics.log_freq",
        "1",
    ]
    argv += ["--compile.enable", "--compile.components", "model,loss"] if options.compile else []
    argv += ["--ema.enable"] if options.ema else []
    return argv + ["--metrics.peak_tflops", str(options.peak_tflops)] if options.peak_tflops else argv


def _worker(rank: int, argv: list[str], port: int, cpu_only: bool, heads: int) -> None:
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOG_RANK="",
    )
    if cpu_only:  # the dry run stays on the CPU even where a GPU exists
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    register_flavor(heads)  # spawned workers start with the built-in flavor table

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    quiet_every_rank_lines()
    Trainer(parse_args(argv)).train()


def read_metrics(dump: Path) -> list[dict]:
    """The per-step records of the run's JSONL (validation lines have no throughput)."""
    files = sorted(dump.glob("metrics/*/metrics.jsonl"))
    if not files:
        raise RuntimeError(f"the run wrote no metrics.jsonl under {dump}/metrics")
    lines = files[-1].read_text().splitlines()
    return [record for record in map(json.loads, lines) if TPS in record]


def summarise(records: list[dict], warmup: int) -> dict:
    """Medians over the steps after the warm-up; the largest peak memory of those steps."""
    steady = [r for r in records if r["step"] > warmup]
    if not steady:
        raise RuntimeError(f"no step after the {warmup} warm-up steps was logged")
    summary = {key: statistics.median(r[key] for r in steady) for key in (TPS, TFLOPS, STEP_TIME)}
    summary[MFU] = statistics.median(r[MFU] for r in steady) if all(MFU in r for r in steady) else None
    memory = [r[MAX_ACTIVE] for r in steady if MAX_ACTIVE in r]
    summary[MAX_ACTIVE] = max(memory) if memory else None
    summary["steps"] = (steady[0]["step"], steady[-1]["step"])
    return summary


def _hardware_row(device_name: str):
    """The estimator's hardware row whose name is a word of the device name, with the
    peak the trainer uses for MFU, or None."""
    import re

    from titanlite.estimate import HARDWARE, get_hardware

    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for key in HARDWARE:
        if key in words:
            return get_hardware(key, peak_flops=peak_flops_per_device(device_name))
    return None


def estimate(argv: list[str], device_name: str):
    """The step-time estimator's prediction for this job on this GPU, or (None, why)."""
    try:
        from titanlite.config import parse_args
        from titanlite.estimate import estimate_for_job_config

        hardware = _hardware_row(device_name)
        if hardware is None:
            return None, f"the estimator has no hardware row for {device_name}"
        return estimate_for_job_config(parse_args(argv), world_size=1, hardware=hardware), None
    except Exception as error:  # an estimator being finished must not break the measurement
        return None, f"estimator failed: {type(error).__name__}: {error}"


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def print_report(options, device_name: str, model_args, summary: dict, predicted, why: str | None) -> None:
    from titanlite.metrics.flops import count_params, flops_per_token

    params = count_params(model_args)
    print(f"titanlite GPU MFU, {datetime.date.today()}, torch {torch.__version__}, {device_name}")
    print(
        f"llama3 {f'{DRY_RUN_FLAVOR} (CPU dry run)' if options.cpu_dry_run else FLAVOR}, {params / 1e6:,.1f} M params; "
        f"seq {options.seq_len} x local batch {options.batch}; bf16 autocast, "
        f"{'compile (model, loss)' if options.compile else 'no compile'}, "
        f"selective AC ({options.ac_option}); {options.heads} heads, EMA {'on' if options.ema else 'off'}; "
        f"median of steps {summary['steps'][0]}..{summary['steps'][1]}\n"
    )
    print("| source | tokens/s | TFLOPs | MFU % | step s | max active GiB |")
    print("|---|---|---|---|---|---|")
    print(
        f"| measured (trainer metrics) | {summary[TPS]:,.0f} | {summary[TFLOPS]:.1f} | {_fmt(summary[MFU], '.1f')} | "
        f"{summary[STEP_TIME]:.3f} | {_fmt(summary[MAX_ACTIVE], '.1f')} |"
    )
    if predicted is not None:
        print(
            f"| estimator ({predicted.hardware.name}, efficiency {predicted.efficiency}) | "
            f"{predicted.tokens_per_second_per_device:,.0f} | "
            f"{predicted.tokens_per_second_per_device * predicted.flops_per_token / 1e12:.1f} | "
            f"{predicted.mfu_percent:.1f} | {predicted.step_s:.3f} | |"
        )
    print()
    dry_run = "CPU dry run: the estimate is an H100's and the measurement a CPU's; neither means anything here"
    for note in filter(None, (dry_run if options.cpu_dry_run else None, why)):
        print(f"note: {note}")
    peak = summary[TFLOPS] * 100.0 / summary[MFU]  # the peak the trainer divided by
    ratio = f"measured / estimated = {summary[MFU] / predicted.mfu_percent:.2f}" if predicted else "no estimate"
    # The same tokens/s with attention's scores counted whole (torchtitan's and PaLM's convention).
    whole = flops_per_token(model_args, options.seq_len, causal_attention=False)
    whole_mfu = summary[MFU] * whole / flops_per_token(model_args, options.seq_len)
    print(f"MFU counting whole attention (torchtitan's convention) = {whole_mfu:.1f}%")
    print(f"MFU = {summary[MFU]:.1f}% of {peak:.0f} TFLOPs ({ratio})")


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (compilation)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="local batch size")
    parser.add_argument("--ac-option", default="op", help="selective AC option: op, or every N-th block")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak when the table lacks the GPU")
    parser.add_argument("--heads", type=int, default=16, help="query heads of bench1b (dim 2048 / heads each)")
    parser.add_argument("--ema", action="store_true", help="keep the weights' moving average, as gpu_check does")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave the model eager")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the same code on CPU with the tiny model")
    options = parser.parse_args(argv)
    if options.cpu_dry_run:
        options.seq_len, options.batch, options.steps, options.warmup = 128, 2, 6, 2
        options.peak_tflops, options.compile = options.peak_tflops or 1.0, False
    if options.steps <= options.warmup:
        parser.error("--steps must be larger than --warmup (some steps must be measured)")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    if not torch.cuda.is_available() and not options.cpu_dry_run:
        print("no GPU: skipped")
        return 0
    device_name = "CPU (dry run)" if options.cpu_dry_run else torch.cuda.get_device_name(0)
    if not options.peak_tflops and peak_flops_per_device(device_name) is None:
        raise SystemExit(f"gpu_mfu: no peak for {device_name} in metrics.flops; pass --peak-tflops")  # cuda-only
    register_flavor(options.heads)
    with tempfile.TemporaryDirectory(prefix="titanlite-gpu-mfu-") as dump:
        argv = trainer_argv(options, dump)
        args = (argv, free_port(), options.cpu_dry_run, options.heads)
        mp.start_processes(_worker, args=args, nprocs=1, start_method="spawn", join=True)
        summary = summarise(read_metrics(Path(dump)), options.warmup)
    model_args = LLAMA3_FLAVORS[DRY_RUN_FLAVOR if options.cpu_dry_run else FLAVOR]
    predicted, why = estimate(argv, "NVIDIA H100 80GB HBM3" if options.cpu_dry_run else device_name)
    print_report(options, device_name, model_args, summary, predicted, why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
