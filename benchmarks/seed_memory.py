"""Peak host memory per rank while seeding a sharded model from a Hugging Face folder.

    python benchmarks/seed_memory.py                    # about 1 GB of float32 weights
    python benchmarks/seed_memory.py --size-gb 2 --world-sizes 2,4

The script writes a Llama 3 shaped Hugging Face folder (dim 1024, 16 heads, 8 key/value
heads, vocabulary 32000, as many blocks as it takes to reach --size-gb GB of float32
weights; random values; 500 MB safetensors shards with an index, by huggingface_hub),
then for each world size starts that many CPU ranks (gloo). Each rank builds the model
on the meta device, shards it with titanlite's own parallelize function (FSDP over all
ranks) and allocates its shards, then resets its peak-RSS counter (VmHWM, through
/proc/self/clear_refs) and calls titanlite.checkpoint.hf.seed_from_hf, the function a
training run with checkpoint.initial_load_in_hf calls.

Per rank it prints the growth of resident memory during seeding (peak VmHWM minus RSS
before), next to what the rank must hold in any case: its shards of the model (model /
world size). The last lines give, for each world size, the worst rank's

    peak growth / own shards = X.XX     (1.00 would be no overhead at all)
    overhead / largest tensor = X.XX    (the overhead, peak growth minus own shards, in
                                         units of the model's largest tensor)
    peak growth / whole model = X.XX    (what reading whole tensors per rank would cost: 1.0+)

Pages of the page cache are not counted: the RSS of a process counts only the file
pages it maps, and the reader unmaps each file after each tensor. Every folder the
script made is removed at the end.
"""

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import end_rank, free_port, torchrun_environment  # noqa: E402

from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs, LlamaStateDictAdapter  # noqa: E402

DIM, N_HEADS, N_KV_HEADS, VOCAB = 1024, 16, 8, 32000


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def model_args(size_gb: float) -> LlamaArgs:
    probe = LlamaArgs(dim=DIM, n_layers=1, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, vocab_size=VOCAB, multiple_of=256)
    per_block = (
        DIM * DIM * 2 + DIM * probe.kv_heads * probe.head_dim * 2 + 3 * DIM * probe.ffn_hidden_dim + 2 * DIM
    ) * 4
    outside = (2 * VOCAB * DIM + DIM) * 4
    n_layers = max(1, round((size_gb * 1e9 - outside) / per_block))
    return LlamaArgs(
        dim=DIM,
        n_layers=n_layers,
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        vocab_size=VOCAB,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=256,
    )


def write_hf_folder(args: LlamaArgs, folder: Path) -> tuple[int, int]:
    """Random weights in Hugging Face layout; returns (total bytes, largest tensor bytes)."""
    from huggingface_hub import save_torch_state_dict

    from titanlite.models.llama import Transformer

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Transformer(args).state_dict().items()}
    adapter = LlamaStateDictAdapter(args)
    generator = torch.Generator().manual_seed(0)
    state = {adapter.to_hf_name(n): torch.randn(shape, generator=generator) * 0.02 for n, shape in shapes.items()}
    folder.mkdir(parents=True)
    save_torch_state_dict(state, folder, max_shard_size="500MB")
    (folder / "config.json").write_text(json.dumps(adapter.hf_config(), indent=2))
    sizes = [t.numel() * t.element_size() for t in state.values()]
    return sum(sizes), max(sizes)


def _rank(rank: int, world_size: int, port: int, hf_dir: str, args: LlamaArgs, out_dir: str) -> None:
    torchrun_environment(rank, world_size, port)
    import torch.distributed as dist

    from titanlite.checkpoint.hf import seed_from_hf
    from titanlite.config import parse_args
    from titanlite.parallel import ParallelDims
    from titanlite.registry import get_model_spec

    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo")
    LLAMA3_FLAVORS["seed_benchmark"] = args
    job_config = parse_args(
        [
            "--model.flavor",
            "seed_benchmark",
            "--training.mixed_precision_param",
            "float32",
            "--activation_checkpoint.mode",
            "none",
            f"--training.seq_len={args.max_seq_len}",
        ]
    )
    spec = get_model_spec("llama3")
    dims = ParallelDims.resolve(1, -1, world_size)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = spec.parallelize_fn(model, dims, dims.build_mesh("cpu"), job_config)
    model.to_empty(device="cpu")  # allocated, not yet touched: not resident
    group = dist.new_group(backend="gloo") if world_size > 1 else None
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    seed_from_hf(hf_dir, model, args, spec.state_dict_adapter, group)
    peak = _status_bytes("VmHWM")
    own = sum(
        p.to_local().numel() * p.to_local().element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
        for p in model.parameters()
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"growth": peak - before, "own": own}))
    end_rank()


def measure(world_size: int, hf_dir: Path, args: LlamaArgs) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank,
            args=(world_size, free_port(), str(hf_dir), args, out_dir),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="float32 model size in GB (default 1)")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    parser.add_argument("--folder", default=None, help="where to write the Hugging Face folder (default: a temp dir)")
    options = parser.parse_args()
    args = model_args(options.size_gb)
    work = Path(tempfile.mkdtemp(prefix="titanlite-seed-", dir=options.folder))
    try:
        total, largest = write_hf_folder(args, work / "hf")
        gb = 1e9
        print(f"titanlite seed memory benchmark, {datetime.date.today()}, {os.cpu_count()} CPU core(s)")
        print(f"model: {args.n_layers} blocks, dim {DIM}, {total / gb:.2f} GB float32, ", end="")
        print(f"largest tensor {largest / gb:.3f} GB")
        summary = []
        for world_size in [int(w) for w in options.world_sizes.split(",")]:
            ranks = measure(world_size, work / "hf", args)
            for rank, row in enumerate(ranks):
                print(
                    f"world {world_size} rank {rank}: peak growth {row['growth'] / gb:.3f} GB, "
                    f"own shards {row['own'] / gb:.3f} GB"
                )
            worst = max(ranks, key=lambda row: row["growth"] / row["own"])
            summary.append(
                (
                    world_size,
                    worst["growth"] / worst["own"],
                    (worst["growth"] - worst["own"]) / largest,
                    worst["growth"] / total,
                )
            )
        for world_size, per_shard, overhead, per_model in summary:
            print(
                f"world {world_size}: peak growth / own shards = {per_shard:.2f}, "
                f"overhead / largest tensor = {overhead:.2f}, peak growth / whole model = {per_model:.2f}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
