"""Training throughput (tokens/s) per data-parallel layout, eager and compiled, on CPU ranks.

    python benchmarks/throughput.py                      # both models, every layout (~4.5 min)
    python benchmarks/throughput.py --quick              # debug model, 1 and 2 ranks, eager (~15 s)
    python benchmarks/throughput.py --models debug --layouts single,fsdp2 --compile-layouts fsdp2
    python benchmarks/throughput.py --steps 8 --seq-len 128 --json results.json

For every (model, layout, mode) the script starts fresh processes, one per rank, with
torch.multiprocessing (spawn) joined by a gloo process group, exactly as torchrun would
start them; each rank builds titanlite's own Trainer from command-line arguments and calls
Trainer.train() for `--steps` steps with metrics logged at every step (log_freq 1). The
tokens/s of a step is the trainer's own "throughput(tps)" metric: the tokens this rank
consumed in that step over the step's wall time. The first `--warmup` steps (one-off
allocations; with compile, the compilation itself) are dropped and a rank's steady-state
rate is the median over the remaining steps (the median, because other work on a shared
machine shows up as single slow steps). "total" is the sum over ranks. "load after" is
the 1-minute load average when the run ended; it includes the run's own ranks, so a
value well above the rank count means other work shared the cores and the row is noisy.

Models (llama3, float32 everywhere, no activation checkpointing, byte tokenizer, the
built-in python_stdlib data):
  debug  the llama3 debugmodel flavor (dim 256, 6 blocks, vocabulary 2048: 5.3 M params)
  100m   dim 768, 8 blocks, 12 heads / 4 key-value heads, vocabulary 32000: 99.5 M params
         (a flavor registered inside each worker; the byte tokenizer uses 258 of the rows)

Layouts (local batch per rank is fixed, so the global batch grows with the ranks):
  single  1 rank, no process group
  fsdp2 / fsdp4     FSDP over 2 / 4 ranks (replicate 1 x shard N)
  ddp2 / ddp4       DDP: N replicas of the whole model (replicate N x shard 1)
  hsdp2x2           HSDP: 2 replicas, each sharded over 2 ranks
Compiled runs (`compile.enable`: each block compiled by torch.compile/inductor) are made
for the layouts in `--compile-layouts` (default single,fsdp2, which the key ratio
compares; more layouts cost about 15 s each, the 4-rank ones more). Inductor's cache in
/tmp is reused between runs, so a first-ever run has a slower first step, nothing else.

What the numbers mean on this machine: each rank runs one torch thread (`--threads`),
so a rank stands for one device and its core: 1 rank uses one of the 2 cores, 2 ranks
both, and 4 ranks oversubscribe (two processes per core, marked "4 on 2 cores" in the
notes; their total cannot exceed what 2 ranks get). One thread per rank, rather than
the cores // ranks the trainer's launcher uses, because a single process with 2 OpenMP
threads on a shared 2-core VM is erratic: while another process keeps one core busy,
its steps were measured at 0.08 to 2 s against a steady 0.055 s with one thread (debug
model, seq 32 x 2). The figures show that the scaling mechanics work and what gloo
communication and per-rank overhead cost on CPU; they say nothing about GPU speed.
The key ratio, printed last, is

    FSDP 2 ranks total tokens/s / 1 rank tokens/s = X.XX

for the largest model measured, eager: two ranks, each with its own core, against one.
Each rank does the same work on its own batch as the single rank does, so 2.00 would be
linear scaling, as on 2 GPUs. What is missing is the price of FSDP's collectives over
gloo, which also need CPU time on the same 2 cores: per step the 100m model all-gathers
its 400 MB of float32 weights (twice: forward, and backward for the blocks resharded
after forward) and reduce-scatters 400 MB of gradients, against 64 tokens of compute
per rank, so on CPU this layout is communication-bound; the ratio rises with tokens per
rank (--seq-len, --batch). It is only meaningful when nothing else runs on the machine
(see "load after"). Lines before it give the
same ratio for every model and layout, and compiled / eager per layout that was compiled.

Options: --models (default debug,100m), --layouts (default all six), --compile-layouts
(default single,fsdp2; "" for none), --steps (per run, warm-up included, default 4),
--warmup (default 1), --seq-len (default 64), --batch (local batch, default 4; the 100m
model uses 1 to keep its steps short), --threads (torch threads per rank, default 1),
--quick (debug model, single and fsdp2, eager, 4 steps of 32 tokens x 2), --json FILE
(every measurement). Expected time on the 2-core VM: about 4.5 minutes for the default
run on a quiet machine (most of it the 100m model's 2- and 4-rank runs, whose steps take
2 to 6 s; 10 minutes were seen while other jobs shared the cores), about 15 s with
--quick. The Trainer's dump folders (metrics JSONL) live in a temporary folder that is
removed at the end.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import end_rank, free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs  # noqa: E402

# name -> (llama3 flavor, args to register in the worker or None for a built-in flavor)
MODELS = {
    "debug": ("debugmodel", None),
    "100m": (
        "bench100m",
        LlamaArgs(
            dim=768, n_layers=8, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256, rope_theta=500000.0
        ),
    ),
}
# The 100m model's steps take seconds per rank on 2 cores; one sequence per rank keeps
# the 4-rank runs short.
MAX_BATCH = {"100m": 1}


@dataclass(frozen=True)
class Layout:
    name: str
    strategy: str
    replicate: int
    shard: int

    @property
    def ranks(self) -> int:
        return self.replicate * self.shard


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("single", "single", 1, 1),
        Layout("fsdp2", "FSDP", 1, 2),
        Layout("ddp2", "DDP", 2, 1),
        Layout("fsdp4", "FSDP", 1, 4),
        Layout("ddp4", "DDP", 4, 1),
        Layout("hsdp2x2", "HSDP", 2, 2),
    )
}


@dataclass
class Result:
    """One (model, layout, mode) run; rates are steady-state medians."""

    model: str
    params: int
    layout: str
    strategy: str
    ranks: int
    replicate: int
    shard: int
    compiled: bool
    tokens_per_step_per_rank: int
    per_rank_tps: list[float]
    step_seconds: float  # median steady step, slowest rank
    first_step_seconds: float  # step 1, slowest rank (compilation lands here)
    load_after: float  # 1-minute load average when the run ended (its own ranks included)

    @property
    def total_tps(self) -> float:
        return sum(self.per_rank_tps)


# --- inside each rank ------------------------------------------------------------------


def trainer_argv(
    flavor: str, layout: Layout, compiled: bool, steps: int, seq_len: int, batch: int, dump: str
) -> list[str]:
    argv = [
        "--model.flavor",
        flavor,
        "--job.dump_folder",
        dump,
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(batch),
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "float32",  # CPUs have no fast bf16 matmul
        "--activation_checkpoint.mode",
        "none",  # measure the layouts, not recomputation
        "--parallelism.data_parallel_replicate_degree",
        str(layout.replicate),
        "--parallelism.data_parallel_shard_degree",
        str(layout.shard),
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",  # a tokens/s figure for every step
    ]
    return argv + (["--compile.enable"] if compiled else [])


def _rank(rank: int, world_size: int, port: int, model: str, argv: list[str], threads: int, out_dir: str) -> None:
    torchrun_environment(
        rank,
        world_size,
        port,
        LOG_RANK="",  # the trainer's per-step lines would drown the table
        # Inductor's pool of compile workers only competes with the ranks for 2 cores.
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    # One thread per rank by default: a rank stands for one device (see the docstring).
    torch.set_num_threads(threads)
    flavor, args = MODELS[model]
    if args is not None:
        LLAMA3_FLAVORS.setdefault(flavor, args)  # spawned workers start with the built-in table

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    quiet_every_rank_lines()
    trainer = Trainer(parse_args(argv))
    params = sum(p.numel() for p in trainer.model.parameters())
    step_start = time.perf_counter()
    step_times = []

    # Wall time per step as seen by this script, to report the first (compile) step;
    # the rates themselves come from the trainer's own metrics.
    def timed_step(original=trainer.train_step):
        nonlocal step_start
        result = original()
        now = time.perf_counter()
        step_times.append(now - step_start)
        step_start = now
        return result

    trainer.train_step = timed_step
    step_start = time.perf_counter()
    records = trainer.train()
    report = {
        "params": params,
        "tps": [r.tokens_per_second for r in records],
        "steps": [r.step for r in records],
        "step_times": step_times,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    end_rank()


# --- the driver ------------------------------------------------------------------------


def run_one(model: str, layout: Layout, compiled: bool, options: argparse.Namespace, batch: int, work: Path) -> Result:
    """Start the ranks of one configuration in fresh processes and summarise what they logged."""
    flavor, _ = MODELS[model]
    dump = work / f"{model}-{layout.name}-{'compile' if compiled else 'eager'}"
    steps, warmup, seq_len = options.steps, options.warmup, options.seq_len
    argv = trainer_argv(flavor, layout, compiled, steps, seq_len, batch, str(dump))
    out_dir = dump / "results"
    out_dir.mkdir(parents=True)
    mp.start_processes(
        _rank,
        args=(layout.ranks, free_port(), model, argv, options.threads, str(out_dir)),
        nprocs=layout.ranks,
        start_method="spawn",
        join=True,
    )
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(layout.ranks)]
    per_rank, steady_steps = [], []
    for report in ranks:
        # Steps after the warm-up; log_freq 1 gives one record per step.
        steady = [tps for step, tps in zip(report["steps"], report["tps"], strict=True) if step > warmup]
        per_rank.append(statistics.median(steady))
        steady_steps.append(statistics.median(report["step_times"][warmup:]))
    return Result(
        model=model,
        params=ranks[0]["params"],
        layout=layout.name,
        strategy=layout.strategy,
        ranks=layout.ranks,
        replicate=layout.replicate,
        shard=layout.shard,
        compiled=compiled,
        tokens_per_step_per_rank=seq_len * batch,
        per_rank_tps=per_rank,
        step_seconds=max(steady_steps),
        first_step_seconds=max(r["step_times"][0] for r in ranks),
        load_after=os.getloadavg()[0],
    )


def _notes(result: Result, cores: int) -> str:
    notes = []
    if result.ranks > cores:
        notes.append(f"{result.ranks} on {cores} cores")
    if result.compiled:
        notes.append("step 1 compiles")
    return ", ".join(notes)


def print_table(results: list[Result], cores: int) -> None:
    print(
        "| model | layout | ranks (repl x shard) | mode | tokens/step/rank | tokens/s per rank | "
        "total tokens/s | steady step s | first step s | load after | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        per_rank = " / ".join(f"{tps:,.0f}" for tps in r.per_rank_tps)
        print(
            f"| {r.model} ({r.params / 1e6:.1f} M) | {r.strategy} | {r.ranks} ({r.replicate} x {r.shard}) | "
            f"{'compile' if r.compiled else 'eager'} | {r.tokens_per_step_per_rank} | {per_rank} | "
            f"{r.total_tps:,.0f} | {r.step_seconds:.3f} | {r.first_step_seconds:.2f} | {r.load_after:.1f} | "
            f"{_notes(r, cores)} |"
        )


def _find(results: list[Result], model: str, layout: str, compiled: bool) -> Result | None:
    for r in results:
        if (r.model, r.layout, r.compiled) == (model, layout, compiled):
            return r
    return None


def print_ratios(results: list[Result], models: list[str]) -> None:
    """Every layout against one eager rank, compile against eager, and the key ratio last."""
    for model in models:
        base = _find(results, model, "single", False)
        if base is None:
            continue
        for r in results:
            if r.model == model and not r.compiled and r.layout != "single":
                print(
                    f"{model}: {r.strategy} {r.ranks} ranks total tokens/s / 1 rank tokens/s = "
                    f"{r.total_tps / base.total_tps:.2f}"
                )
    for model in models:
        for r in results:
            eager = _find(results, model, r.layout, False) if r.model == model and r.compiled else None
            if eager is not None:
                print(
                    f"{model}: {r.strategy} {r.ranks} rank{'s' if r.ranks > 1 else ''} "
                    f"compile / eager total tokens/s = {r.total_tps / eager.total_tps:.2f}"
                )
    # The key ratio: the largest model that has both the single and the FSDP 2 run.
    for model in reversed(models):
        base, fsdp = _find(results, model, "single", False), _find(results, model, "fsdp2", False)
        if base is not None and fsdp is not None:
            print(
                f"key ratio ({model}, eager): FSDP 2 ranks total tokens/s / 1 rank tokens/s = "
                f"{fsdp.total_tps / base.total_tps:.2f} (2.00 would be linear scaling)"
            )
            return
    print("key ratio: not measured (needs the single and fsdp2 layouts)")


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="debug,100m", help=f"comma-separated, from {','.join(MODELS)}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {','.join(LAYOUTS)}")
    parser.add_argument("--compile-layouts", default="single,fsdp2", help="layouts also run compiled ('' for none)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the rates")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="local batch (the 100m model uses at most 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="debug model, single and fsdp2, eager, 4 short steps")
    parser.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    options = parser.parse_args(argv)
    if options.quick:
        options.models, options.layouts, options.compile_layouts = "debug", "single,fsdp2", ""
        options.steps, options.warmup, options.seq_len, options.batch = 4, 1, 32, 2
    options.models = [m for m in options.models.split(",") if m]
    options.layouts = [name for name in options.layouts.split(",") if name]
    options.compile_layouts = [name for name in options.compile_layouts.split(",") if name]
    for model in options.models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    for name in options.layouts + options.compile_layouts:
        if name not in LAYOUTS:
            parser.error(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}")
    if options.steps <= options.warmup:
        parser.error("--steps must be larger than --warmup (some steps must be timed)")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="titanlite-throughput-") as work:
        for model in options.models:
            batch = min(options.batch, MAX_BATCH.get(model, options.batch))
            for name in options.layouts:
                layout = LAYOUTS[name]
                modes = [False] + ([True] if name in options.compile_layouts else [])
                for compiled in modes:
                    results.append(run_one(model, layout, compiled, options, batch, Path(work)))
    print(
        f"titanlite throughput, {datetime.date.today()}, torch {torch.__version__}, {cores} CPU cores, gloo; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(
        f"float32, no activation checkpointing, seq {options.seq_len}; {options.steps} steps per run, the first "
        f"{options.warmup} left out; tokens/s are per-rank medians of the trainer's per-step metric; "
        f"{options.threads} thread(s) per rank\n"
    )
    print_table(results, cores)
    print()
    if options.json:
        Path(options.json).write_text(json.dumps([asdict(r) | {"total_tps": r.total_tps} for r in results], indent=2))
    print_ratios(results, options.models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
