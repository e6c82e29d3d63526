"""Peak GPU memory of real training steps, eager and compiled, at two sequence lengths,
against the memory estimator, with what is live at each peak.

    python benchmarks/gpu_memory.py                         # on a machine with a CUDA GPU
    python benchmarks/gpu_memory.py --snapshots DIR         # also keep the allocator snapshots
    python benchmarks/gpu_memory.py --seq-lens 8192 --modes eager --no-estimate
    python benchmarks/gpu_memory.py --cpu-dry-run           # the same code on the CPU, debug sizes

Without a CUDA device (and without --cpu-dry-run) it prints "no GPU: skipped" and exits 0.

The model and training are gpu_check.py's run 1 ("check1b": a Llama-3-shaped 1 B model,
bf16 autocast over float32 weights, selective activation checkpointing, batch 1, EMA on),
at each sequence length of `--seq-lens`, eager and compiled (`--modes`). Each run is its
own process and trains STEPS steps. Per step it records the allocator's peaks since the
step began (`torch.cuda.memory_stats`: allocated, active, requested, reserved, and the
inactive split bytes that measure fragmentation) and the trainer's peaks after forward,
backward and the optimizer. The last step runs under the allocator's history recorder:
every block allocated in that step is replayed to the step's highest point, and the blocks
live there are grouped by the line of titanlite that allocated them and their size (the
"live at the peak" table); `--snapshots` keeps the raw snapshot (gzip'd pickle, readable
with torch.cuda's memory viz) for each run.

Beside each run, `titanlite.estimate.estimate_memory` for the same config (fake tensors,
in the parent process; `--no-estimate` skips it): the measured / estimated ratio of the
steady steps' largest allocated peak (against the estimate's peak) and reserved peak
(against its reserved figure, the caching allocator's slack added).

--cpu-dry-run runs every line on the CPU with the tiny model (seq 128, no compile), except
the lines marked "# cuda-only" (gpu_check.CUDA_ONLY); its numbers mean nothing.
"""

import argparse
import dataclasses
import gzip
import json
import pickle
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_check  # noqa: E402
from rank_process import free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

STEPS = 8  # 2 warm-up steps (compilation, allocator growth), 5 steady ones, 1 recorded
WARMUP = 2
GIB = 2**30
TOP_GROUPS = 12  # rows of the "live at the peak" table per run
STAT_KEYS = {
    "allocated": "allocated_bytes.all.peak",
    "active": "active_bytes.all.peak",
    "requested": "requested_bytes.all.peak",
    "reserved": "reserved_bytes.all.peak",
    "inactive_split": "inactive_split_bytes.all.peak",
    "alloc_retries": "num_alloc_retries",
}


def run_sizes(seq_len: int, mode: str, dry_run: bool) -> gpu_check.Sizes:
    base = gpu_check.DRY_RUN_SIZES if dry_run else gpu_check.GPU_SIZES
    return dataclasses.replace(base, seq_len=seq_len, compile=mode == "compiled" and not dry_run)


def trainer_argv(sizes: gpu_check.Sizes, dump: str) -> list[str]:
    """gpu_check's run 1, for STEPS steps, every step logged."""
    argv = gpu_check.trainer_argv(sizes, dump, gpu_check.MFU_RUN)
    return argv + ["--training.steps", str(STEPS), "--metrics.log_freq", "1"]


# --------------------------------------------------------------------------- in the worker


def state_bytes(trainer) -> dict[str, int]:
    """The resident state, by kind: what is allocated before a step's forward begins."""

    def total(tensors) -> int:
        return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))

    optimizer = [value for state in trainer.optimizer.state.values() for value in state.values()]
    ema = list(trainer.ema.averages.values()) if trainer.ema is not None else []
    return {"parameters": total(trainer.model.parameters()), "optimizer": total(optimizer), "ema": total(ema)}


def live_at_peak(trace: list[dict], baseline: int) -> dict:
    """Replay one step's allocator trace: the step's highest point (`baseline`, the bytes
    allocated when recording began, plus the most the step added) and the blocks the step
    allocated that are live there, grouped by (the innermost titanlite line, or failing that
    the innermost frame, of the allocation; block size)."""
    delta, peak_delta, peak_index = 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            delta += event["size"]
            if delta > peak_delta:
                peak_delta, peak_index = delta, index
        elif event["action"] == "free_requested":
            delta -= event["size"]
    live: dict[int, dict] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        group = groups[(_site(event.get("frames", [])), event["size"])]
        group[0] += 1
        group[1] += event["size"]
    top = sorted(groups.items(), key=lambda item: -item[1][1])[:TOP_GROUPS]
    return {
        "peak_bytes": baseline + peak_delta,
        "baseline_bytes": baseline,
        "peak_site": _site(trace[peak_index].get("frames", [])) if peak_index >= 0 else "",
        "groups": [{"site": site, "size": size, "count": n, "bytes": b} for (site, size), (n, b) in top],
    }


def _site(frames: list[dict]) -> str:
    for frame in frames:  # innermost first
        if "/titanlite/" in frame["filename"]:
            return f"{frame['filename'].rsplit('/titanlite/', 1)[1]}:{frame['line']} {frame['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def _worker(_, argv: list[str], port: int, dry_run: bool, out: str, snapshot: str) -> None:
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    torchrun_environment(0, 1, port, LOG_RANK="")
    if dry_run:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    gpu_check.register_flavors(gpu_check.DRY_RUN_SIZES if dry_run else gpu_check.GPU_SIZES)
    quiet_every_rank_lines()
    trainer = Trainer(parse_args(argv))
    on_gpu = trainer.device.type == "cuda"
    result: dict = {"steps": [], "live_at_peak": None}
    phases = trainer.phase_memory
    phases.steps_left = STEPS  # the trainer's own phase peaks, every step
    end_step = phases.end_step

    def end_step_with_stats(step: int) -> dict:
        record = {"step": step, **{f"after_{k}_gib": v for k, v in end_step(step).items()}}
        if on_gpu:
            stats = torch.cuda.memory_stats()  # cuda-only
            record.update({name: stats.get(key, 0) for name, key in STAT_KEYS.items()})  # cuda-only
        result["steps"].append(record)
        return record

    phases.end_step = end_step_with_stats
    train_step = trainer.train_step

    def recorded_step():
        if trainer.step + 1 < STEPS:
            return train_step()
        result["state_bytes"] = state_bytes(trainer)
        if not on_gpu:
            return train_step()
        baseline = torch.cuda.memory_allocated()  # cuda-only
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")  # cuda-only
        outputs = train_step()  # cuda-only
        torch.cuda.synchronize()  # cuda-only
        taken = torch.cuda.memory._snapshot()  # cuda-only
        torch.cuda.memory._record_memory_history(enabled=None)  # cuda-only
        if snapshot:  # cuda-only
            with gzip.open(snapshot, "wb") as file:  # cuda-only
                pickle.dump(taken, file)  # cuda-only
        result["live_at_peak"] = live_at_peak(taken["device_traces"][0], baseline)  # cuda-only
        return outputs  # cuda-only

    trainer.train_step = recorded_step
    trainer.train()
    result["records"] = gpu_check._read_metrics(Path(trainer.job_config.job.dump_folder))
    Path(out).write_text(json.dumps(result))


# --------------------------------------------------------------------------- in the parent


def measure(seq_len: int, mode: str, dry_run: bool, snapshots: Path | None) -> dict:
    sizes = run_sizes(seq_len, mode, dry_run)
    with tempfile.TemporaryDirectory(prefix="titanlite-gpu-memory-") as dump:
        out = f"{dump}/result.json"
        snapshot = str(snapshots / f"snapshot_{mode}_{seq_len}.pkl.gz") if snapshots else ""
        argv = trainer_argv(sizes, dump)
        mp.start_processes(
            _worker, args=(argv, free_port(), dry_run, out, snapshot), nprocs=1, start_method="spawn", join=True
        )
        result = json.loads(Path(out).read_text())
    steady = [s for s in result["steps"] if WARMUP < s["step"] < STEPS]
    result["mode"], result["seq_len"], result["sizes"] = mode, seq_len, sizes
    result["peak"] = {name: max((s.get(name, 0) for s in steady), default=0) for name in STAT_KEYS}
    mfu = [r[gpu_check.tags.MFU] for r in result["records"] if WARMUP < r["step"] < STEPS and gpu_check.tags.MFU in r]
    result["mfu"] = statistics.median(mfu) if mfu else None
    return result


def estimate(sizes: gpu_check.Sizes) -> dict:
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_memory

    with tempfile.TemporaryDirectory() as dump:
        found = estimate_memory(parse_args(trainer_argv(sizes, dump)), 1, device_type="cuda")
    return {
        "peak": found.peak_bytes,
        "reserved": found.reserved_bytes,
        "parts": {name: value for name, value in found.peak.items()},
    }


def _against(measured: int, predicted: int | None) -> str:
    """The measured figure over the estimate and their ratio, in GiB (the measured one alone
    without an estimate: --no-estimate)."""
    estimate = f" / {predicted / GIB:.2f} = {measured / predicted:.2f}" if predicted else " / n/a"
    return f"{measured / GIB:.2f}{estimate}"


def report(results: list[dict]) -> None:
    print("| mode | seq | allocated / estimate GiB | reserved / estimate GiB | fragmentation GiB | MFU % |")
    print("|---|---|---|---|---|---|")
    for r in results:
        peak, predicted = r["peak"], r.get("estimate") or {}
        mfu = f"{r['mfu']:.1f}" if r["mfu"] is not None else "n/a"
        print(
            f"| {r['mode']} | {r['seq_len']} | {_against(peak['allocated'], predicted.get('peak'))} | "
            f"{_against(peak['reserved'], predicted.get('reserved'))} | {peak['inactive_split'] / GIB:.2f} | {mfu} |"
        )
    for r in results:
        phases = ", ".join(f"{k[6:-4]} {v:.2f}" for k, v in r["steps"][-1].items() if k.startswith("after_"))
        print(f"\n{r['mode']} seq {r['seq_len']}: last step's peaks (GiB) after {phases}")
        if r.get("estimate"):
            print("  estimate: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in r["estimate"]["parts"].items()))
        if r["live_at_peak"] is not None:
            print_live(r["live_at_peak"], r["state_bytes"])  # cuda-only


def print_live(live: dict, states: dict[str, int]) -> None:
    """The recorded step's peak and the groups of blocks live there, largest first."""
    resident = ", ".join(f"{k} {v / GIB:.2f}" for k, v in states.items())
    print(
        f"  recorded step: peak {live['peak_bytes'] / GIB:.2f} GiB at {live['peak_site']}; "
        f"{live['baseline_bytes'] / GIB:.2f} GiB before it ({resident})"
    )
    for group in live["groups"]:
        print(f"  {group['bytes'] / GIB:7.3f} GiB  {group['count']:4d} x {group['size']:>12,d} B  {group['site']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="4096,8192", help="comma-separated sequence lengths")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    parser.add_argument("--snapshots", type=Path, help="folder for each run's allocator snapshot")
    parser.add_argument("--no-estimate", action="store_true", help="measure only")
    parser.add_argument("--json", type=Path, help="write every figure here too")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same code on the CPU, debug sizes")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available() and not options.cpu_dry_run:
        print("no GPU: skipped")
        return 0
    seq_lens = [int(s) for s in options.seq_lens.split(",")]
    if options.cpu_dry_run:
        seq_lens = [gpu_check.DRY_RUN_SIZES.seq_len]
    gpu_check.register_flavors(gpu_check.DRY_RUN_SIZES if options.cpu_dry_run else gpu_check.GPU_SIZES)
    if options.snapshots:
        options.snapshots.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in options.modes.split(","):
        for seq_len in seq_lens:
            result = measure(seq_len, mode, options.cpu_dry_run, options.snapshots)
            if not options.no_estimate:
                result["estimate"] = estimate(result["sizes"])
            result["sizes"] = dataclasses.asdict(result["sizes"])
            results.append(result)
            if options.json:
                options.json.write_text(json.dumps(results, indent=1))
    device = "CPU (dry run)" if options.cpu_dry_run else torch.cuda.get_device_name(0)
    print(f"titanlite GPU memory on {device}, torch {torch.__version__}")
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
