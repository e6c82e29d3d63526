"""Pipeline parallelism on CPU ranks against the estimator: step time per micro-batch count
(the bubble model) and per-stage peak memory (the per-stage estimate).

    python benchmarks/pipeline.py              # debug model, PP 2, m = 1, 2, 4, 8 (about a minute)
    python benchmarks/pipeline.py --quick      # tiny model, m = 1, 2, one timed step each (seconds)
    python benchmarks/pipeline.py --schedule 1F1B --seq-len 256

Two gloo ranks (spawned as torchrun would, one torch thread each: a rank stands for one
device and its core) form a pipeline of 2 stages, built as the trainer builds them
(trainer_setup.build_run_model: the model's own split, float32, no activation checkpointing)
and run with the schedule (default GPipe: torch's 1F1B refuses fewer micro-batches than
stages, so it skips m = 1), one sequence per micro-batch. In one launch, for
each micro-batch count m, they take `--warmup` steps and then `--steps` timed ones (forward
and backward through the schedule, clipping, optimizer step); a step's time is the slower
rank's, and the figure is the median. One more step runs under PyTorch's memory tracker on
real tensors: each rank's peak bytes (parameters, gradients, optimizer state, activations,
temporaries).

Predicted, in this process, with the same configuration:
  step time  estimate.step_time with a "device" measured here: the FLOP/s of one thread on
             a 2048^3 float32 matmul (best of 5) as its peak, the ranks' own send/recv
             bandwidth as its link, the default efficiency (0.5). The step is the busiest
             rank's compute / (1 - bubble), bubble = (p - 1) / (m + p - 1), plus the sends.
  memory     estimate.estimate_memory on a fake process group: each stage's simulated step
             plus the activations of the micro-batches its schedule keeps in flight.

Printed: one row per m with measured and predicted step time and their ratio, and each
stage's measured and estimated peak with their ratio. A ratio that stays level across m
means the bubble model has the right shape (the level itself is the efficiency guess and
per-step overheads). The last line is

    measured / predicted step time, PP 2 <schedule>, m = 1, 2, 4, 8: r1, r2, r4, r8
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimate_check import matmul_flops  # noqa: E402
from rank_process import end_rank, free_port, torchrun_environment  # noqa: E402

MICROBATCHES = (1, 2, 4, 8)
SEND_BYTES = 16 * 2**20


def config_argv(flavor: str, seq_len: int, microbatches: int, schedule: str) -> list[str]:
    return [
        *("--model.name", "llama3", "--model.flavor", flavor),
        *("--training.seq_len", str(seq_len), "--training.local_batch_size", str(microbatches)),
        *("--training.mixed_precision_param", "float32"),  # CPUs have no fast bf16 matmul
        *("--activation_checkpoint.mode", "none"),  # measure the pipeline, not recomputation
        *("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule),
        *("--parallelism.pipeline_parallel_microbatch_size", "1"),
    ]


# --- inside each rank ------------------------------------------------------------------


def _link_bandwidth(rank: int) -> float:
    """Bytes/s of a send from rank 0 to rank 1 (best of 3), as both ranks see it."""
    import torch.distributed as dist

    buffer = torch.zeros(SEND_BYTES // 4)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, dst=1)
        else:
            dist.recv(buffer, src=0)
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return SEND_BYTES / best


def _slowest(seconds: float) -> float:
    """The largest of the ranks' figures."""
    import torch.distributed as dist

    figure = torch.tensor(seconds)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX)
    return figure.item()


def _measure(argv: list[str], rank: int, warmup: int, steps: int) -> dict:
    """Median step time (slowest rank) and this rank's tracked peak for one micro-batch count."""
    import torch.distributed as dist

    from titanlite.config import parse_args
    from titanlite.estimate.tracker import fold_step, tracked_call
    from titanlite.loss import cross_entropy_sum
    from titanlite.optim import build_optimizer
    from titanlite.parallel import clip_grad_norm_
    from titanlite.plan import plan_run
    from titanlite.trainer_setup import build_run_model

    config = parse_args(argv)
    plan = plan_run(config, 2)
    training = config.training
    global_tokens = plan.global_batch_size * training.seq_len
    model, pipeline = build_run_model(
        config,
        plan,
        plan.parallel_dims.build_mesh("cpu"),
        torch.device("cpu"),
        lambda logits, labels: cross_entropy_sum(logits, labels) / global_tokens,
    )
    optimizer = build_optimizer(model.parameters(), config.optimizer)
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 256, (training.local_batch_size, training.seq_len), generator=generator) for _ in "xy"]

    def step() -> None:
        pipeline.forward_backward(*batch)
        clip_grad_norm_(model.parameters(), training.max_norm, stages=plan.parallel_dims.pp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for index in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if index >= warmup:
            times.append(_slowest(time.perf_counter() - start))
    peak, _, _ = fold_step(tracked_call(model, optimizer, step))
    return {"step_s": statistics.median(times), "peak_bytes": peak["total"]}


def _rank(rank: int, port: int, argvs: dict, warmup: int, steps: int, out_dir: str) -> None:
    torchrun_environment(rank, 2, port, LOG_RANK="")
    torch.set_num_threads(1)  # one rank, one core: a rank stands for one device
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    report = {"bandwidth": _link_bandwidth(rank), "runs": {}}
    for microbatches, argv in argvs.items():
        report["runs"][microbatches] = _measure(argv, rank, warmup, steps)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    end_rank()


# --- the driver ------------------------------------------------------------------------


def measure(argvs: dict, warmup: int, steps: int) -> list[dict]:
    """Both ranks' reports, in rank order."""
    with tempfile.TemporaryDirectory(prefix="titanlite-pipeline-") as out_dir:
        mp.start_processes(
            _rank, args=(free_port(), argvs, warmup, steps, out_dir), nprocs=2, start_method="spawn", join=True
        )
        return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(2)]


def predict_step(argv: list[str], peak_flops: float, bandwidth: float):
    from titanlite.config import parse_args
    from titanlite.estimate import Hardware, estimate_step_time
    from titanlite.plan import plan_run

    config = parse_args(argv)
    plan = plan_run(config, 2)
    hardware = Hardware("cpu-core", peak_flops, 24 * 2**30, bandwidth, bandwidth, gpus_per_node=2)
    return estimate_step_time(
        plan.model_args,
        seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
        hardware=hardware,
        dp_shard=1,
        param_dtype="float32",
        reduce_dtype="float32",
        ac_mode="none",
        pipeline=plan.pipeline,
    )


def predict_memory(argv: list[str]) -> list[int]:
    """The estimator's peak bytes of each pp rank."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_memory

    return [rank.peak_bytes for rank in estimate_memory(parse_args(argv), 2).pipeline]


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, seq 32, m = 1 and 2, 1 warm-up and 1 timed step"
    )
    parser.add_argument("--model", default="debugmodel", help="llama3 flavor (default debugmodel)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument(
        "--schedule", default="GPipe", help="pipeline schedule (default GPipe; 1F1B skips m = 1, which it refuses)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per micro-batch count (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per micro-batch count (default 6)")
    options = parser.parse_args(argv)
    if options.quick:
        options.model, options.seq_len, options.warmup, options.steps = "tiny", 32, 1, 1
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    # torch's 1F1B and the looped schedules need at least as many micro-batches as stages.
    counts = [m for m in MICROBATCHES[: 2 if options.quick else None] if m >= 2 or options.schedule.lower() == "gpipe"]
    argvs = {m: config_argv(options.model, options.seq_len, m, options.schedule) for m in counts}
    print(
        f"titanlite pipeline benchmark, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before"
    )
    peak_flops = matmul_flops(*((2, 1024) if options.quick else ()))
    ranks = measure(argvs, options.warmup, options.steps)
    bandwidth = min(rank["bandwidth"] for rank in ranks)
    print(
        f"llama3 {options.model}, seq {options.seq_len}, PP 2 {options.schedule}, one sequence per micro-batch; "
        f"one thread {peak_flops / 1e9:.1f} GFLOP/s, send/recv {bandwidth / 1e9:.2f} GB/s"
    )
    print()
    print(
        "| m | bubble | predicted step s | measured step s | measured / predicted | "
        "stage 0 peak MiB measured / estimated | stage 1 peak MiB measured / estimated |"
    )
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for m, argv in argvs.items():
        predicted = predict_step(argv, peak_flops, bandwidth)
        measured = ranks[0]["runs"][str(m)]["step_s"]
        ratios.append(measured / predicted.step_s)
        cells = []
        for stage, estimated in enumerate(predict_memory(argv)):
            real = ranks[stage]["runs"][str(m)]["peak_bytes"]
            cells.append(f"{real / 2**20:.2f} / {estimated / 2**20:.2f} = {real / estimated:.2f}")
        print(
            f"| {m} | {predicted.bubble:.1%} | {predicted.step_s:.4f} | {measured:.4f} | {ratios[-1]:.2f} | "
            f"{cells[0]} | {cells[1]} |"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} after")
    print(
        f"measured / predicted step time, PP 2 {options.schedule}, m = {', '.join(map(str, counts))}: "
        + ", ".join(f"{ratio:.2f}" for ratio in ratios)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
