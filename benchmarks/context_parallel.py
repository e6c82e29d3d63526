"""Context parallelism's activation memory and step time: each rank of CP c at sequence S
against one rank at S / c (the same tokens per rank), one rank at S (the same sequence) and
FSDP over c ranks at S / c (the same tokens per rank and the same weight traffic over c ranks).

    python benchmarks/context_parallel.py                    # debug model, S = 2048, c = 2 (~1 min)
    python benchmarks/context_parallel.py --seq-len 4096 --cp 2 --steps 3
    python benchmarks/context_parallel.py --dim 1024 --layers 4 --steps 4   # a wider model (~5 min)

Every layout runs in c fresh processes of one core each (torch.multiprocessing, spawn, gloo):
the c ranks of CP, or c one-rank runs side by side (each alone in its world; the worst is
reported), so that each layout's processes get the same share of a machine that other work
shares too. Each process builds titanlite's own Trainer (float32, no activation checkpointing, one sequence per
micro-batch) and training ``--steps`` steps. Memory is what autograd keeps for the backward:
a saved_tensors_hooks pair counts, during the last step's forward, the bytes of every
distinct storage saved for backward (the activations; under CP the gathered keys and values
and the masks among them), which on CPU is measured exactly where a process's RSS is not.
Step time is the median of the steps after the first, in wall-clock seconds and in the
process's CPU seconds (all its threads: what it computes, whatever share of a shared machine
it gets). Attention work is counted at the dispatcher (AttentionWork: batch x heads x q_len x
kv_len of every forward SDPA kernel call, half for a causal one) and printed per rank as a
share of its [S/c, S] rectangle.

Expected: CP c at S holds about what one rank holds at S / c (every activation but attention's
scales with the local tokens), plus the gathered keys and values; each rank's attention work
is half its rectangle (the kernel computes what the causal mask keeps, head-tail chunks give
every rank the same), which is c times one rank's at S / c (each token sees c times the keys
on average); its step time is one rank's at S / c plus that extra attention, FSDP's
collectives over the cp ranks and the all-gathers, and below one rank's at S. FSDP c at S / c
pays the same collectives for its weights, so CP c over it is what CP itself adds: the
doubled attention and the key/value all-gathers.

Beside each layout the estimator's figures for the same run (goal: within 10%): rank 0's
simulated activations (against the saved bytes) and peak (against the real tensors' peak,
titanlite.estimate.measure_real_memory on the real gloo group), and its step time, at a
FLOP/s rate calibrated on the one-rank run at S / c (the CPU has no table row); the ratios
are measured / estimated.
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
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import end_rank, free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

# The forward attention operators SDPA dispatches to, and where each takes is_causal (the math
# kernel's is_causal computes the whole rectangle, so it counts whole).
_ATTENTION_OPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": 4,
    "aten._scaled_dot_product_flash_attention.default": 4,
    "aten._scaled_dot_product_efficient_attention.default": 6,
    "aten._scaled_dot_product_cudnn_attention.default": 6,
    "aten._scaled_dot_product_attention_math.default": None,
}


class AttentionWork(TorchDispatchMode):
    """Counts, while entered, the attention work of every forward SDPA kernel call: batch x query
    heads x q_len x kv_len (the scores it computes), half of it for a causal call, whose kernel
    skips the blocks above the diagonal; a masked call counts whole (the kernels compute every
    masked score)."""

    def __init__(self):
        super().__init__()
        self.pairs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in _ATTENTION_OPS:
            q, k = args[0], args[1]
            causal_at = _ATTENTION_OPS[name]
            causal = causal_at is not None and len(args) > causal_at and bool(args[causal_at])
            causal = causal or bool(kwargs.get("is_causal", False)) and causal_at is not None
            pairs = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
            self.pairs += pairs // 2 if causal else pairs
        return func(*args, **kwargs)


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


# --dim / --layers: a wider llama3 than the debug model, registered under this name in the
# benchmark's process and in each rank it spawns (heads of 64, a quarter as many key/value heads).
WIDE_FLAVOR = "context_parallel_benchmark"
_width: tuple[int, int] | None = None


def use_width(width: tuple[int, int] | None) -> None:
    """Run the model ``width`` = (dim, layers) from now on in this process (None: the debug model)."""
    global _width
    _width = width
    if width is not None:
        from dataclasses import replace

        from titanlite.models.llama.args import LLAMA3_FLAVORS

        dim, layers = width
        debug = LLAMA3_FLAVORS["debugmodel"]
        LLAMA3_FLAVORS[WIDE_FLAVOR] = replace(debug, dim=dim, n_layers=layers, n_heads=dim // 64, n_kv_heads=dim // 256)


def _argv(seq_len: int, cp: int, steps: int, dump: str) -> list[str]:
    """The benchmark's run (and what the estimate is asked about): the debug model (or the
    --dim / --layers one), one sequence, float32, no activation checkpointing, CP over all the ranks."""
    return [
        "--job.config_file=train_configs/debug_model.toml",
        *([f"--model.flavor={WIDE_FLAVOR}"] if _width is not None else []),
        f"--job.dump_folder={dump}",
        f"--training.seq_len={seq_len}",
        "--training.local_batch_size=1",
        f"--training.steps={steps}",
        "--training.mixed_precision_param=float32",
        "--activation_checkpoint.mode=none",
        f"--parallelism.context_parallel_degree={cp}",
        "--metrics.log_freq=1000",
    ]


def _rank(
    process: int,
    world_size: int,
    ports: list[int],
    seq_len: int,
    cp: int,
    steps: int,
    dump: str,
    out_dir: str,
    width: tuple[int, int] | None,
) -> None:
    """One rank of a run over ``world_size`` ranks (``ports`` one port; CP over ``cp`` of
    them, FSDP over the rest), or, given a port per process, a one-rank run of its own beside
    the others (world_size 1 each)."""
    use_width(width)
    rank = 0 if len(ports) > 1 else process
    torchrun_environment(rank, world_size, ports[process if len(ports) > 1 else 0], LOG_RANK="")
    torch.set_num_threads(1)  # one core a process, and as many processes in every layout

    from titanlite.config import parse_args
    from titanlite.estimate import measure_real_memory
    from titanlite.train import Trainer

    quiet_every_rank_lines()
    argv = _argv(seq_len, cp, steps, f"{dump}/{process}")
    trainer = Trainer(parse_args(argv))
    seconds, cpu_seconds, saved, work = [], [], SavedBytes(), AttentionWork()
    for step in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        if step == steps - 1:
            with saved, work:
                trainer.train_step()
        else:
            trainer.train_step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    figures = {
        "saved_bytes": saved.total,
        "step_s": statistics.median(seconds[1:] or seconds),
        "cpu_s": statistics.median(cpu_seconds[1:] or cpu_seconds),
        "attention_pairs": work.pairs,
    }
    # The step's peak, the real tensors of a fresh model of the same config on the real gloo
    # group, under the tracker the estimate uses (titanlite.estimate.measure_real_memory).
    figures["peak_bytes"] = measure_real_memory(parse_args(argv))["peak"]
    Path(out_dir, f"rank{process}.json").write_text(json.dumps(figures))
    end_rank()


def measure(seq_len: int, ranks: int, processes: int, steps: int, work: Path, cp: int | None = None) -> dict:
    """The worst rank's saved bytes and step time, for ``ranks`` ranks at ``seq_len``, CP over
    ``cp`` of them (default: all) and FSDP over the rest; one rank (``ranks`` 1) runs as
    ``processes`` separate one-rank runs at once, so that every layout keeps as many cores busy
    (on a machine shared with other work, one process alone would get more of it than each of
    the CP ranks)."""
    cp = ranks if cp is None else cp
    out_dir = work / f"s{seq_len}-r{ranks}-cp{cp}"
    out_dir.mkdir(parents=True)
    ports = [free_port()] if ranks > 1 else [free_port() for _ in range(processes)]
    args = (ranks, ports, seq_len, cp, steps, str(out_dir), str(out_dir), _width)
    mp.start_processes(_rank, args=args, nprocs=processes, start_method="spawn", join=True)
    figures = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]
    worst = {key: max(rank[key] for rank in figures) for key in ("saved_bytes", "step_s", "cpu_s", "peak_bytes")}
    return worst | {"attention_pairs": [rank["attention_pairs"] for rank in figures]}


def attention_rectangle(seq_len: int, cp: int) -> int:
    """What a rank's kernel computing the whole [seq_len / cp, seq_len] rectangle would count in a
    step's forward: layers x query heads x that rectangle (one sequence, no recomputation)."""
    from titanlite.config import parse_args
    from titanlite.plan import run_model_args

    args = run_model_args(parse_args(_argv(seq_len, cp, 1, "unused")))
    return args.n_layers * args.n_heads * (seq_len // cp) * seq_len


def estimate(seq_len: int, cp: int, flops_per_second: float, world_size: int | None = None) -> dict:
    """The estimator's figures for the same run: rank 0's memory simulated (its activations and
    peak), and its step time at ``flops_per_second`` (this machine's rate, calibrated on one
    rank at S / c) with the keys' and values' all-gathers at the estimator's intra-node bandwidth."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_for_job_config, estimate_memory, get_hardware

    config = parse_args(_argv(seq_len, cp, 1, "unused"))
    world_size = cp if world_size is None else world_size
    memory = estimate_memory(config, world_size=world_size, device_type="cpu")
    hardware = get_hardware("h100", peak_flops=flops_per_second)
    timing = estimate_for_job_config(config, world_size=world_size, hardware=hardware, efficiency=1.0)
    return {"activations": memory.activations, "peak_bytes": memory.peak_bytes, "step_s": timing.step_s}


def calibrated_rate(seq_len: int, step_s: float) -> float:
    """The FLOP/s that make the estimate of one rank at ``seq_len`` take ``step_s``: its step is
    all compute (no communication), proportional to the FLOPs."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_for_job_config, get_hardware

    config = parse_args(_argv(seq_len, 1, 1, "unused"))
    timing = estimate_for_job_config(
        config, world_size=1, hardware=get_hardware("h100", peak_flops=1e12), efficiency=1.0
    )
    return 1e12 * timing.step_s / step_s


def attention_kernel_seconds(seq_len: int, cp: int, repeats: int = 5) -> tuple[float, float]:
    """Forward and backward of one attention layer of the run's model alone, in this process on one
    thread (the fastest of ``repeats``): CP rank 0's kernel calls at ``seq_len`` (its own keys
    and the gathered ones given, no collective) and one rank's causal SDPA at seq_len / cp."""
    import torch.nn.functional as F

    from titanlite.config import parse_args
    from titanlite.models.merged_attention import merged_attention
    from titanlite.parallel.context_parallel import SequenceSplit
    from titanlite.plan import run_model_args

    args = run_model_args(parse_args(_argv(seq_len, cp, 1, "unused")))
    local = seq_len // cp
    torch.set_num_threads(1)

    def heads(n: int, length: int) -> torch.Tensor:
        return torch.randn(1, n, length, args.head_dim, requires_grad=True)

    def cp_rank() -> None:
        q, k, v = heads(args.n_heads, local), heads(args.kv_heads, local), heads(args.kv_heads, local)
        gathered = heads(args.kv_heads, local * cp).detach().reshape(cp, args.kv_heads, local, -1)
        calls = SequenceSplit(cp, 0, True).attention_calls(1, local, None)
        merged_attention(q, [(k, v), (gathered, gathered)], calls, None).sum().backward()

    def one_rank() -> None:
        q, k, v = heads(args.n_heads, local), heads(args.kv_heads, local), heads(args.kv_heads, local)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    def fastest(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return fastest(cp_rank), fastest(one_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="S, the sequence length under CP")
    parser.add_argument("--cp", type=int, default=2, help="c, the context-parallel degree")
    parser.add_argument("--steps", type=int, default=3, help="training steps per layout (the first is not timed)")
    parser.add_argument("--dim", type=int, default=None, help="a wider llama3: its width (a multiple of 256)")
    parser.add_argument("--layers", type=int, default=4, help="with --dim: its blocks")
    options = parser.parse_args()
    if options.dim is not None and (options.dim < 256 or options.dim % 256):
        raise SystemExit(f"context_parallel: --dim {options.dim} must be a positive multiple of 256")
    use_width(None if options.dim is None else (options.dim, options.layers))
    if options.seq_len % (2 * options.cp):
        raise SystemExit(f"context_parallel: --seq-len {options.seq_len} must be a multiple of 2 x --cp {options.cp}")
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        c, seq_len, steps = options.cp, options.seq_len, options.steps
        # name: (its sequence length, its ranks, CP over them)
        layouts = {
            f"1 rank at S/c = {seq_len // c}": (seq_len // c, 1, 1),
            f"CP {c} at S = {seq_len}": (seq_len, c, c),
            f"1 rank at S = {seq_len}": (seq_len, 1, 1),
            f"FSDP {c} at S/c = {seq_len // c}": (seq_len // c, c, 1),
        }
        rows = {name: measure(length, ranks, c, steps, work, cp) for name, (length, ranks, cp) in layouts.items()}
    short, cp, whole, fsdp = rows.values()
    rate = calibrated_rate(options.seq_len // options.cp, short["step_s"])
    estimates = [estimate(length, cp_degree, rate, ranks) for length, ranks, cp_degree in layouts.values()]
    print(f"(step time estimated at {rate / 1e9:.1f} GFLOP/s, calibrated on one rank at S/c)")
    print(
        "| layout | saved for backward, MiB | estimated activations, MiB | ratio | peak, MiB | estimated peak, MiB "
        "| ratio | step time, s | estimated, s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, row), est in zip(rows.items(), estimates, strict=True):
        mib = 2**20
        print(
            f"| {name} | {row['saved_bytes'] / mib:,.1f} | {est['activations'] / mib:,.1f} "
            f"| {row['saved_bytes'] / est['activations']:.3f} | {row['peak_bytes'] / mib:,.1f} "
            f"| {est['peak_bytes'] / mib:,.1f} | {row['peak_bytes'] / est['peak_bytes']:.3f} | {row['step_s']:.3f} "
            f"| {est['step_s']:.3f} | {row['step_s'] / est['step_s']:.3f} |"
        )
    for (name, row), (length, _, cp_degree) in zip(rows.items(), layouts.values(), strict=True):
        shares = ", ".join(f"{pairs / attention_rectangle(length, cp_degree):.3f}" for pairs in row["attention_pairs"])
        print(f"attention work per rank / the [S/c, S] rectangle ({name}): {shares}")
    print(f"memory: CP {options.cp} at S / one rank at S/c = {cp['saved_bytes'] / short['saved_bytes']:.3f}")
    print(f"memory: CP {options.cp} at S / one rank at S = {cp['saved_bytes'] / whole['saved_bytes']:.3f}")
    print(f"step time: CP {options.cp} at S / one rank at S/c = {cp['step_s'] / short['step_s']:.3f}")
    print(f"step time: CP {options.cp} at S / one rank at S = {cp['step_s'] / whole['step_s']:.3f}")
    print(
        f"CPU seconds a step (all the process's threads; what a rank computes, whatever share of the "
        f"machine it gets): CP {options.cp} at S / one rank at S/c = {cp['cpu_s'] / short['cpu_s']:.3f} "
        f"({cp['cpu_s']:.3f} / {short['cpu_s']:.3f})"
    )
    print(
        f"CPU seconds a step, CP {options.cp} at S / FSDP {options.cp} at S/c (the same tokens per rank and the same "
        f"weight traffic: what CP adds to any {options.cp}-rank layout) = {cp['cpu_s'] / fsdp['cpu_s']:.3f} "
        f"({cp['cpu_s']:.3f} / {fsdp['cpu_s']:.3f}); FSDP {options.cp} at S/c / one rank at S/c = "
        f"{fsdp['cpu_s'] / short['cpu_s']:.3f}"
    )
    kernel_cp, kernel_one = attention_kernel_seconds(options.seq_len, options.cp)
    print(
        f"one attention layer alone (forward + backward, one process): CP {options.cp} rank 0 at S "
        f"{kernel_cp * 1e3:.1f} ms / one rank at S/c {kernel_one * 1e3:.1f} ms = {kernel_cp / kernel_one:.3f}"
    )
    pairs = max(cp["attention_pairs"]) / max(short["attention_pairs"])
    print(f"attention work: CP {options.cp} at S / one rank at S/c = {pairs:.3f} (a token sees c times the keys)")


if __name__ == "__main__":
    main()
