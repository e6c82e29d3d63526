"""Per-rank parameter + gradient + optimizer-state bytes under FSDP at 1, 2 and 4 ranks and
under tensor parallelism (TP 2 alone, FSDP 2 x TP 2), as a ratio to the whole model's bytes
divided by dp_shard x tp, with the memory estimator's figure for the same rank beside it.

    python benchmarks/memory_scaling.py                  # debug and 100m models, FSDP 1/2/4, TP 2x2 and 4x2 (~3 min)
    python benchmarks/memory_scaling.py --quick          # debug model, FSDP 1 and 2 ranks, TP 2 on 2 ranks (~40 s)
    python benchmarks/memory_scaling.py --models 100m --world-sizes 2,4,8 --tp-layouts 8x4

For every (model, layout) the script starts fresh processes, one per rank, with
torch.multiprocessing (spawn) joined by a gloo process group, as torchrun would. Each rank
builds titanlite's own Trainer (FSDP over the ranks TP leaves, float32 parameters and
gradients, AdamW; with TP the config's plan: sequence parallel, loss parallel) and runs one
real training step (Trainer.train_step). A hook on the optimizer,
called right after optimizer.step() and before zero_grad(), counts this rank's bytes from
the real tensors at the one moment when all three exist:

  parameters   the storages behind each parameter's local shard (DTensor.to_local())
  gradients    the storages behind each gradient's local shard
  optimizer    every tensor in optimizer.state (AdamW's two moments and its step counters)

Storages, not tensor sizes, are counted, each once: FSDP keeps a shard in a storage padded
to the largest shard (dim 0 split like torch.chunk), and the reduce-scattered gradients of
one FSDP unit are views of one flat buffer; the storage is what the rank really holds.

"total" is the same three figures for the whole model, from the global shapes of the same
tensors (DTensor.numel() is the global size), so

    ratio = this rank's bytes / (total / (dp_shard x tp))

is 1.00 for perfect sharding (dp_shard x tp is the world size here: no replicas). Above 1
comes from padding (a dimension that the ranks do not divide), from AdamW's scalar step
counters, which every rank keeps whole (4 bytes per parameter tensor), from the norms, which
TP replicates (FSDP alone splits them), and, under TP without FSDP, from the embedding's
gradient, which DTensor returns whole (vocabulary x dim on every TP rank). Beside the
measurement, the estimator's figure for the same rank: titanlite.estimate.estimate_memory
run in this (parent) process on a fake process group for that rank, its tracked parameters +
gradients + optimizer state. The table lists every rank; the lines after it give the worst
rank's ratio per layout, the largest estimator-measurement difference and, last, the worst
ratio of all.

Models (llama3): debug is the debugmodel flavor (5.3 M parameters, vocabulary 2048); 100m
is dim 768, 8 blocks, 12 heads / 4 key-value heads, vocabulary 32000 (99.5 M parameters),
registered inside each worker. Activations are not counted (see titanlite.estimate for the
peak). 4 ranks on 2 cores oversubscribe, which costs time only: the bytes do not depend
on it.

Options: --models (default debug,100m), --world-sizes (default 1,2,4: FSDP over every
rank), --tp-layouts (default 2x2,4x2: RANKSxTP, FSDP over the ranks TP leaves; "" for none),
--seq-len (default 32; only the one step's time depends on it), --quick (debug model, FSDP
on 1 and 2 ranks, TP 2 on 2), --json FILE (every rank's figures). Expected time on the 2-core
VM: about 3 minutes by default (most of it the 100m model at 4 ranks), 40 s with --quick.
Temporary folders are removed at the end.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import end_rank, free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs  # noqa: E402

MODELS = {
    "debug": ("debugmodel", None),
    "100m": (
        "bench100m",
        LlamaArgs(
            dim=768, n_layers=8, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256, rope_theta=500000.0
        ),
    ),
}
PARTS = ("parameters", "gradients", "optimizer")
MIB = 2**20


# --- counting bytes ---------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors' local shards, each counted once."""
    seen = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def global_bytes(tensors) -> int:
    """Bytes of the tensors as the whole (unsharded) model holds them."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def count(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's storages and the whole model's bytes, per part."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = _state_tensors(optimizer)
    return {
        "local": dict(zip(PARTS, (storage_bytes(params), storage_bytes(grads), storage_bytes(state)), strict=True)),
        "total": dict(zip(PARTS, (global_bytes(params), global_bytes(grads), global_bytes(state)), strict=True)),
        "grads_missing": len(params) - len(grads),
    }


def trainer_argv(flavor: str, dump: str, seq_len: int, tp: int) -> list[str]:
    """The config every rank trains with, and the estimator estimates."""
    return [
        "--model.flavor",
        flavor,
        "--job.dump_folder",
        dump,
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        "1",
        "--training.steps",
        "10",
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--parallelism.data_parallel_shard_degree",
        "-1",  # FSDP over every rank TP leaves
        "--parallelism.tensor_parallel_degree",
        str(tp),
    ]


def _register(model_name: str) -> str:
    """The model's flavor, registered in this process's table if it is not a built-in one."""
    flavor, args = MODELS[model_name]
    if args is not None:
        LLAMA3_FLAVORS.setdefault(flavor, args)  # spawned workers start with the built-in table
    return flavor


def estimated(model: str, seq_len: int, world_size: int, tp: int) -> list[int | None]:
    """The memory estimator's parameters + gradients + optimizer state for every rank (None
    when titanlite.estimate cannot give it): estimate_memory on a fake process group, here in
    the parent, which has no process group of its own."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_memory

    config = parse_args(trainer_argv(_register(model), "unused", seq_len, tp))
    figures = []
    for rank in range(world_size):
        try:
            state = estimate_memory(config, world_size, device_type="cpu", rank=rank).measured
        except Exception as error:  # an estimator being finished must not break the measurement
            print(f"estimate unavailable: {type(error).__name__}: {error}", file=sys.stderr)
            figures.append(None)
            continue
        figures.append(state.parameters + state.gradients + state.optimizer_state)
    return figures


# --- inside each rank ------------------------------------------------------------------


def _rank(
    rank: int, world_size: int, tp: int, port: int, model_name: str, seq_len: int, dump: str, out_dir: str
) -> None:
    torchrun_environment(rank, world_size, port, LOG_RANK="")  # the trainer's start-up lines would drown the table
    torch.set_num_threads(1)  # bytes do not depend on threads; 4 ranks share 2 cores
    flavor = _register(model_name)

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    quiet_every_rank_lines()
    trainer = Trainer(parse_args(trainer_argv(flavor, dump, seq_len, tp)))
    figures = {}
    # After optimizer.step() and before zero_grad(): parameters, gradients and optimizer
    # state all exist only at this moment of the step.
    trainer.optimizer.register_step_post_hook(
        lambda optimizer, args, kwargs: figures.update(count(trainer.model, optimizer))
    )
    trainer.train_step()
    dims = trainer.plan.parallel_dims
    figures.update(params=sum(p.numel() for p in trainer.model.parameters()), dp_shard=dims.dp_shard, tp=dims.tp)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(figures))
    end_rank()


# --- the driver ------------------------------------------------------------------------


def measure(model: str, world_size: int, tp: int, seq_len: int, work: Path) -> dict:
    """Every rank's figures for one (model, layout), in rank order, with the estimator's."""
    dump = work / f"{model}-{world_size}-tp{tp}"
    out_dir = dump / "results"
    out_dir.mkdir(parents=True)
    mp.start_processes(
        _rank,
        args=(world_size, tp, free_port(), model, seq_len, str(dump), str(out_dir)),
        nprocs=world_size,
        start_method="spawn",
        join=True,
    )
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    for figures, estimate in zip(ranks, estimated(model, seq_len, world_size, tp), strict=True):
        figures["estimate"] = estimate
    return {"model": model, "world_size": world_size, "tp": tp, "ranks": ranks}


def ratio(figures: dict) -> float:
    """This rank's bytes over the whole model's divided by the ways it is split."""
    return sum(figures["local"].values()) / (sum(figures["total"].values()) / (figures["dp_shard"] * figures["tp"]))


def _layout(row: dict) -> str:
    dp_shard = row["ranks"][0]["dp_shard"]
    if row["tp"] == 1:
        return f"FSDP {dp_shard}" if dp_shard > 1 else "single"
    return f"FSDP {dp_shard} x TP {row['tp']}" if dp_shard > 1 else f"TP {row['tp']}"


def print_table(rows: list[dict]) -> None:
    print(
        "| model | ranks | layout | rank | parameters MiB | gradients MiB | optimizer MiB | sum MiB | "
        "total / (dp_shard x tp) MiB | ratio | estimator MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for rank, figures in enumerate(row["ranks"]):
            local, total = figures["local"], sum(figures["total"].values())
            estimate = "n/a" if figures["estimate"] is None else f"{figures['estimate'] / MIB:.3f}"
            print(
                f"| {row['model']} ({figures['params'] / 1e6:.1f} M) | {row['world_size']} | {_layout(row)} | {rank} | "
                + " | ".join(f"{local[part] / MIB:.3f}" for part in PARTS)
                + f" | {sum(local.values()) / MIB:.3f} | {total / (figures['dp_shard'] * figures['tp']) / MIB:.3f} | "
                f"{ratio(figures):.4f} | {estimate} |"
            )


def print_ratios(rows: list[dict]) -> None:
    """The worst rank per (model, layout), the estimator's largest difference, then the worst
    ratio of all, last."""
    worst_all = None
    for row in rows:
        rank, figures = max(enumerate(row["ranks"]), key=lambda item: ratio(item[1]))
        value = ratio(figures)
        print(
            f"{row['model']}, {row['world_size']} rank{'s' if row['world_size'] > 1 else ''} ({_layout(row)}): "
            f"worst rank ({rank}) param+grad+optimizer bytes / (total / (dp_shard x tp)) = {value:.4f}"
        )
        if worst_all is None or value > worst_all[0]:
            worst_all = (value, row, rank)
    differences = [
        abs(figures["estimate"] - sum(figures["local"].values()))
        for row in rows
        for figures in row["ranks"]
        if figures["estimate"] is not None
    ]
    if differences:
        print(f"estimator vs measured, every rank of every layout: largest difference {max(differences):,} bytes")
    value, row, rank = worst_all
    print(
        f"worst per-rank param+grad+optimizer bytes / (total / world size) = {value:.4f} "
        f"({row['model']}, {row['world_size']} ranks, {_layout(row)}, rank {rank}; target 1.0 plus padding)"
    )


def _layouts(text: str) -> list[tuple[int, int]]:
    """ "2x2,4x2" -> [(2, 2), (4, 2)]: (ranks, TP degree)."""
    layouts = []
    for item in filter(None, text.split(",")):
        ranks, _, tp = item.partition("x")
        layouts.append((int(ranks), int(tp)))
    return layouts


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="debug,100m", help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated rank counts, FSDP over all")
    parser.add_argument("--tp-layouts", default="2x2,4x2", help="comma-separated RANKSxTP, FSDP over the rest")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence of the one step")
    parser.add_argument("--quick", action="store_true", help="debug model, FSDP on 1 and 2 ranks, TP 2 on 2")
    parser.add_argument("--json", default=None, help="also write every rank's figures to this JSON file")
    options = parser.parse_args(argv)
    if options.quick:
        options.models, options.world_sizes, options.tp_layouts = "debug", "1,2", "2x2"
    options.models = [m for m in options.models.split(",") if m]
    for model in options.models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    try:
        options.world_sizes = [int(n) for n in options.world_sizes.split(",") if n]
        options.tp_layouts = _layouts(options.tp_layouts)
    except ValueError:
        parser.error("--world-sizes takes comma-separated integers, --tp-layouts RANKSxTP pairs like 4x2")
    if not options.world_sizes and not options.tp_layouts:
        parser.error("--world-sizes or --tp-layouts must name a layout")
    if min(options.world_sizes, default=1) < 1 or any(tp < 1 or ranks % tp for ranks, tp in options.tp_layouts):
        parser.error("rank counts must be positive, and each TP degree must divide its rank count")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    layouts = [(world_size, 1) for world_size in options.world_sizes] + options.tp_layouts
    rows = []
    with tempfile.TemporaryDirectory(prefix="titanlite-memory-") as work:
        for model in options.models:
            for world_size, tp in layouts:
                rows.append(measure(model, world_size, tp, options.seq_len, Path(work)))
    print(
        f"titanlite memory scaling, {datetime.date.today()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores, gloo; {time.perf_counter() - started:.0f} s "
        f"(load average {load_before[0]:.2f} before)"
    )
    print(
        "FSDP over the ranks TP leaves (TP: sequence and loss parallel), float32 parameters and gradients, AdamW; "
        "bytes of the real local storages after one step's optimizer.step(), before zero_grad(); "
        "estimator: estimate_memory for the same rank on a fake process group\n"
    )
    print_table(rows)
    print()
    if options.json:
        Path(options.json).write_text(json.dumps(rows, indent=2))
    for row in rows:
        missing = max(figures["grads_missing"] for figures in row["ranks"])
        if missing:
            print(f"note: {row['model']}, {_layout(row)}: {missing} parameter(s) had no gradient")
    print_ratios(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
