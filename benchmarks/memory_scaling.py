"""Per-rank parameter + gradient + optimizer-state bytes under FSDP at 1, 2 and 4 ranks,
as a ratio to the whole model's bytes divided by the number of ranks.

    python benchmarks/memory_scaling.py                  # debug and 100m models, 1/2/4 ranks (~1.5 min)
    python benchmarks/memory_scaling.py --quick          # debug model, 1 and 2 ranks (~20 s)
    python benchmarks/memory_scaling.py --models 100m --world-sizes 2,4,8

For every (model, world size) the script starts fresh processes, one per rank, with
torch.multiprocessing (spawn) joined by a gloo process group, as torchrun would. Each rank
builds titanlite's own Trainer (FSDP over all ranks, float32 parameters and gradients,
AdamW) and runs one real training step (Trainer.train_step). A hook on the optimizer,
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

    ratio = this rank's bytes / (total / world size)

is 1.00 for perfect sharding. Above 1 comes from padding (a dimension 0 that the ranks do
not divide, e.g. the debug model's 258-token vocabulary over 4 ranks) and from AdamW's
scalar step counters, which every rank keeps whole (4 bytes per parameter tensor). Beside
the measurement, the estimator's arithmetic (titanlite.estimate.exact_model_state_bytes,
from the parameter shapes alone) is printed for the same rank. The table lists every rank;
the lines after it give the worst rank's ratio per world size and, last, the worst of all.

Models (llama3): debug is the debugmodel flavor (5.3 M parameters, vocabulary 2048); 100m
is dim 768, 8 blocks, 12 heads / 4 key-value heads, vocabulary 32000 (99.5 M parameters),
registered inside each worker. Activations are not counted (see titanlite.estimate for the
peak). 4 ranks on 2 cores oversubscribe, which costs time only: the bytes do not depend
on it.

Options: --models (default debug,100m), --world-sizes (default 1,2,4), --seq-len
(default 32; only the one step's time depends on it), --quick (debug model, 1 and 2
ranks), --json FILE (every rank's figures). Expected time on the 2-core VM: about 1.5
minutes by default (most of it the 100m model at 4 ranks), 15 s with --quick.
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


def estimated(flavor: str, seq_len: int, world_size: int, rank: int) -> int | None:
    """The estimator's arithmetic for this rank (parameters + gradients + optimizer), or
    None when titanlite.estimate cannot give it."""
    try:
        from titanlite.estimate import exact_model_state_bytes
        from titanlite.registry import get_model_args, get_model_spec

        spec = get_model_spec("llama3")
        with torch.device("meta"):
            model = spec.model_cls(get_model_args("llama3", flavor).with_seq_len(seq_len))
        figures = exact_model_state_bytes(model, world_size, "AdamW", rank)
    except Exception as error:  # an estimator being finished must not break the measurement
        print(f"estimate unavailable: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return figures.parameters + figures.gradients + figures.optimizer_state


# --- inside each rank ------------------------------------------------------------------


def _rank(rank: int, world_size: int, port: int, model_name: str, seq_len: int, dump: str, out_dir: str) -> None:
    torchrun_environment(rank, world_size, port, LOG_RANK="")  # the trainer's start-up lines would drown the table
    torch.set_num_threads(1)  # bytes do not depend on threads; 4 ranks share 2 cores
    flavor, args = MODELS[model_name]
    if args is not None:
        LLAMA3_FLAVORS.setdefault(flavor, args)  # spawned workers start with the built-in table

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    quiet_every_rank_lines()
    trainer = Trainer(
        parse_args(
            [
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
                "-1",  # FSDP over every rank
            ]
        )
    )
    figures = {}
    # After optimizer.step() and before zero_grad(): parameters, gradients and optimizer
    # state all exist only at this moment of the step.
    trainer.optimizer.register_step_post_hook(
        lambda optimizer, args, kwargs: figures.update(count(trainer.model, optimizer))
    )
    trainer.train_step()
    figures["estimate"] = estimated(flavor, seq_len, world_size, rank)
    figures["params"] = sum(p.numel() for p in trainer.model.parameters())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(figures))
    end_rank()


# --- the driver ------------------------------------------------------------------------


def measure(model: str, world_size: int, seq_len: int, work: Path) -> list[dict]:
    """Every rank's figures for one (model, world size), in rank order."""
    dump = work / f"{model}-{world_size}"
    out_dir = dump / "results"
    out_dir.mkdir(parents=True)
    mp.start_processes(
        _rank,
        args=(world_size, free_port(), model, seq_len, str(dump), str(out_dir)),
        nprocs=world_size,
        start_method="spawn",
        join=True,
    )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def ratio(figures: dict, world_size: int) -> float:
    return sum(figures["local"].values()) / (sum(figures["total"].values()) / world_size)


def print_table(rows: list[tuple[str, int, list[dict]]]) -> None:
    print(
        "| model | ranks | rank | parameters MiB | gradients MiB | optimizer MiB | sum MiB | "
        "total / ranks MiB | ratio | estimator MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, world_size, ranks in rows:
        for rank, figures in enumerate(ranks):
            local, total = figures["local"], sum(figures["total"].values())
            estimate = "n/a" if figures["estimate"] is None else f"{figures['estimate'] / MIB:.3f}"
            print(
                f"| {model} ({figures['params'] / 1e6:.1f} M) | {world_size} | {rank} | "
                + " | ".join(f"{local[part] / MIB:.3f}" for part in PARTS)
                + f" | {sum(local.values()) / MIB:.3f} | {total / world_size / MIB:.3f} | "
                f"{ratio(figures, world_size):.4f} | {estimate} |"
            )


def print_ratios(rows: list[tuple[str, int, list[dict]]]) -> None:
    """The worst rank per (model, world size), then the worst of all, last."""
    worst_all = None
    for model, world_size, ranks in rows:
        rank, figures = max(enumerate(ranks), key=lambda item: ratio(item[1], world_size))
        value = ratio(figures, world_size)
        print(
            f"{model}, {world_size} rank{'s' if world_size > 1 else ''}: worst rank ({rank}) "
            f"param+grad+optimizer bytes / (total / {world_size}) = {value:.4f}"
        )
        if worst_all is None or value > worst_all[0]:
            worst_all = (value, model, world_size, rank)
    value, model, world_size, rank = worst_all
    print(
        f"worst per-rank param+grad+optimizer bytes / (total / world size) = {value:.4f} "
        f"({model}, {world_size} ranks, rank {rank}; target 1.0 plus padding)"
    )


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="debug,100m", help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence of the one step")
    parser.add_argument("--quick", action="store_true", help="debug model, 1 and 2 ranks")
    parser.add_argument("--json", default=None, help="also write every rank's figures to this JSON file")
    options = parser.parse_args(argv)
    if options.quick:
        options.models, options.world_sizes = "debug", "1,2"
    options.models = [m for m in options.models.split(",") if m]
    for model in options.models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    try:
        options.world_sizes = [int(n) for n in options.world_sizes.split(",") if n]
    except ValueError:
        parser.error("--world-sizes takes comma-separated integers")
    if not options.world_sizes or min(options.world_sizes) < 1:
        parser.error("--world-sizes needs positive rank counts")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="titanlite-memory-") as work:
        for model in options.models:
            for world_size in options.world_sizes:
                rows.append((model, world_size, measure(model, world_size, options.seq_len, Path(work))))
    print(
        f"titanlite memory scaling, {datetime.date.today()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores, gloo; {time.perf_counter() - started:.0f} s "
        f"(load average {load_before[0]:.2f} before)"
    )
    print(
        "FSDP over every rank, float32 parameters and gradients, AdamW; bytes of the real local storages "
        "after one step's optimizer.step(), before zero_grad()\n"
    )
    print_table(rows)
    print()
    if options.json:
        Path(options.json).write_text(
            json.dumps([{"model": m, "world_size": w, "ranks": ranks} for m, w, ranks in rows], indent=2)
        )
    for model, world_size, ranks in rows:
        missing = max(figures["grads_missing"] for figures in ranks)
        if missing:
            print(f"note: {model}, {world_size} ranks: {missing} parameter(s) had no gradient")
    print_ratios(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
