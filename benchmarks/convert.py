"""Time and memory of exporting a titanlite checkpoint to Hugging Face safetensors shards.

    python benchmarks/convert.py                          # about 1.2 GB of float32 weights
    python benchmarks/convert.py --size-gb 2 --max-shard-size 500MB --folder /some/disk

The script builds a Llama 3 shaped model (dim 1024, 16 heads, vocabulary 32000, as many
blocks as it takes to reach `--size-gb` GB of float32 weights) on the CPU with random
weights, saves it in one process (no process group) as a titanlite DCP checkpoint
`step-0` (the weights plus the "model_args" description that export reads), and frees it.

Then, with the checkpoint's files in the page cache (they were just written; a first,
untimed copy makes sure they are read once more), it times, in --repeats turns (default 5):

  copy      shutil.copyfile of every file of step-0 (the .distcp files and .metadata) to
            a temporary folder, with an fsync of each copy: the bytes a conversion must
            at least read and write, moved with no work at all
  convert   titanlite.checkpoint.hf_export.export_to_hf(step-0, out, float32, --max-shard-size)
            in a fresh Python process, followed by an fsync of each output file, so that
            both rows end with their data handed to the disk

Both read from the page cache and write to the same disk (the page cache cannot be
dropped without root). The checkpoint is built in a process of its own too, and the
parent never imports torch: Linux carries the parent's peak RSS into a child's ru_maxrss
across fork and exec, so with a 1.5 GB parent the converter's ru_maxrss read 1.56 GB. The
converter reports VmHWM (its own address space's peak, used for the ratio) and ru_maxrss
(now the same), its resident memory after its imports, before converting (the baseline),
and the conversion's time without the fsync.

Single timings vary several-fold on a shared virtual machine (page cache and fresh
memory are sometimes slow to get), so copy and convert take turns and the throughput
ratio is that of the median times; every turn is printed. The last lines are the two
ratios of this run:
`throughput ratio convert/copy = X.XX (target >= 0.7)` and
`peak RSS / largest shard = X.XX (target <= 1.5)`, where the RSS is peak minus baseline.
Every folder the script made is removed at the end.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

DIM, N_HEADS, VOCAB = 1024, 16, 32000
THROUGHPUT_TARGET = 0.7
RSS_TARGET = 1.5


def _rss_bytes() -> int:
    """Current resident memory of this process."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _hwm_bytes() -> int:
    """Peak resident memory of this process's own address space (VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


# --- the converter, run in a fresh process ---------------------------------------------


def convert_child(step_dir: str, out_dir: str, max_shard_size: str) -> None:
    """Runs as `python benchmarks/convert.py --child ...`; prints one JSON line."""
    import torch  # noqa: F401  (counted in the baseline, as the scripts import it too)

    from titanlite.checkpoint.hf_export import export_to_hf

    baseline = _rss_bytes()
    baseline_peak = _peak_rss_bytes()
    start = time.perf_counter()
    export_to_hf(step_dir, out_dir, dtype="float32", max_shard_size=max_shard_size)
    converted = time.perf_counter()
    outputs = _files(Path(out_dir))
    for path in outputs:
        _fsync_file(path)
    synced = time.perf_counter()
    shards = [p for p in outputs if p.suffix == ".safetensors"]
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "hwm": _hwm_bytes(),
                "baseline_rss": baseline,
                "baseline_peak": baseline_peak,
                "peak_rss": _peak_rss_bytes(),
                "convert_seconds": converted - start,
                "convert_fsync_seconds": synced - start,
                "shards": len(shards),
                "largest_shard": max(p.stat().st_size for p in shards),
                "shard_bytes": sum(p.stat().st_size for p in shards),
                "output_bytes": sum(p.stat().st_size for p in outputs),
            }
        )
    )


# --- the parent ------------------------------------------------------------------------


def build_checkpoint(step_dir: Path, size_gb: float) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from titanlite.models.llama import LlamaArgs, Transformer

    base = LlamaArgs(dim=DIM, n_layers=1, n_heads=N_HEADS, vocab_size=VOCAB, multiple_of=256, rope_theta=500000.0)
    per_block = 4 * DIM * DIM + 3 * DIM * base.ffn_hidden_dim + 2 * DIM
    outside = 2 * VOCAB * DIM + DIM
    n_layers = max(1, -(-(int(size_gb * 1e9) // 4 - outside) // per_block))
    args = dataclasses.replace(base, n_layers=n_layers)
    torch.manual_seed(0)
    model = Transformer(args)  # nn defaults: random weights, enough for timing
    params = sum(p.numel() for p in model.parameters())
    description = {"name": "llama3", "flavor": "bench-convert", "args": dataclasses.asdict(args)}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save({**model.state_dict(), "model_args": description}, checkpoint_id=str(step_dir), no_dist=True)
    save_seconds = time.perf_counter() - start
    del model
    gc.collect()
    return {"params": params, "n_layers": n_layers, "weight_bytes": params * 4, "save_seconds": save_seconds}


def copy_folder(source: Path, target: Path) -> float:
    """Seconds to copy every file of source into target, each fsynced."""
    target.mkdir()
    start = time.perf_counter()
    for path in _files(source):
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination)
        _fsync_file(destination)
    return time.perf_counter() - start


def build_child(step_dir: str, size_gb: str) -> None:
    """Runs as `python benchmarks/convert.py --build ...`; prints one JSON line."""
    print(json.dumps(build_checkpoint(Path(step_dir), float(size_gb))))


def _run_self(*arguments: str) -> dict:
    """Run this file in a fresh Python process and return the JSON line it prints."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, __file__, *arguments], check=True, capture_output=True, text=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        convert_child(*sys.argv[2:])
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--build":
        build_child(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.2, help="float32 weights to build, in GB (at least 1)")
    parser.add_argument("--max-shard-size", default="300MB", help="export's shard limit, e.g. 300MB or 1GiB")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="turns of copy then convert; the ratio is of the median times (single runs vary a lot "
        "on a shared machine)",
    )
    args = parser.parse_args()
    if args.size_gb < 1:
        parser.error("--size-gb must be at least 1")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    parent = args.folder or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="titanlite-convert-bench-", dir=parent) as folder:
        folder = Path(folder)
        step_dir = folder / "step-0"
        built = _run_self("--build", str(step_dir), str(args.size_gb))
        source_bytes = sum(p.stat().st_size for p in _files(step_dir))

        copy_folder(step_dir, folder / "warm-copy")  # untimed: reads step-0 once more
        shutil.rmtree(folder / "warm-copy")
        # Copy and convert take turns, so that both meet the machine in the same states.
        copies, reports = [], []
        for _ in range(args.repeats):
            copies.append(copy_folder(step_dir, folder / "copy"))
            shutil.rmtree(folder / "copy")
            reports.append(_run_self("--child", str(step_dir), str(folder / "hf"), args.max_shard_size))
            shutil.rmtree(folder / "hf")

    print(
        f"HF export: llama3 {built['params'] / 1e6:.1f} M params (dim {DIM}, {built['n_layers']} blocks, "
        f"vocabulary {VOCAB}), float32 in and out, --max-shard-size {args.max_shard_size}; "
        f"checkpoint written in {built['save_seconds']:.1f} s"
    )
    print(
        f"torch {reports[0]['torch']}, {os.cpu_count()} cores, {datetime.date.today().isoformat()}; "
        f"step-0 in the page cache for every row (copied once, untimed, before); {args.repeats} turns of "
        f"copy then convert; {source_bytes:,} bytes read, {reports[0]['output_bytes']:,} written by convert\n"
    )
    print("| turn | copy s (GB/s) | convert s (GB/s) | convert without fsync s | convert peak RSS - baseline |")
    print("|---|---|---|---|---|")
    for turn, (copy_seconds, report) in enumerate(zip(copies, reports), start=1):
        print(
            f"| {turn} | {copy_seconds:.2f} ({source_bytes / copy_seconds / 1e9:.2f}) | "
            f"{report['convert_fsync_seconds']:.2f} ({source_bytes / report['convert_fsync_seconds'] / 1e9:.2f}) | "
            f"{report['convert_seconds']:.2f} | {report['hwm'] - report['baseline_rss']:,} |"
        )
    worst = max(reports, key=lambda r: r["hwm"] - r["baseline_rss"])
    rss_growth = worst["hwm"] - worst["baseline_rss"]
    print()
    print("| converter memory (the turn with the largest growth) | bytes |")
    print("|---|---|")
    print(f"| RSS after imports (baseline) | {worst['baseline_rss']:,} |")
    print(f"| peak RSS (VmHWM) | {worst['hwm']:,} |")
    print(f"| ru_maxrss (for comparison) | {worst['peak_rss']:,} |")
    print(f"| peak - baseline | {rss_growth:,} |")
    print(f"| largest output shard ({worst['shards']} shards) | {worst['largest_shard']:,} |")
    print()
    copy_median = statistics.median(copies)
    convert_median = statistics.median(r["convert_fsync_seconds"] for r in reports)
    print(
        f"throughput ratio convert/copy = {copy_median / convert_median:.2f} (target >= {THROUGHPUT_TARGET}; "
        f"median seconds of {args.repeats} turns: copy {copy_median:.2f}, convert {convert_median:.2f})"
    )
    print(
        f"peak RSS / largest shard = {rss_growth / worst['largest_shard']:.2f} (target <= {RSS_TARGET}); "
        f"raw peak RSS {worst['hwm'] / 1e9:.2f} GB = {worst['hwm'] / worst['largest_shard']:.2f} x largest shard"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
