"""How often a 2-rank CPU process ends in an abort after its work is done, ending as
titanlite's ranks do (titanlite.parallel.exit_process) or through the interpreter's own
teardown.

Each run starts 2 rank processes with torch.multiprocessing (spawn) joined by a gloo
process group, as torchrun would. Each rank builds the tiny model with FSDP in bfloat16,
takes one training step, leaves the process group and ends. Gloo's worker threads may still
be releasing the last collective's tensors then; during the interpreter's teardown such a
thread is ended inside a C++ destructor and the rank dies of SIGABRT (docs/reliability.md,
"An abort after a finished run"). The script counts, for each way of ending, the runs in
which a rank died of a signal, and the runs that failed otherwise.

    python benchmarks/exit_aborts.py                 # 20 runs of each way of ending
    python benchmarks/exit_aborts.py --runs 80 --only exit_process

Prints one line per way of ending:
    exit_process: 0 aborts in 20 runs (0 other failures), 97 s
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_process import free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

from titanlite.config import parse_args  # noqa: E402
from titanlite.parallel import destroy_distributed, exit_process  # noqa: E402
from titanlite.train import Trainer  # noqa: E402

WORLD_SIZE = 2
ENDINGS = ("exit_process", "interpreter_teardown")
# The tiny model's bf16 run (the parity test's): FSDP gathers bf16 parameters, reduces grads.
TRAINER_ARGS = [
    "--model.flavor=tiny",
    "--training.seq_len=32",
    "--training.local_batch_size=4",
    "--training.mixed_precision_param=bfloat16",
    "--activation_checkpoint.mode=none",
    "--metrics.enable_jsonl=false",
]


def _rank(rank: int, port: int, ending: str, dump: str) -> None:
    torchrun_environment(rank, WORLD_SIZE, port, LOG_RANK="")
    torch.set_num_threads(1)
    quiet_every_rank_lines()
    trainer = Trainer(parse_args([*TRAINER_ARGS, f"--job.dump_folder={dump}"]))
    trainer.train_step()
    destroy_distributed()
    if ending == "exit_process":
        exit_process(0)
    # Otherwise return: torch.multiprocessing's spawn main then exits through the
    # interpreter's teardown, as a plain Python program does.


def one_run(ending: str, dump: str) -> str:
    """'ok', 'abort' (a rank died of a signal) or 'failed' (a non-zero exit status)."""
    context = mp.start_processes(
        _rank, args=(free_port(), ending, dump), nprocs=WORLD_SIZE, start_method="spawn", join=False
    )
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as error:
        return "abort" if error.signal_name else "failed"
    except mp.ProcessRaisedException:
        return "failed"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each way of ending")
    parser.add_argument("--only", choices=ENDINGS, help="measure one way of ending")
    parser.add_argument("--dump", default="/tmp/titanlite-exit-aborts", help="the runs' dump folder")
    options = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for ending in [options.only] if options.only else ENDINGS:
        start = time.perf_counter()
        outcomes = [one_run(ending, options.dump) for _ in range(options.runs)]
        print(
            f"{ending}: {outcomes.count('abort')} aborts in {options.runs} runs "
            f"({outcomes.count('failed')} other failures), {time.perf_counter() - start:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
