"""The step-time estimator against a measured run, on CPU ranks.

    python benchmarks/estimate_check.py                 # about 40 s
    python benchmarks/estimate_check.py --model debug   # faster, less telling

The estimator's time model is written for GPUs, but nothing in it is GPU-specific: give it
a device's peak FLOP/s and the bandwidth between its ranks and it predicts a step. Here
the "device" is one CPU core (one torch thread per rank) and the link is gloo between two
local processes, both measured in this run:

  peak     the FLOP/s of one thread on a large float32 matmul (2048 x 2048 x 2048, best
           of 5), i.e. what the core reaches on the best shape, like a GPU's data-sheet peak
  link     bytes/s one rank sends in a gloo all-gather of 64 MiB float32 between two
           processes (best of 5), per direction: the estimator's intra-node bandwidth

Then benchmarks/throughput.py's own runner trains the model on 1 rank and with FSDP over
2 ranks (eager, float32, no activation checkpointing; seq --seq-len, batch 1), and the
estimator predicts the same two configurations with that peak, that bandwidth and its
default efficiency (0.5 of peak). The table shows the predicted compute and communication
time, the predicted and measured step time, and their ratio. The last line is

    measured / predicted tokens/s per rank, FSDP 2 ranks = X.XX

1.00 would be a perfect prediction. What the model leaves out shows up in the ratio: gloo
collectives need CPU time on the same cores as compute (on a GPU, copy engines and NICs
do that work), and per-step overheads that small CPU steps do not hide.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput  # noqa: E402  (the runner and models of benchmarks/throughput.py)
from rank_process import end_rank, free_port  # noqa: E402

from titanlite.estimate import Hardware, estimate_step_time  # noqa: E402

ALL_GATHER_BYTES = 64 * 2**20


def matmul_flops(repeats: int = 5, size: int = 2048) -> float:
    """FLOP/s of one thread on a square float32 matmul, best of `repeats`."""
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _gather_rank(rank: int, port: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shard = torch.randn(ALL_GATHER_BYTES // 4 // 2)
    gathered = torch.empty(ALL_GATHER_BYTES // 4)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_single(gathered, shard)
        best = min(best, time.perf_counter() - start)
    if rank == 0:
        # In a 2-rank all-gather each rank sends its half: (n - 1) / n of the whole.
        Path(out).write_text(str((ALL_GATHER_BYTES / 2) / best))
    end_rank()


def gloo_bandwidth(repeats: int = 5) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bw")
        mp.start_processes(_gather_rank, args=(free_port(), repeats, out), nprocs=2, start_method="spawn", join=True)
        return float(Path(out).read_text())


def predict(model: str, layout: throughput.Layout, hardware: Hardware, seq_len: int, batch: int):
    from titanlite.models.llama import LLAMA3_FLAVORS

    flavor, args = throughput.MODELS[model]
    model_args = args if args is not None else LLAMA3_FLAVORS[flavor]
    return estimate_step_time(
        model_args,
        seq_len=seq_len,
        local_batch_size=batch,
        hardware=hardware,
        dp_replicate=layout.replicate,
        dp_shard=layout.shard,
        world_size=layout.ranks,
        param_dtype="float32",
        reduce_dtype="float32",
        ac_mode="none",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m", choices=sorted(throughput.MODELS), help="model (default 100m)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out (default 4)")
    options = parser.parse_args()
    peak, link = matmul_flops(), gloo_bandwidth()
    hardware = Hardware(
        name="cpu-core",
        peak_flops=peak,
        memory_bytes=24 * 2**30,
        intra_node_bw=link,
        inter_node_bw=link,
        gpus_per_node=2,
    )
    print(
        f"titanlite estimate check, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before"
    )
    print(
        f"measured: one thread {peak / 1e9:.1f} GFLOP/s on a 2048^3 float32 matmul; gloo all-gather "
        f"{link / 1e9:.2f} GB/s per rank per direction"
    )
    runner = argparse.Namespace(steps=options.steps, warmup=1, seq_len=options.seq_len, threads=1)
    batch = 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="titanlite-estimate-check-") as work:
        for name in ("single", "fsdp2"):
            layout = throughput.LAYOUTS[name]
            measured = throughput.run_one(options.model, layout, False, runner, batch, Path(work))
            predicted = predict(options.model, layout, hardware, options.seq_len, batch)
            rows.append((name, predicted, measured))
    print()
    print(
        "| layout | predicted compute s | predicted comm s | predicted step s | measured step s | "
        "predicted tok/s/rank | measured tok/s/rank | measured / predicted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, predicted, measured in rows:
        measured_tps = min(measured.per_rank_tps)
        print(
            f"| {name} | {predicted.compute_s:.3f} | {predicted.comm_s:.3f} | {predicted.step_s:.3f} | "
            f"{measured.step_seconds:.3f} | {predicted.tokens_per_second_per_device:,.0f} | {measured_tps:,.0f} | "
            f"{measured_tps / predicted.tokens_per_second_per_device:.2f} |"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} after")
    name, predicted, measured = rows[-1]
    ratio = min(measured.per_rank_tps) / predicted.tokens_per_second_per_device
    print(
        f"measured / predicted tokens/s per rank, FSDP 2 ranks = {ratio:.2f} (verdict predicted: {predicted.verdict})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
