"""Will a config fit, and how fast will it run? Answered on a laptop, before renting GPUs.

    python scripts/estimate.py --job.config_file train_configs/llama7b.toml --world_size 8 --hardware h100
    python scripts/estimate.py --job.config_file train_configs/llama3_70b.toml --nodes 16 --json
    python scripts/estimate.py --job.config_file train_configs/llama7b.toml --sweep
    python scripts/estimate.py --job.config_file train_configs/llama3_8b.toml --sweep --sweep_sizes 8,64
    python scripts/estimate.py --job.config_file CFG --world_size 16 --parallelism.tensor_parallel_degree 8
    python scripts/estimate.py --job.config_file CFG --inter_node_gbps 25 --training.local_batch_size 4

Memory: rank 0 of the requested layout is simulated in this process with a fake process
group and fake tensors (nothing of the model's size is allocated): the config's real
parallelize function (tensor parallelism included), optimizer, activation checkpointing and
mixed precision, one forward/backward/optimizer step under PyTorch's FSDP memory tracker.
Step time: an analytic model of compute (FLOPs per token x tokens per device over peak x
efficiency) and communication (FSDP's all-gather and reduce-scatter on the shard group, the
all-reduce on the replicate group, TP's per-block collectives on the TP group, expert
parallelism's all-to-alls on the EP group, each on the link its ranks share). Every other
option is a config override (--section.key value), as for training:
--parallelism.tensor_parallel_degree 2 asks for TP.

The world size is --world_size, or --nodes x GPUs per node, or one node. --sweep prints FSDP and
HSDP (one shard group per node), each with every TP degree the model and the node allow and every
pipeline degree of --sweep_pp (1, 2, 4, 8, 16) with each schedule of --sweep_schedules (1F1B,
Interleaved1F1B) and, for an MoE model, every expert-parallel degree of --sweep_ep that the
layout's shard degree and the experts allow, and every context-parallel degree of --sweep_cp that
divides the shard ranks (by default 1, 2, 4, 8 and 16 from seq_len 32,768 on, else none), at 8, 64,
512 and 4096 GPUs (or --sweep_sizes), holding the global batch (training.global_batch_size, or
local_batch_size x GPUs) with no accumulation, then which layout wins at each size, whether TP, PP,
EP and CP win, and why. Every layout gets its step time and memory floor (arithmetic,
milliseconds); memory is simulated (seconds to a minute each) only for the layouts that can still
win, fastest first, until one fits (titanlite.estimate.sweep says why that names the same winner as
simulating them all; --sweep_simulate all simulates every layout under its floor). Progress goes to
stderr. A layout that does not fit is reported as such (exit status 0); bad input is one line on
stderr and exit status 2.
"""

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "estimate"
SWEEP_SIZES = (8, 64, 512, 4096)
SWEEP_PP = "1,2,4,8,16"
SWEEP_SCHEDULES = "1F1B,Interleaved1F1B"
SWEEP_EP = "1,2,4,8,16,32,64"
SWEEP_CP = "1,2,4,8,16"
LONG_CONTEXT = 32768  # from this seq_len on, the sweep tries context parallelism unless told
SWEEP_SIMULATE = ("needed", "all")
GIB = 2**30
WIDTH = 100  # columns of the report


def _options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The estimator's own options; everything else is left for the config parser."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--world_size", type=int, default=None, help="GPUs in the run")
    parser.add_argument("--nodes", type=int, default=None, help="nodes in the run (x GPUs per node)")
    parser.add_argument("--hardware", default="h100", help="GPU kind: h100, h200, a100, b200, mi300x, l40s")
    parser.add_argument("--peak_tflops", type=float, default=None, help="override: dense bf16 peak TFLOP/s per GPU")
    parser.add_argument("--memory_gib", type=float, default=None, help="override: GPU memory in GiB")
    parser.add_argument(
        "--intra_node_gbps", type=float, default=None, help="override: GB/s per GPU, per direction, in a node"
    )
    parser.add_argument(
        "--inter_node_gbps", type=float, default=None, help="override: GB/s per GPU, per direction, across nodes"
    )
    parser.add_argument("--gpus_per_node", type=int, default=None, help="override: GPUs per node")
    parser.add_argument(
        "--efficiency", type=float, default=None, help="share of peak FLOPs the kernels reach (default 0.5)"
    )
    parser.add_argument(
        "--reserve_gib",
        type=float,
        default=2.0,
        help="memory kept aside for the CUDA context, library workspaces and NCCL (default 2)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="FSDP and HSDP with each TP degree at 8, 64, 512 and 4096 GPUs"
    )
    parser.add_argument("--sweep_sizes", default=None, help="the sweep's GPU counts, comma-separated (e.g. 8,64)")
    parser.add_argument(
        "--sweep_pp", default=SWEEP_PP, help=f"the sweep's pipeline degrees, comma-separated (default {SWEEP_PP})"
    )
    parser.add_argument(
        "--sweep_schedules",
        default=SWEEP_SCHEDULES,
        help=f"the sweep's pipeline schedules, comma-separated (default {SWEEP_SCHEDULES})",
    )
    parser.add_argument(
        "--sweep_ep",
        default=SWEEP_EP,
        help=f"the sweep's expert-parallel degrees for an MoE model, comma-separated (default {SWEEP_EP})",
    )
    parser.add_argument(
        "--sweep_cp",
        default=None,
        help=f"the sweep's context-parallel degrees, comma-separated (default {SWEEP_CP} from seq_len "
        f"{LONG_CONTEXT:,} on, else 1)",
    )
    parser.add_argument(
        "--sweep_simulate",
        default="needed",
        help="the sweep's memory simulations: 'needed' (default) only the layouts that can still win, "
        "'all' every layout under its memory floor (minutes each for a large model)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--skip_memory", action="store_true", help="step time only (no memory simulation)")
    parser.add_argument("-h", "--help", action="store_true")
    options, rest = parser.parse_known_args(argv)
    if options.help:
        print(__doc__)
        parser.print_help()
        raise SystemExit(0)
    return options, rest


def _hardware(options):
    from titanlite.estimate import get_hardware

    overrides = {
        "peak_flops": None if options.peak_tflops is None else options.peak_tflops * 1e12,
        "memory_bytes": None if options.memory_gib is None else int(options.memory_gib * GIB),
        "intra_node_bw": None if options.intra_node_gbps is None else options.intra_node_gbps * 1e9,
        "inter_node_bw": None if options.inter_node_gbps is None else options.inter_node_gbps * 1e9,
        "gpus_per_node": options.gpus_per_node,
    }
    return get_hardware(options.hardware, **overrides)


def _world_size(options, hardware) -> int:
    if options.world_size is not None and options.world_size < 1:
        raise ValueError(f"--world_size {options.world_size}: must be at least 1")
    if options.nodes is not None and options.nodes < 1:
        raise ValueError(f"--nodes {options.nodes}: must be at least 1")
    by_nodes = None if options.nodes is None else options.nodes * hardware.gpus_per_node
    if options.world_size is not None and by_nodes is not None and options.world_size != by_nodes:
        raise ValueError(
            f"--world_size {options.world_size} does not equal --nodes {options.nodes} x "
            f"{hardware.gpus_per_node} GPUs per node = {by_nodes}"
        )
    return options.world_size or by_nodes or hardware.gpus_per_node


def estimate_one(job_config, world_size: int, hardware, options) -> dict:
    """Memory and step time of one layout, as a JSON-ready dict (titanlite.estimate.results)."""
    from titanlite.estimate import DEFAULT_EFFICIENCY, estimate_memory
    from titanlite.estimate.results import layout_result, memory_result

    efficiency = DEFAULT_EFFICIENCY if options.efficiency is None else options.efficiency
    reserve = int(options.reserve_gib * GIB)
    result = layout_result(job_config, world_size, hardware, efficiency, reserve)
    if not options.skip_memory:
        result["memory"] = memory_result(estimate_memory(job_config, world_size), hardware, reserve)
    return result


def _collective_line(label: str, timing: dict, key: str, link: str) -> str:
    """One collective's line of the step-time report: its time, its bytes and the link it uses."""
    seconds, size = timing[f"{key}_s"], timing[f"{key}_bytes"]
    return f"  {label:<14} {seconds * 1e3:10.1f} ms  ({size / 1e9:.2f} GB, {timing[link]})"


def _report(result: dict, describe_model: str) -> str:
    layout, timing, memory = result["layout"], result["step_time"], result.get("memory")
    tp = f" x tp {layout['tp']}" if layout["tp"] > 1 else ""
    tp = (f" x cp {layout['cp']}" if "cp" in layout else "") + tp
    pp = (
        f"pp {layout['pp']} ({layout['schedule']}, {layout['microbatches']} micro-batches) x " if "pp" in layout else ""
    )
    lines = [
        f"{describe_model} on {layout['world_size']} x {layout['hardware']}",
        f"layout: {layout['strategy']}, {pp}{layout['dp_replicate']} replica(s) x {layout['dp_shard']} shard(s){tp}",
        "",
    ]
    if memory is not None:
        peak = memory["by_category_at_peak"]
        lines.append("memory per GPU (rank 0, at the step's peak)      GiB")
        for name, value in peak.items():
            if name != "total":
                lines.append(f"  {name.replace('_', ' '):<44} {value / GIB:8.2f}")
        verdict = "fits" if memory["fits"] else "DOES NOT FIT"
        lines.append(f"  {'peak (allocated)':<44} {memory['peak_bytes'] / GIB:8.2f}")
        lines.append(f"  {'reserved by the caching allocator at the peak':<44} {memory['reserved_bytes'] / GIB:8.2f}")
        lines.append(
            f"  {verdict} in {memory['device_bytes'] / GIB:.0f} GiB keeping {memory['reserve_bytes'] / GIB:.1f} "
            f"aside: headroom {memory['headroom_bytes'] / GIB:.2f} GiB"
        )
        lines.append(
            f"  sharded state, GiB: parameters {memory['parameters'] / GIB:.2f}, gradients "
            f"{memory['gradients'] / GIB:.2f}, optimizer {memory['optimizer_state'] / GIB:.2f} (bytes / (shards x tp))"
        )
        for rank in memory.get("per_pp_rank", []):
            lines.append(
                f"  pp rank {rank['pp_rank']} (stage {', '.join(map(str, rank['stages']))}): peak "
                f"{rank['peak_bytes'] / GIB:.2f} GiB, {rank['in_flight_microbatches']} micro-batch(es) in flight "
                f"x {rank['microbatch_activations'] / GIB:.2f} GiB"
            )
        lines.extend(f"  note: {note}" for note in memory["notes"])
        lines.append("")
    threshold = timing["threshold_tokens_per_device"]
    lines += [
        "step time (analytic)",
        f"  compute        {timing['compute_s'] * 1e3:10.1f} ms  "
        f"({timing['tokens_per_device_per_step']:,.0f} tokens/device, {timing['efficiency']:.0%} of peak)",
        _collective_line("all-gather", timing, "all_gather", "shard_link"),
        _collective_line("reduce-scatter", timing, "reduce_scatter", "shard_link"),
        _collective_line("all-reduce", timing, "all_reduce", "replicate_link"),
        _collective_line("TP", timing, "tp", "tp_link"),
        *([_collective_line(f"all-to-all EP {timing['ep']}", timing, "ep", "ep_link")] if timing["ep"] > 1 else []),
        *(
            [
                _collective_line(f"K/V CP {timing['cp']}", timing, "cp", "cp_link")
                + f", {timing['cp_hidden_s'] * 1e3:.1f} ms behind attention on own keys"
            ]
            if timing["cp"] > 1
            else []
        ),
        *(
            [
                _collective_line("pipeline", timing, "pp", "pp_link")
                + f", bubble {timing['bubble']:.1%}, {timing['pp_exposed_s'] * 1e3:.1f} ms exposed"
            ]
            if timing["pp"] > 1
            else []
        ),
        f"  step           {timing['step_s'] * 1e3:10.1f} ms  "
        f"-> {timing['tokens_per_second_per_device']:,.0f} tokens/s/device, MFU {timing['mfu_percent']:.1f}%",
        f"  verdict: {timing['verdict']} "
        f"({timing['tokens_per_device_per_micro_batch']:,.0f} tokens/device per micro-batch; "
        f"threshold C/W = {'n/a' if threshold is None else f'{threshold:,.0f}'}, break-even here "
        f"{timing['break_even_tokens_per_device']:,.0f})",
    ]
    return "\n".join(_wrapped(line) for line in lines)


def _wrapped(line: str) -> str:
    """A report line broken to fit WIDTH columns, its continuation lines indented under it."""
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=indent)) if len(line) > WIDTH else line


def _positive_ints(option: str, text: str, what: str) -> list[int]:
    """A comma-separated list of positive integers, or one ValueError line naming the option."""
    try:
        values = [int(value) for value in text.split(",") if value.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected {what}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} {text!r}: expected positive {what.split(' like ')[0]}")
    return values


def _sweep_sizes(options) -> list[int]:
    if options.sweep_sizes is None:
        return list(SWEEP_SIZES)
    return _positive_ints("--sweep_sizes", options.sweep_sizes, "GPU counts like 8,64")


def _sweep_pipelines(options) -> list[tuple[int, str | None]]:
    """(pp degree, schedule) pairs the sweep tries: no pipeline (always: the layouts PP is
    measured against), then each degree above 1 of --sweep_pp with each schedule of
    --sweep_schedules."""
    from titanlite.config.parallelism import PIPELINE_SCHEDULES, canonical_schedule

    degrees = _positive_ints("--sweep_pp", options.sweep_pp, "pipeline degrees like 1,2,4,8")
    schedules = []
    for name in (name.strip() for name in options.sweep_schedules.split(",") if name.strip()):
        if canonical_schedule(name) is None:
            raise ValueError(
                f"--sweep_schedules: unknown schedule {name!r} (choose from {', '.join(PIPELINE_SCHEDULES)})"
            )
        schedules.append(canonical_schedule(name))
    if not schedules and max(degrees) > 1:
        raise ValueError("--sweep_schedules is empty: name at least one schedule (e.g. 1F1B)")
    return [(1, None)] + [(pp, schedule) for pp in sorted(set(degrees) - {1}) for schedule in schedules]


def _sweep_cp(options, seq_len: int) -> list[int]:
    """--sweep_cp's degrees; by default 1 alone below LONG_CONTEXT tokens, SWEEP_CP from there."""
    text = options.sweep_cp or (SWEEP_CP if seq_len >= LONG_CONTEXT else "1")
    return _positive_ints("--sweep_cp", text, "context-parallel degrees like 1,2,4,8")


def sweep(job_config, hardware, options) -> tuple[list[dict], list[str]]:
    """The sweep's results and "skipped" lines (titanlite.estimate.sweep), its progress on
    stderr."""
    from titanlite.estimate import DEFAULT_EFFICIENCY
    from titanlite.estimate.sweep import SweepSettings
    from titanlite.estimate.sweep import sweep as run_sweep

    if options.sweep_simulate not in SWEEP_SIMULATE:
        raise ValueError(f"--sweep_simulate {options.sweep_simulate!r}: expected {' or '.join(SWEEP_SIMULATE)}")
    settings = SweepSettings(
        sizes=tuple(_sweep_sizes(options)),
        pipelines=tuple(_sweep_pipelines(options)),
        ep_degrees=tuple(_positive_ints("--sweep_ep", options.sweep_ep, "expert-parallel degrees like 1,2,4,8")),
        efficiency=DEFAULT_EFFICIENCY if options.efficiency is None else options.efficiency,
        reserve_bytes=int(options.reserve_gib * GIB),
        simulate="none" if options.skip_memory else options.sweep_simulate,
        cp_degrees=tuple(_sweep_cp(options, job_config.training.seq_len)),
    )
    progress = ProgressLine(sys.stderr)
    try:
        return run_sweep(job_config, hardware, settings, progress)
    finally:
        progress.close()


class ProgressLine:
    """The sweep's progress on ``stream``: one line rewritten in place on a terminal; else a
    line per memory simulation (each takes seconds to minutes) and the first and last of the
    step-time estimates (each takes milliseconds)."""

    def __init__(self, stream):
        self.stream, self.start, self.open = stream, time.perf_counter(), False
        self.in_place = stream.isatty()

    def __call__(self, what: str, done: int, total: int, detail: str) -> None:
        seconds = int(time.perf_counter() - self.start)
        of = f"{done}/{total}" if what != "simulating memory" else f"{done} of at most {total}"
        line = f"[{seconds // 60}:{seconds % 60:02d}] {what} {of}: {detail}"
        if self.in_place:
            self.stream.write(f"\r{line[:99]}\x1b[K")
            self.open = True
        elif what == "simulating memory" or done in (1, total):
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.open:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def run(argv: list[str]) -> int:
    options, config_argv = _options(argv)
    from titanlite.config import ConfigError, parse_args

    job_config = parse_args(config_argv)
    from titanlite.plan import tokenizer_for_estimate

    _, vocabulary_note = tokenizer_for_estimate(job_config)
    if vocabulary_note is not None:
        print(f"titanlite: warning: {vocabulary_note}", file=sys.stderr)
    hardware = _hardware(options)
    model = (
        f"{job_config.model.name} {job_config.model.flavor}, seq_len {job_config.training.seq_len}, "
        f"local batch {job_config.training.local_batch_size}"
    )
    if options.sweep:
        from titanlite.estimate.sweep_report import sweep_table, sweep_verdicts

        results, skipped = sweep(job_config, hardware, options)
        if options.json:
            print(json.dumps(results, indent=2))
        else:
            global_batch = job_config.training.global_batch_size
            held = "local batch x GPUs" if global_batch == -1 else f"{global_batch} sequences"
            print(f"{model} on {hardware.name}; global batch held at {held}, no accumulation")
            print("\n".join([sweep_table(results), *skipped, "", *sweep_verdicts(results)]))
        return 0
    try:
        world_size = _world_size(options, hardware)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    result = estimate_one(job_config, world_size, hardware, options)
    print(json.dumps(result, indent=2) if options.json else _report(result, model))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from titanlite.config import ConfigError

    try:
        return run(argv)
    except (ConfigError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
