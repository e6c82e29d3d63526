"""Context parallelism's activation memory and step time: each rank of CP c at sequence S
against one rank at S / c (the same tokens per rank) and one rank at S (the same sequence).

    python benchmarks/context_parallel.py                    # debug model, S = 2048, c = 2 (~1 min)
    python benchmarks/context_parallel.py --seq-len 4096 --cp 2 --steps 3

Every layout runs in fresh processes, one per rank (torch.multiprocessing, spawn, gloo), each
building titanlite's own Trainer (float32, no activation checkpointing, one sequence per
micro-batch) and training ``--steps`` steps. Memory is what autograd keeps for the backward:
a saved_tensors_hooks pair counts, during the last step's forward, the bytes of every
distinct storage saved for backward (the activations; under CP the gathered keys and values
and the masks among them), which on CPU is measured exactly where a process's RSS is not.
Step time is the median of the steps after the first.

Expected: CP c at S holds about what one rank holds at S / c (every activation but attention's
scales with the local tokens), plus the gathered keys and values and the [S / c, S] masks;
its step time is one rank's at S / c plus the all-gathers, and below one rank's at S. The
estimator does not model CP yet, so no estimate is printed beside the figures.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import end_rank, free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402


class SavedBytes:
    """Counts the bytes of the distinct storages autograd saves for backward while it is entered."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _rank(rank: int, world_size: int, port: int, seq_len: int, steps: int, dump: str, out_dir: str) -> None:
    torchrun_environment(rank, world_size, port, LOG_RANK="")
    torch.set_num_threads(1)  # the ranks share the machine's cores alike in every layout

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    quiet_every_rank_lines()
    argv = [
        "--job.config_file=train_configs/debug_model.toml",
        f"--job.dump_folder={dump}",
        f"--training.seq_len={seq_len}",
        "--training.local_batch_size=1",
        f"--training.steps={steps}",
        "--training.mixed_precision_param=float32",
        "--activation_checkpoint.mode=none",
        f"--parallelism.context_parallel_degree={world_size}",
        "--metrics.log_freq=1000",
    ]
    trainer = Trainer(parse_args(argv))
    seconds, saved = [], SavedBytes()
    for step in range(steps):
        start = time.perf_counter()
        if step == steps - 1:
            with saved:
                trainer.train_step()
        else:
            trainer.train_step()
        seconds.append(time.perf_counter() - start)
    figures = {"saved_bytes": saved.total, "step_s": statistics.median(seconds[1:] or seconds)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(figures))
    end_rank()


def measure(seq_len: int, ranks: int, steps: int, work: Path) -> dict:
    """The worst rank's saved bytes and step time, for CP over ``ranks`` ranks at ``seq_len``."""
    out_dir = work / f"s{seq_len}-cp{ranks}"
    out_dir.mkdir(parents=True)
    args = (ranks, free_port(), seq_len, steps, str(out_dir), str(out_dir))
    mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn", join=True)
    figures = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return {key: max(rank[key] for rank in figures) for key in ("saved_bytes", "step_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="S, the sequence length under CP")
    parser.add_argument("--cp", type=int, default=2, help="c, the context-parallel degree")
    parser.add_argument("--steps", type=int, default=3, help="training steps per layout (the first is not timed)")
    options = parser.parse_args()
    if options.seq_len % (2 * options.cp):
        raise SystemExit(f"context_parallel: --seq-len {options.seq_len} must be a multiple of 2 x --cp {options.cp}")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        rows = {
            f"1 rank at S/c = {options.seq_len // options.cp}": measure(
                options.seq_len // options.cp, 1, options.steps, work
            ),
            f"CP {options.cp} at S = {options.seq_len}": measure(options.seq_len, options.cp, options.steps, work),
            f"1 rank at S = {options.seq_len}": measure(options.seq_len, 1, options.steps, work),
        }
    print("| layout | saved for backward per rank, MiB | step time, s |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['saved_bytes'] / 2**20:,.1f} | {row['step_s']:.3f} |")
    short, cp, whole = rows.values()
    print(f"memory: CP {options.cp} at S / one rank at S/c = {cp['saved_bytes'] / short['saved_bytes']:.3f}")
    print(f"memory: CP {options.cp} at S / one rank at S = {cp['saved_bytes'] / whole['saved_bytes']:.3f}")
    print(f"step time: CP {options.cp} at S / one rank at S/c = {cp['step_s'] / short['step_s']:.3f}")
    print(f"step time: CP {options.cp} at S / one rank at S = {cp['step_s'] / whole['step_s']:.3f}")


if __name__ == "__main__":
    main()
