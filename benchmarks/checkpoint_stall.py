"""How long one checkpoint save stalls the training loop, for each checkpoint.async_mode.

    python benchmarks/checkpoint_stall.py                 # 2 gloo ranks on this machine
    python benchmarks/checkpoint_stall.py --repeats 6 --folder /some/disk
    python benchmarks/checkpoint_stall.py --cpu-dry-run   # every line, tiny model, 2 saves per mode

The script starts its own ranks with torch.multiprocessing (no torchrun needed). Each rank
builds a titanlite Trainer for a Llama 3 of about 134 M parameters (dim 768, 12 blocks,
12 heads, vocabulary 32000), sharded with FSDP over the ranks in float32, and trains a
couple of real steps so that AdamW's moments exist, then times a few plain training steps.
Then, for each mode, it makes a CheckpointManager over the trainer's own states (model,
optimizer, lr_scheduler, dataloader, train_state, rng), makes it the trainer's checkpointer,
and `--repeats` times saves and runs the next training step, as the training loop does.
Per save it records, as the maximum over ranks:

  save() returns   the time CheckpointManager.save() blocks the caller
  staging wait     the time the next step's optimizer step waits for staging to finish
  stall            the two together: how long the training thread is blocked by the save
                   (for `disabled` this is the whole save)
  step slowdown    the next training step's wall time minus the median plain step: the
                   background copy and write competing with training for the same cores
                   and memory (on a GPU machine the training runs on the GPU instead)
  on disk          from save() until wait() returns: every rank's data, the DCP metadata
                   and the rename to step-N are done

A last row times only the state_dict() calls every save makes on the training thread
(median of 3), the part of the stall that no async mode removes.

The first save of a mode is reported apart from the later ones: for async_with_pinned_mem
it also starts the background writer processes and allocates the reused staging buffers.
The last lines compare the steady-state median stalls of this run:
`stall ratio async/sync = X.XX (target <= 0.05)`.

Each mode keeps only its newest checkpoint (keep_latest_k = 1), so deleting the previous
one is part of the measured time as it is in a run; the whole folder is removed at the
end. The background writer processes of async_with_pinned_mem (started by
torch.distributed.checkpoint) print a few INFO lines of their own.

On a machine with CUDA the trainer puts rank r on GPU r (NCCL for training, gloo for the
checkpoint's group), so --world-size must not exceed the GPUs; every timestamp is taken
after the device has finished the work queued before it. --cpu-dry-run runs every line of
the same code on CPU ranks with the tiny model and 2 saves per mode, except the lines
marked "# cuda-only" (gpu_check.CUDA_ONLY); tests/test_gpu_check.py runs it under coverage.
Measured so far on CPU ranks only (gloo).
"""

import argparse
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_process import end_rank, free_port, torchrun_environment
from torch.distributed.tensor import DTensor

from titanlite.checkpoint import CheckpointManager, complete_steps
from titanlite.config import Checkpoint, parse_args
from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs
from titanlite.train import Trainer

FLAVOR = "bench134m"
MODEL_ARGS = LlamaArgs(dim=768, n_layers=12, n_heads=12, vocab_size=32000, multiple_of=256, rope_theta=500000.0)
DRY_RUN_FLAVOR = "tiny"
MODES = ("disabled", "async", "async_with_pinned_mem")
WARMUP_STEPS = 2
TARGET = 0.05


def trainer_args(dump_folder: str, flavor: str) -> list[str]:
    return [
        "--model.flavor",
        flavor,
        "--job.dump_folder",
        dump_folder,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        "1000",
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--lr_scheduler.warmup_steps",
        "2",
    ]


def _max_over_ranks(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _folder_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def settle(device: torch.device) -> float:
    """The time once the device has finished the work queued so far (CUDA runs behind the
    host: a timestamp without this would time the queueing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # cuda-only
    return time.perf_counter()


def measure(folder: str, repeats: int, flavor: str) -> dict:
    """Runs on every rank; returns the timings (max over ranks) and a few facts."""
    trainer = Trainer(parse_args(trainer_args(folder, flavor)))
    device = trainer.device
    for _ in range(WARMUP_STEPS):
        trainer.train_step()
    states = trainer.checkpointer.states
    # The floor under every mode's stall: the state_dict() calls a save makes on the
    # training thread before anything is copied or written.
    collect_seconds = []
    for _ in range(3):
        dist.barrier()
        start = settle(device)
        collected = {name: state.state_dict() for name, state in states.items()}
        collect_seconds.append(settle(device) - start)
    local_bytes = sum(
        (t.to_local() if isinstance(t, DTensor) else t).nbytes for part in collected.values() for t in _tensors(part)
    )
    del collected
    plain_steps = []
    for _ in range(3):
        dist.barrier()
        start = settle(device)
        trainer.train_step()
        plain_steps.append(settle(device) - start)
    plain_step = statistics.median(plain_steps)
    report = {
        "plain_step_seconds": _max_over_ranks([plain_step])[0],
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "timings": {},
        "checkpoint_bytes": 0,
        "state_dict_seconds": _max_over_ranks([statistics.median(collect_seconds)])[0],
        "state_bytes_per_rank": _max_over_ranks([float(local_bytes)])[0],
    }
    for mode in MODES:
        config = Checkpoint(enable=True, folder=f"checkpoint-{mode}", async_mode=mode, keep_latest_k=1)
        manager = CheckpointManager(states, config, folder)
        trainer.checkpointer = manager  # train_step() waits for this manager's staging
        staging_waits = []

        def timed_wait_for_staging(wait_for_staging=manager.wait_for_staging, waits=staging_waits):
            started = time.perf_counter()
            wait_for_staging()
            waits.append(time.perf_counter() - started)

        manager.wait_for_staging = timed_wait_for_staging
        rows = []
        for _ in range(repeats):
            gc.collect()
            dist.barrier()
            start = settle(device)
            manager.save(trainer.step)
            returned = settle(device)
            staging_waits.clear()
            trainer.train_step()
            stepped = settle(device)
            manager.wait()
            written = settle(device)
            staging_wait = sum(staging_waits)
            slowdown = stepped - returned - plain_step
            rows.append(
                _max_over_ranks(
                    [returned - start, staging_wait, returned - start + staging_wait, slowdown, written - start]
                )
            )
        manager.close()
        report["timings"][mode] = rows
        if trainer.rank == 0:
            newest = list(complete_steps(manager.folder).values())[-1]
            report["checkpoint_bytes"] = _folder_bytes(newest)
    dist.barrier()
    return report


def _worker(rank: int, world_size: int, port: int, folder: str, repeats: int, result_file: str, dry_run: bool) -> None:
    torchrun_environment(rank, world_size, port, LOG_RANK="")  # INFO lines would interleave with the table
    if dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The ranks share the machine's cores; more threads than cores per rank only thrash.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    LLAMA3_FLAVORS.setdefault(FLAVOR, MODEL_ARGS)
    report = measure(folder, repeats, DRY_RUN_FLAVOR if dry_run else FLAVOR)
    if rank == 0:
        torch.save(report, result_file)
    end_rank()


def _summary(rows: list[list[float]]) -> tuple[list[float], list[float]]:
    """The first save's row, and the median of the later ones."""
    first, later = rows[0], rows[1:]
    return first, [statistics.median(row[i] for row in later) for i in range(len(first))]


def print_report(report: dict, world_size: int, repeats: int, load_before: tuple, load_after: tuple) -> None:
    print(
        f"checkpoint stall: llama3 {report['params'] / 1e6:.1f} M params + AdamW, FSDP over {world_size} gloo "
        f"ranks, float32; {report['state_bytes_per_rank'] / 1e9:.2f} GB of tensors per rank, "
        f"{report['checkpoint_bytes'] / 1e9:.2f} GB per checkpoint on disk"
    )
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {world_size} ranks x {torch.get_num_threads()} "
        f"thread(s); load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{datetime.date.today().isoformat()}"
    )
    print(f"seconds, max over ranks; 'later' is the median of saves 2..{repeats}\n")
    print("| async_mode | save | save() returns | staging wait | stall (thread blocked) | step slowdown | on disk |")
    print("|---|---|---|---|---|---|---|")
    steady = {}
    for mode in MODES:
        first, later = _summary(report["timings"][mode])
        for label, row in (("first", first), ("later", later)):
            print(f"| {mode} | {label} | " + " | ".join(f"{value:.3f}" for value in row) + " |")
        steady[mode] = later
    print(f"| (every mode) | state_dict() calls only | | | {report['state_dict_seconds']:.3f} | | |")
    print(f"| (no save) | one plain training step | | | | {report['plain_step_seconds']:.3f} | |")
    print()
    sync_stall = steady["disabled"][2]
    for mode in MODES[1:]:
        print(f"stall ratio {mode}/sync = {steady[mode][2] / sync_stall:.2f} (target <= {TARGET})")
    for mode in MODES[1:]:
        print(f"step slowdown {mode}/sync save = {steady[mode][3] / sync_stall:.2f} (CPU contention, not a stall)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="saves per mode (the first is reported apart)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start (one GPU each on CUDA)")
    parser.add_argument("--folder", default=None, help="where to write checkpoints (default: a temporary folder)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="every line on CPU: tiny model, 2 saves per mode")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        args.repeats = 2
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the first save is reported apart from the later ones)")
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (one rank has no process group)")
    if torch.cuda.is_available() and not args.cpu_dry_run and args.world_size > torch.cuda.device_count():
        parser.error(f"--world-size {args.world_size} needs as many GPUs; this machine has fewer")  # cuda-only

    load_before = os.getloadavg()
    parent = args.folder or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="titanlite-ckpt-bench-", dir=parent) as folder:
        result_file = str(Path(folder) / "report.pt")
        mp.start_processes(
            _worker,
            args=(args.world_size, free_port(), folder, args.repeats, result_file, args.cpu_dry_run),
            nprocs=args.world_size,
            start_method="spawn",
            join=True,
        )
        report = torch.load(result_file, weights_only=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    print_report(report, args.world_size, args.repeats, load_before, os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
