"""Pipeline parallelism on CPU ranks against the estimator: step time per schedule and
micro-batch count (the bubble model), and per-rank peak memory (the per-stage estimate).

    python benchmarks/pipeline.py              # debug model, PP 2, 4 schedules x m = 2, 4, 8 (70-85 s)
    python benchmarks/pipeline.py --quick      # tiny model, m = 2, one timed step each (seconds)
    python benchmarks/pipeline.py --schedules 1F1B,ZBVZeroBubble --microbatches 4,8 --seq-len 256

Two gloo ranks (spawned as torchrun would, one torch thread each: a rank stands for one
device and its core) form a pipeline of 2 ranks, built as the trainer builds it
(trainer_setup.build_run_model: the model's own split, float32, no activation checkpointing)
and run with each schedule (GPipe and 1F1B: one stage per rank; Interleaved1F1B and
ZBVZeroBubble: two), one sequence per micro-batch. In one launch, for each schedule and
micro-batch count m, they take `--warmup` steps and then `--steps` timed ones (forward and
backward through the schedule, clipping, optimizer step); a step's time is the slower rank's,
and the figure is the median. Inside the schedule each rank also times its stages' forward and
backward calls (torch's forward_one_chunk, backward_one_chunk, backward_weight_one_chunk, which
start after their inputs have arrived): its busy time. The measured bubble is 1 - the busiest
rank's busy time / the schedule's time, the estimator's convention. One more step runs under
PyTorch's memory tracker on real tensors: each rank's peak bytes (not under the split-backward
schedules, whose autograd.grad calls torch's module tracker cannot follow).

The ranks also measure what limits overlap on a shared CPU: before and after each run, how
much slower each computes while the other computes too than alone (the same matmuls, one rank
at a time, then both; the larger of the two figures is shown: x1 means each rank had a core
to itself, x2 that they shared one, e.g. with another process on the machine), and once the
time of one send of a stage boundary's activation (one way, median of a ping-pong).

Predicted, in this process, with the same configuration:
  step time  estimate.step_time with a "device" measured here: the FLOP/s of one thread on
             a 2048^3 float32 matmul (best of 5) as its peak, the ranks' own send/recv
             bandwidth as its link, the default efficiency (0.5). The step is the busiest
             rank's compute / (1 - bubble), the bubble from the schedule's own actions run on
             a clock (titanlite.parallel.bubble), plus the sends.
  memory     estimate.estimate_memory on a fake process group: each rank's simulated step
             plus the activations of the micro-batches its schedule keeps in flight.

Printed: one row per schedule and m with the predicted and measured bubble, each rank's
contention figure, each rank's backward calls' time over its forward calls' (the estimate takes
2 without recomputation), the busiest rank's busy time over the predicted compute (the
efficiency guess), the predicted and measured step time and their ratio, and each rank's
measured and estimated peak with their ratio. measured / predicted step time is
(busy / compute predicted) x (1 - predicted bubble) / (1 - measured bubble), near enough (the
optimizer step and the clipping are outside the schedule): the level and the bubble's shape
apart. The last lines are, per schedule,

    measured / predicted step time, PP 2 <schedule>, m = 2, 4, 8: r2, r4, r8
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

from titanlite.config.parallelism import SPLIT_BACKWARD_SCHEDULES, canonical_schedule  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MICROBATCHES = (2, 4, 8)
SEND_BYTES = 16 * 2**20
CONTENTION_MATMUL = 512  # the square float32 matmul both ranks time, alone and together
COMPUTE_CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def config_argv(flavor: str, seq_len: int, microbatches: int, schedule: str, ac_mode: str = "none") -> list[str]:
    return [
        *("--model.name", "llama3", "--model.flavor", flavor),
        *("--training.seq_len", str(seq_len), "--training.local_batch_size", str(microbatches)),
        *("--training.mixed_precision_param", "float32"),  # CPUs have no fast bf16 matmul
        # By default none: measure the pipeline, not recomputation.
        *("--activation_checkpoint.mode", ac_mode, "--activation_checkpoint.selective_ac_option", "op"),
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


def _send_seconds(rank: int, numel: int, repeats: int = 20) -> float:
    """One way of a ping-pong of ``numel`` floats between the ranks (median)."""
    import torch.distributed as dist

    buffer, times = torch.zeros(numel), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, dst=1)
            dist.recv(buffer, src=1)
        else:
            dist.recv(buffer, src=0)
            dist.send(buffer, dst=0)
        times.append((time.perf_counter() - start) / 2)
    return _slowest(statistics.median(times))


def _matmul_seconds(repeats: int = 20) -> float:
    a = torch.randn(CONTENTION_MATMUL, CONTENTION_MATMUL)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, a)
    return time.perf_counter() - start


def _contention(rank: int, rounds: int = 3) -> float:
    """How much slower this rank's matmuls run while the other rank's run too than alone
    (median over rounds; the waiting rank blocks in a barrier)."""
    import torch.distributed as dist

    alone, together = [], []
    for _ in range(rounds):
        for turn in range(2):
            dist.barrier()
            if turn == rank:
                alone.append(_matmul_seconds())
            dist.barrier()
        together.append(_matmul_seconds())
    return statistics.median(together) / statistics.median(alone)


def _slowest(seconds: float) -> float:
    """The largest of the ranks' figures."""
    import torch.distributed as dist

    figure = torch.tensor(seconds)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX)
    return figure.item()


def _time_compute(pipeline, busy: dict[str, float]) -> None:
    """Add the seconds of the pipeline's stage forward calls to busy["forward"] and of their
    backward calls (whole, inputs' gradient or weights') to busy["backward"]."""
    for stage in pipeline.stages:
        for name in COMPUTE_CALLS:
            call, kind = getattr(stage, name), "forward" if name == "forward_one_chunk" else "backward"

            def timed(*args, _call=call, _kind=kind, **kwargs):
                start = time.perf_counter()
                try:
                    return _call(*args, **kwargs)
                finally:
                    busy[_kind] += time.perf_counter() - start

            setattr(stage, name, timed)


def _measure(argv: list[str], rank: int, warmup: int, steps: int) -> dict:
    """Median step time (slowest rank), median measured bubble and this rank's tracked peak
    for one schedule and micro-batch count."""
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
    busy = {"forward": 0.0, "backward": 0.0}
    _time_compute(pipeline, busy)

    def step() -> float:
        """The step; returns the seconds of its schedule run."""
        start = time.perf_counter()
        pipeline.forward_backward(*batch)
        scheduled = time.perf_counter() - start
        clip_grad_norm_(model.parameters(), training.max_norm, stages=plan.parallel_dims.pp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return scheduled

    before = _contention(rank)  # as loaded as the machine is around the run
    times, bubbles, busiest, forwards, backwards = [], [], [], [], []
    for index in range(warmup + steps):
        dist.barrier()
        busy.update(forward=0.0, backward=0.0)
        start = time.perf_counter()
        scheduled = step()
        if index >= warmup:
            times.append(_slowest(time.perf_counter() - start))
            busiest.append(_slowest(busy["forward"] + busy["backward"]))
            bubbles.append(1 - busiest[-1] / _slowest(scheduled))
            forwards.append(busy["forward"])
            backwards.append(busy["backward"])
    figures = {
        "step_s": statistics.median(times),
        "bubble": statistics.median(bubbles),
        "busy_s": statistics.median(busiest),
        "backward_per_forward": statistics.median(backwards) / statistics.median(forwards),
        "contention": max(before, _contention(rank)),
    }
    # torch's module tracker (under the memory tracker) fails inside the split backward's
    # autograd.grad ("A leaf node was passed to _will_engine_execute_node ..."): no peak there.
    if plan.pipeline.schedule not in SPLIT_BACKWARD_SCHEDULES:
        figures["peak_bytes"] = fold_step(tracked_call(model, optimizer, step))[0]["total"]
    return figures


def _rank(rank: int, port: int, argvs: dict, boundary_numel: int, warmup: int, steps: int, out_dir: str) -> None:
    torchrun_environment(rank, 2, port, LOG_RANK="")
    torch.set_num_threads(1)  # one rank, one core: a rank stands for one device
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    report = {"bandwidth": _link_bandwidth(rank), "send_s": _send_seconds(rank, boundary_numel), "runs": {}}
    for key, argv in argvs.items():
        report["runs"][key] = _measure(argv, rank, warmup, steps)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    end_rank()


# --- the driver ------------------------------------------------------------------------


def measure(argvs: dict, boundary_numel: int, warmup: int, steps: int) -> list[dict]:
    """Both ranks' reports, in rank order."""
    with tempfile.TemporaryDirectory(prefix="titanlite-pipeline-") as out_dir:
        args = (free_port(), argvs, boundary_numel, warmup, steps, out_dir)
        mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn", join=True)
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
        ac_mode=config.activation_checkpoint.mode,
        selective_ac_option=config.activation_checkpoint.selective_ac_option,
        pipeline=plan.pipeline,
    )


def predict_memory(argv: list[str]) -> list[int]:
    """The estimator's peak bytes of each pp rank."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_memory

    return [rank.peak_bytes for rank in estimate_memory(parse_args(argv), 2).pipeline]


def _names(text: str, what: str, parse) -> list:
    try:
        values = [parse(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values:
        raise SystemExit(f"pipeline.py: {what} must be a comma-separated list, got {text!r}")
    return values


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, seq 32, m = 2, 1 warm-up and 1 timed step")
    parser.add_argument("--model", default="debugmodel", help="llama3 flavor (default debugmodel)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help=f"pipeline schedules (default {','.join(SCHEDULES)})"
    )
    parser.add_argument(
        "--microbatches",
        default="2,4,8",
        help="micro-batch counts (default 2,4,8; 1F1B skips those below its 2 stages)",
    )
    parser.add_argument(
        "--ac-mode",
        default="none",
        choices=("none", "full", "selective"),
        help="activation checkpointing in the stages (default none; selective: per op)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    options = parser.parse_args(argv)
    if options.quick:
        options.model, options.seq_len, options.microbatches, options.warmup, options.steps = "tiny", 32, "2", 1, 1
    options.schedules = _names(options.schedules, "--schedules", str)
    options.microbatches = _names(options.microbatches, "--microbatches", int)
    return options


def main(argv: list[str] | None = None) -> int:
    from titanlite.models.llama.args import LLAMA3_FLAVORS

    options = parse_options(argv)
    runs = {}  # "schedule m" -> its config's arguments
    for name in options.schedules:
        schedule = canonical_schedule(name)
        if schedule is None:
            raise SystemExit(f"pipeline.py: --schedules names an unknown schedule {name!r}")
        # torch's 1F1B (and DualPipeV) refuses fewer micro-batches than stages.
        for m in options.microbatches:
            if m >= 2 or schedule not in ("1F1B", "DualPipeV"):
                runs[f"{schedule} {m}"] = config_argv(options.model, options.seq_len, m, schedule, options.ac_mode)
    print(
        f"titanlite pipeline benchmark, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before"
    )
    peak_flops = matmul_flops(*((2, 1024) if options.quick else ()))
    boundary_numel = options.seq_len * LLAMA3_FLAVORS[options.model].dim  # one sequence's activation
    ranks = measure(runs, boundary_numel, options.warmup, options.steps)
    bandwidth = min(rank["bandwidth"] for rank in ranks)
    print(
        f"llama3 {options.model}, seq {options.seq_len}, PP 2, one sequence per micro-batch; "
        f"one thread {peak_flops / 1e9:.1f} GFLOP/s, send/recv {bandwidth / 1e9:.2f} GB/s"
    )
    print(
        f"one send of a stage boundary's activation ({boundary_numel * 4 / 2**10:.0f} KiB): "
        f"{ranks[0]['send_s'] * 1e3:.2f} ms one way"
    )
    print()
    print(
        "| schedule | m | bubble predicted / measured | contention | backward / forward | busy / compute predicted | "
        "step s predicted / measured | measured / predicted | rank 0 peak MiB measured / estimated | "
        "rank 1 peak MiB measured / estimated |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[str]] = {}
    for key, argv in runs.items():
        schedule, m = key.split()
        predicted = predict_step(argv, peak_flops, bandwidth)
        run, other = ranks[0]["runs"][key], ranks[1]["runs"][key]
        ratio = run["step_s"] / predicted.step_s
        ratios.setdefault(schedule, []).append(f"{ratio:.2f}")
        cells = ["not tracked (split backward)"] * 2
        if "peak_bytes" in run:
            cells = []
            for rank, estimated in enumerate(predict_memory(argv)):
                real = ranks[rank]["runs"][key]["peak_bytes"]
                cells.append(f"{real / 2**20:.2f} / {estimated / 2**20:.2f} = {real / estimated:.2f}")
        print(
            f"| {schedule} | {m} | {predicted.bubble:.1%} / {run['bubble']:.1%} | "
            f"x{run['contention']:.2f}, x{other['contention']:.2f} | "
            f"{run['backward_per_forward']:.2f}, {other['backward_per_forward']:.2f} | "
            f"{run['busy_s'] / predicted.compute_s:.2f} | {predicted.step_s:.4f} / {run['step_s']:.4f} | "
            f"{ratio:.2f} | {cells[0]} | {cells[1]} |"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} after")
    for schedule, figures in ratios.items():
        counts = [key.split()[1] for key in runs if key.split()[0] == schedule]
        print(f"measured / predicted step time, PP 2 {schedule}, m = {', '.join(counts)}: {', '.join(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
