"""Time and memory of exporting a titanlite checkpoint to Hugging Face safetensors shards.

    python benchmarks/convert.py                          # about 1.2 GB of float32 weights
    python benchmarks/convert.py --size-gb 2 --max-shard-size 500MB --folder /some/disk
    python benchmarks/convert.py --quick                  # a smoke run: a few MB, one turn

The script builds a Llama 3 shaped model (dim 1024, 16 heads, vocabulary 32000, as many
blocks as it takes to reach `--size-gb` GB of float32 weights; --quick's is dim 256, 4 heads,
vocabulary 4096, one block) and saves it
as a titanlite DCP checkpoint `step-0` (the weights plus the "model_args" description that
export reads) the way a run on 2 FSDP ranks writes one, which is what users export: two
processes (a gloo group) shard it with fully_shard, fill their shards with random numbers
and save, so every tensor is stored as 2 chunks, one in each rank's .distcp file.

Then, with the checkpoint's files in the page cache (they were just written; a first,
untimed copy makes sure they are read once more), it times, in --repeats turns (default 3,
so that the whole script stays near three minutes on two busy cores):

  copy        shutil.copyfile of every file of step-0 (the .distcp files and .metadata) to
              a temporary folder, with an fsync of each copy: the bytes a conversion must
              at least read and write, moved with no work at all
  ours        titanlite.checkpoint.hf_export.export_to_hf(step-0, out, float32, --max-shard-size)
  dcp-reader  the same export with its hand-written reader of the .distcp archives and its
              fsync thread swapped for DCP's own reader (tensor_reader.load_with_dcp: one dcp.load
              per output shard) and an fsync of each file in turn
  torchtitan  what a torchtitan user runs instead: a full dcp.load of the model's weights
              into memory, the state-dict adapter's to_hf, then dcp.save with DCP's
              HuggingFaceStorageWriter (save_distributed, enable_consolidation, the same
              shard split as ours given as fqn_to_index_mapping): it writes DCP-framed
              safetensors under out/sharded and consolidates them into out/. It writes no
              config.json or tokenizer, and leaves the sharded copy behind (not removed)

Every row but copy runs in a fresh Python process and is followed by an fsync of each
output file, so that every row ends with its data handed to the disk. All read from the
page cache and write to the same disk (the page cache cannot be dropped without root).
The checkpoint is built in a process of its own too, and the parent never imports torch:
Linux carries the parent's peak RSS into a child's ru_maxrss across fork and exec, so with
a 1.5 GB parent the converter's ru_maxrss read 1.56 GB. Each converter reports VmHWM (its
own address space's peak) and ru_maxrss (now the same), its resident memory after its
imports, before converting (the baseline), and the conversion's time without the fsync.

Single timings vary several-fold on a shared virtual machine (page cache and fresh
memory are sometimes slow to get), so the rows take turns and every ratio is one of median
times; every turn is printed. Each turn also times the two readers alone (`--read`: every
weight read in the export's groups, nothing written), each in a fresh process. The last
lines are this run's ratios:
`reading alone (no writes), ours / dcp-reader = X.XX (...)`,
`time ours / dcp-reader = X.XX (target <= 0.67 ...)` (the hand-written reader must be
1.5x faster than DCP's), `time ours / torchtitan = X.XX (...)`,
`throughput ratio convert/copy = X.XX (target >= 0.7)` and
`peak RSS / largest shard = X.XX (target <= 1.5)`, where the RSS is ours, peak minus baseline.
Every folder the script made is removed at the end.
"""

import argparse
import dataclasses
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIM, N_HEADS, VOCAB = 1024, 16, 32000
# --quick's model: a few MB, enough to run every line (its timings mean nothing anyway). Its
# size is the only one at or below QUICK_SIZE_GB (main refuses a --size-gb under 1), so the
# build child, which is given the size alone, knows the shape from it.
QUICK_SIZE_GB = 0.02
QUICK_DIM, QUICK_N_HEADS, QUICK_VOCAB = 256, 4, 4096
THROUGHPUT_TARGET = 0.7
RSS_TARGET = 1.5
READER_SPEEDUP_TARGET = 1.5  # the hand-written reader must be this much faster than DCP's


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


# --- the converters, each run in a fresh process ---------------------------------------

# Row name -> what it stands for in the tables.
ROWS = {
    "ours": "ours (hand-written reader, fsync thread)",
    "dcp-reader": "ours with DCP's reader",
    "torchtitan": "torchtitan: dcp.load + HuggingFaceStorageWriter",
}


def _export_with_dcp_reader(step_dir: str, out_dir: str, max_shard_size: str) -> None:
    """export_to_hf with the hand-written reader and the fsync thread swapped for the library
    path: DCP's reader (one dcp.load per output shard into new tensors) and fsyncs in turn."""
    from titanlite.checkpoint import hf_export
    from titanlite.checkpoint.tensor_reader import load_with_dcp
    from titanlite.files import fsync_path

    class LibraryReader:
        def __init__(self, step_dir, metadata, largest_group=0):
            self._step_dir = step_dir

        def load(self, items):
            return load_with_dcp(self._step_dir, items)

        def close(self):
            pass

    class InlineSyncer:
        def add(self, path):
            fsync_path(path)

        def join(self):
            pass

        def wait(self):
            pass

    hf_export.CheckpointReader, hf_export.BackgroundSyncer = LibraryReader, InlineSyncer
    hf_export.export_to_hf(step_dir, out_dir, dtype="float32", max_shard_size=max_shard_size)


def _torchtitan_path(step_dir: str, out_dir: str, max_shard_size: str) -> None:
    """The whole model loaded by dcp.load, converted by the adapter, and saved by DCP's
    HuggingFaceStorageWriter with consolidation, in the same shards as our export."""
    import torch
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import split_torch_state_dict_into_shards

    from titanlite.checkpoint.description import read_model_description
    from titanlite.checkpoint.files import single_process
    from titanlite.checkpoint.hf_export import parse_size
    from titanlite.registry import get_model_spec

    description = read_model_description(step_dir)
    saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    names = description.weight_shapes()
    state = {name: torch.empty(saved[name].size, dtype=saved[name].properties.dtype) for name in names}
    single_process(dcp.load, state, checkpoint_id=step_dir, no_dist=True)
    hf_state = get_model_spec(description.name).state_dict_adapter(description.args).to_hf(state)
    del state
    split = split_torch_state_dict_into_shards(
        hf_state, filename_pattern="model{suffix}.safetensors", max_shard_size=parse_size(max_shard_size)
    )
    file_of = {name: i for i, names in enumerate(split.filename_to_tensors.values(), start=1) for name in names}
    writer = dcp.HuggingFaceStorageWriter(
        out_dir,
        fqn_to_index_mapping=file_of,
        save_distributed=True,  # in 2.13 finish() consolidates only a "distributed" save
        enable_consolidation=True,
        thread_count_consolidation=os.cpu_count() or 1,
    )
    single_process(dcp.save, hf_state, storage_writer=writer, no_dist=True)


def convert_child(row: str, step_dir: str, out_dir: str, max_shard_size: str) -> None:
    """Runs as `python benchmarks/convert.py --child ROW ...`; prints one JSON line."""
    import torch  # noqa: F401  (counted in the baseline, as the scripts import it too)
    import torch.distributed.checkpoint  # noqa: F401

    from titanlite.checkpoint.hf_export import export_to_hf

    def ours(step_dir: str, out_dir: str, max_shard_size: str) -> None:
        export_to_hf(step_dir, out_dir, dtype="float32", max_shard_size=max_shard_size)

    convert = {"ours": ours, "dcp-reader": _export_with_dcp_reader, "torchtitan": _torchtitan_path}[row]
    baseline = _rss_bytes()
    baseline_peak = _peak_rss_bytes()
    start = time.perf_counter()
    convert(step_dir, out_dir, max_shard_size)
    converted = time.perf_counter()
    outputs = _files(Path(out_dir))
    for path in outputs:
        _fsync_file(path)
    synced = time.perf_counter()
    # The consolidated shards: those in out_dir itself, not the torchtitan row's sharded/ copy.
    shards = [p for p in outputs if p.suffix == ".safetensors" and p.parent == Path(out_dir)]
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


READERS = ("ours", "dcp-reader")  # the readers timed alone, without the export's writes


def read_child(reader: str, step_dir: str, max_shard_size: str) -> None:
    """Runs as `python benchmarks/convert.py --read READER ...`; prints one JSON line: the
    seconds READER takes to read every weight of step-0 in groups of at most
    --max-shard-size bytes (the export's groups), with nothing written."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titanlite.checkpoint.files import read_checkpoint_metadata
    from titanlite.checkpoint.hf_export import parse_size
    from titanlite.checkpoint.tensor_reader import CheckpointReader, buffer_bytes, load_with_dcp

    step, limit = Path(step_dir), parse_size(max_shard_size)
    metadata = read_checkpoint_metadata(step)
    groups, size = [[]], 0
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            nbytes = entry.size.numel() * entry.properties.dtype.itemsize
            if groups[-1] and size + nbytes > limit:
                groups.append([])
                size = 0
            groups[-1].append((key, entry))
            size += nbytes
    start = time.perf_counter()
    if reader == "ours":
        ours = CheckpointReader(step, metadata, max(buffer_bytes([e for _, e in group]) for group in groups))
        for group in groups:
            ours.load(group)
        ours.close()
    else:
        for group in groups:
            load_with_dcp(step, group)
    print(json.dumps({"read_seconds": time.perf_counter() - start}))


# --- the parent ------------------------------------------------------------------------


FSDP_RANKS = 2  # the checkpoint is written as a run on this many FSDP ranks writes it


def _model_args(size_gb: float):
    from titanlite.models.llama import LlamaArgs

    dim, n_heads, vocab = (QUICK_DIM, QUICK_N_HEADS, QUICK_VOCAB) if size_gb <= QUICK_SIZE_GB else (DIM, N_HEADS, VOCAB)
    base = LlamaArgs(dim=dim, n_layers=1, n_heads=n_heads, vocab_size=vocab, multiple_of=256, rope_theta=500000.0)
    per_block = 4 * dim * dim + 3 * dim * base.ffn_hidden_dim + 2 * dim
    outside = 2 * vocab * dim + dim
    n_layers = max(1, -(-(int(size_gb * 1e9) // 4 - outside) // per_block))
    return dataclasses.replace(base, n_layers=n_layers)


def _save_as_fsdp_rank(rank: int, step_dir: str, size_gb: float, store_path: str, report_path: str) -> None:
    """One of FSDP_RANKS processes: the model sharded with fully_shard (every block and the
    root, as the trainer does), its shards filled with random numbers (enough for timing)
    and saved with dcp.save, so that every tensor has one chunk per rank in the rank's own
    .distcp file. A FileStore joins the ranks: no port to pick."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlite.models.llama import Transformer
    from titanlite.parallel import destroy_distributed, exit_process

    dist.init_process_group("gloo", store=dist.FileStore(store_path, FSDP_RANKS), rank=rank, world_size=FSDP_RANKS)
    args = _model_args(size_gb)
    with torch.device("meta"):
        model = Transformer(args)
    mesh = init_device_mesh("cpu", (FSDP_RANKS,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.to_local().normal_(std=0.02, generator=generator)
    description = {"name": "llama3", "flavor": "bench-convert", "args": dataclasses.asdict(args)}
    dist.barrier()
    start = time.perf_counter()
    dcp.save({**model.state_dict(), "model_args": description}, checkpoint_id=step_dir)
    save_seconds = time.perf_counter() - start
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        report = {
            "params": params,
            "dim": args.dim,
            "vocab_size": args.vocab_size,
            "n_layers": args.n_layers,
            "weight_bytes": params * 4,
            "save_seconds": save_seconds,
        }
        Path(report_path).write_text(json.dumps(report))
    # As train.py's ranks end: an interpreter teardown racing gloo's threads can abort the
    # process (SIGABRT) after a successful save, failing the whole benchmark at random.
    destroy_distributed()
    exit_process(0)


def build_checkpoint(step_dir: Path, size_gb: float) -> dict:
    import torch.multiprocessing as mp

    store_path, report_path = step_dir.parent / "build-store", step_dir.parent / "build-report.json"
    mp.start_processes(
        _save_as_fsdp_rank,
        args=(str(step_dir), size_gb, str(store_path), str(report_path)),
        nprocs=FSDP_RANKS,
        start_method="spawn",
    )
    report = json.loads(report_path.read_text())
    report_path.unlink()
    store_path.unlink(missing_ok=True)
    return report


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


def _median(reports: list[dict], field: str = "convert_fsync_seconds") -> float:
    return statistics.median(report[field] for report in reports)


def _growth(report: dict) -> int:
    return report["hwm"] - report["baseline_rss"]


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        convert_child(*sys.argv[2:])
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "--read":
        read_child(*sys.argv[2:])
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--build":
        build_child(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.2, help="float32 weights to build, in GB")
    parser.add_argument("--max-shard-size", default="300MB", help="export's shard limit, e.g. 300MB or 1GiB")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="turns of every row; the ratios are of the median times (single runs vary a lot on a shared machine)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: a model of a few MB (dim 256), 1MB shards, one turn (timings mean nothing)",
    )
    args = parser.parse_args()
    if args.quick:
        args.size_gb, args.max_shard_size, args.repeats = QUICK_SIZE_GB, "1MB", 1
    elif args.size_gb < 1:
        parser.error("--size-gb must be at least 1 (below that the fixed costs dominate); --quick for a smoke run")
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
        # The rows take turns, so that all meet the machine in the same states.
        copies, reports, reads = [], {row: [] for row in ROWS}, {reader: [] for reader in READERS}
        for _ in range(args.repeats):
            copies.append(copy_folder(step_dir, folder / "copy"))
            shutil.rmtree(folder / "copy")
            for row, row_reports in reports.items():
                row_reports.append(_run_self("--child", row, str(step_dir), str(folder / "hf"), args.max_shard_size))
                shutil.rmtree(folder / "hf")
            for reader, reader_reports in reads.items():
                reader_reports.append(_run_self("--read", reader, str(step_dir), args.max_shard_size))

    first = reports["ours"][0]
    print(
        f"HF export: llama3 {built['params'] / 1e6:.1f} M params (dim {built['dim']}, {built['n_layers']} blocks, "
        f"vocabulary {built['vocab_size']}), float32 in and out, --max-shard-size {args.max_shard_size}; "
        f"checkpoint written by {FSDP_RANKS} FSDP ranks in {built['save_seconds']:.1f} s"
    )
    print(
        f"torch {first['torch']}, {os.cpu_count()} cores, {datetime.date.today().isoformat()}; "
        f"step-0 in the page cache for every row (copied once, untimed, before); {args.repeats} turns of "
        f"every row; {source_bytes:,} bytes read; written: "
        + ", ".join(f"{row} {reports[row][0]['output_bytes']:,}" for row in ROWS)
        + "\n"
    )
    print("| turn | copy s (GB/s) | " + " | ".join(f"{row} s (GB/s)" for row in ROWS) + " |")
    print("|---|---|" + "---|" * len(ROWS))
    for turn, copy_seconds in enumerate(copies):
        cells = [f"{copy_seconds:.2f} ({source_bytes / copy_seconds / 1e9:.2f})"]
        for row in ROWS:
            seconds = reports[row][turn]["convert_fsync_seconds"]
            cells.append(f"{seconds:.2f} ({source_bytes / seconds / 1e9:.2f})")
        print(f"| {turn + 1} | " + " | ".join(cells) + " |")
    print()
    print(
        "| row (the turn with the largest growth) | median s | median s without fsync | baseline RSS | "
        "peak RSS (VmHWM) | ru_maxrss | peak - baseline | largest shard (shards) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row, title in ROWS.items():
        worst = max(reports[row], key=_growth)
        print(
            f"| {title} | {_median(reports[row]):.2f} | {_median(reports[row], 'convert_seconds'):.2f} | "
            f"{worst['baseline_rss']:,} | {worst['hwm']:,} | {worst['peak_rss']:,} | {_growth(worst):,} | "
            f"{worst['largest_shard']:,} ({worst['shards']}) |"
        )
    print()
    read_ours, read_dcp = (_median(reads[reader], "read_seconds") for reader in READERS)
    print(
        f"reading alone (no writes), ours / dcp-reader = {read_ours / read_dcp:.2f} "
        f"(median seconds of {args.repeats} turns: ours {read_ours:.2f}, dcp-reader {read_dcp:.2f})"
    )
    ours = _median(reports["ours"])
    ours_growth = max(_growth(r) for r in reports["ours"])
    for row in ("dcp-reader", "torchtitan"):
        growth = max(_growth(r) for r in reports[row])
        target = f" (target <= {1 / READER_SPEEDUP_TARGET:.2f}: the reader stays only if 1.5x faster)"
        print(
            f"time ours / {row} = {ours / _median(reports[row]):.2f}{target if row == 'dcp-reader' else ''}; "
            f"peak RSS - baseline ours / {row} = {ours_growth / growth:.2f} "
            f"({ours_growth / 1e9:.2f} GB against {growth / 1e9:.2f} GB)"
        )
    copy_median = statistics.median(copies)
    print(
        f"throughput ratio convert/copy = {copy_median / ours:.2f} (target >= {THROUGHPUT_TARGET}; "
        f"median seconds of {args.repeats} turns: copy {copy_median:.2f}, ours {ours:.2f})"
    )
    worst = max(reports["ours"], key=_growth)
    print(
        f"peak RSS / largest shard = {ours_growth / worst['largest_shard']:.2f} (target <= {RSS_TARGET}); "
        f"raw peak RSS {worst['hwm'] / 1e9:.2f} GB = {worst['hwm'] / worst['largest_shard']:.2f} x largest shard"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
