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

The world size is --world_size, or --nodes x GPUs per node, or one node. --sweep prints
FSDP and HSDP (one shard group per node), each with every TP degree the model and the node
allow and every pipeline degree of --sweep_pp (1, 2, 4, 8, 16) with each schedule of
--sweep_schedules (1F1B, Interleaved1F1B) and, for an MoE model, every expert-parallel degree
of --sweep_ep that the layout's shard degree and the experts allow, at 8, 64, 512 and 4096 GPUs
(or --sweep_sizes), holding the global batch (training.global_batch_size, or local_batch_size x
GPUs) with no accumulation, then which layout wins at each size, whether TP, PP and EP win, and
why.
A layout that does not fit is reported as such (exit status 0); bad input is one line on
stderr and exit status 2.
"""

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "estimate"
SWEEP_SIZES = (8, 64, 512, 4096)
SWEEP_PP = "1,2,4,8,16"
SWEEP_SCHEDULES = "1F1B,Interleaved1F1B"
SWEEP_EP = "1,2,4,8,16,32,64"
GIB = 2**30


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
        help="memory kept aside for the CUDA context, NCCL and fragmentation (default 2)",
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


def _with_layout(
    job_config,
    replicate: int,
    shard: int,
    tp: int,
    local_batch_size: int,
    pp: int = 1,
    schedule: str | None = None,
    ep: int = 1,
):
    """A copy of the config with this layout (and pipeline schedule) and local batch, and no
    accumulation."""
    changed = copy.deepcopy(job_config)
    changed.parallelism.expert_parallel_degree = ep
    changed.parallelism.data_parallel_replicate_degree = replicate
    changed.parallelism.data_parallel_shard_degree = shard
    changed.parallelism.tensor_parallel_degree = tp
    changed.parallelism.pipeline_parallel_degree = pp
    if schedule is not None:
        changed.parallelism.pipeline_parallel_schedule = schedule
    changed.training.local_batch_size = local_batch_size
    changed.training.global_batch_size = -1
    return changed


def estimate_one(
    job_config, world_size: int, hardware, options, memory_cache: dict | None = None, screen: bool = False
) -> dict:
    """Memory and step time of one layout, as a JSON-ready dict. ``screen``: a layout whose
    floor does not fit is not simulated (its memory is the floor, marked "floor_only")."""
    from titanlite.estimate import DEFAULT_EFFICIENCY, estimate_for_job_config, estimate_memory, fits

    efficiency = DEFAULT_EFFICIENCY if options.efficiency is None else options.efficiency
    timing = estimate_for_job_config(job_config, world_size, hardware, efficiency=efficiency)
    result = {
        "layout": {
            "strategy": timing.strategy,
            "world_size": world_size,
            "dp_replicate": timing.dp_replicate,
            "dp_shard": timing.dp_shard,
            "tp": timing.tp,
            "local_batch_size": job_config.training.local_batch_size,
            "hardware": hardware.name,
            **(
                {"pp": timing.pp, "schedule": timing.schedule, "microbatches": timing.microbatches}
                if timing.pp > 1
                else {}
            ),
            **({"ep": timing.ep} if timing.ep > 1 else {}),
        },
        "step_time": {k: v for k, v in dataclasses.asdict(timing).items() if k != "hardware"},
    }
    floor_bytes = _floor_bytes(job_config, world_size)
    reserve = int(options.reserve_gib * GIB)
    result["memory_floor"] = {"bytes": floor_bytes, "fits": floor_bytes + reserve <= hardware.memory_bytes}
    if options.skip_memory:
        return result
    if screen and not result["memory_floor"]["fits"]:  # surely too big: not worth a simulation
        result["memory"] = {
            "peak_bytes": floor_bytes,
            "floor_only": True,
            "device_bytes": hardware.memory_bytes,
            "reserve_bytes": reserve,
            "fits": False,
            "headroom_bytes": hardware.memory_bytes - reserve - floor_bytes,
        }
        return result
    # Per-rank memory depends on the shard and TP degrees and the batch, not on how many
    # replicas there are.
    key = (
        timing.dp_shard,
        timing.tp,
        timing.dp_replicate > 1,
        job_config.training.local_batch_size,
        timing.pp,
        timing.schedule,
        timing.ep,
    )
    memory = None if memory_cache is None else memory_cache.get(key)
    if memory is None:
        memory = estimate_memory(job_config, world_size)
        if memory_cache is not None:
            memory_cache[key] = memory
    fit, headroom = fits(memory, hardware.memory_bytes, int(options.reserve_gib * GIB))
    result["memory"] = {
        "peak_bytes": memory.peak_bytes,
        "by_category_at_peak": memory.peak,
        "largest_activations": memory.activations,
        "parameters": memory.exact.parameters,
        "gradients": memory.exact.gradients,
        "optimizer_state": memory.exact.optimizer_state,
        "device_bytes": hardware.memory_bytes,
        "reserve_bytes": int(options.reserve_gib * GIB),
        "fits": fit,
        "headroom_bytes": headroom,
        "notes": memory.notes,
    }
    if memory.pipeline:
        result["memory"]["per_pp_rank"] = [
            {
                "pp_rank": rank.pp_rank,
                "stages": list(rank.stages),
                "peak_bytes": rank.peak_bytes,
                "in_flight_microbatches": rank.in_flight,
                "microbatch_activations": rank.microbatch_activations,
            }
            for rank in memory.pipeline
        ]
    return result


def _floor_bytes(job_config, world_size: int) -> int:
    """The trainer's own floor (estimate.floor) for this layout's fullest rank: what it surely
    holds, by arithmetic, in no time."""
    from titanlite.estimate.floor import fullest_floor
    from titanlite.plan import plan_run, tokenizer_for_estimate

    plan = plan_run(job_config, world_size, tokenizer_for_estimate(job_config)[0])
    return sum(fullest_floor(job_config, plan)[1].values())


def _collective_line(label: str, timing: dict, key: str, link: str) -> str:
    """One collective's line of the step-time report: its time, its bytes and the link it uses."""
    seconds, size = timing[f"{key}_s"], timing[f"{key}_bytes"]
    return f"  {label:<14} {seconds * 1e3:10.1f} ms  ({size / 1e9:.2f} GB, {timing[link]})"


def _report(result: dict, describe_model: str) -> str:
    layout, timing, memory = result["layout"], result["step_time"], result.get("memory")
    tp = f" x tp {layout['tp']}" if layout["tp"] > 1 else ""
    pp = (
        f"pp {layout['pp']} ({layout['schedule']}, {layout['microbatches']} micro-batches) x " if "pp" in layout else ""
    )
    lines = [
        f"{describe_model} on {layout['world_size']} x {layout['hardware']}: {layout['strategy']}, "
        f"{pp}{layout['dp_replicate']} replica(s) x {layout['dp_shard']} shard(s){tp}",
        "",
    ]
    if memory is not None:
        peak = memory["by_category_at_peak"]
        lines.append("memory per GPU (rank 0, at the step's peak)      GiB")
        for name, value in peak.items():
            if name != "total":
                lines.append(f"  {name.replace('_', ' '):<44} {value / GIB:8.2f}")
        verdict = "fits" if memory["fits"] else "DOES NOT FIT"
        lines.append(
            f"  {'peak':<44} {memory['peak_bytes'] / GIB:8.2f}   of {memory['device_bytes'] / GIB:.0f} "
            f"(keeping {memory['reserve_bytes'] / GIB:.1f} aside): {verdict}, headroom "
            f"{memory['headroom_bytes'] / GIB:.2f} GiB"
        )
        lines.append(
            f"  sharded parameters / gradients / optimizer state: {memory['parameters'] / GIB:.2f} / "
            f"{memory['gradients'] / GIB:.2f} / {memory['optimizer_state'] / GIB:.2f} GiB "
            "(params x bytes / (shards x tp))"
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
        f"({timing['tokens_per_device_per_step']:,.0f} tokens/device, {timing['efficiency']:.0%} of peak"
        f"{_redundant_clause(timing)})",
        _collective_line("all-gather", timing, "all_gather", "shard_link"),
        _collective_line("reduce-scatter", timing, "reduce_scatter", "shard_link"),
        _collective_line("all-reduce", timing, "all_reduce", "replicate_link"),
        _collective_line("TP", timing, "tp", "tp_link"),
        *([_collective_line(f"all-to-all EP {timing['ep']}", timing, "ep", "ep_link")] if timing["ep"] > 1 else []),
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
    return "\n".join(lines)


def _redundant_clause(timing: dict) -> str:
    """The MoE work TP repeats on every rank of a group (not in MFU), or nothing."""
    if not timing["redundant_compute_s"]:
        return ""
    return f"; {timing['redundant_compute_s'] * 1e3:.1f} ms repeating the MoE layers on every TP rank"


def _layout_name(layout: dict) -> str:
    degrees = f"{layout['dp_replicate']}x{layout['dp_shard']}x{layout['tp']}"
    if layout.get("ep", 1) > 1:
        degrees += f" ep {layout['ep']}"
    if layout.get("pp", 1) > 1:
        return f"{layout['strategy']} {layout['pp']}x{degrees} {layout['schedule']}"
    return f"{layout['strategy']} {degrees}"


def _sweep_rows(results: list[dict]) -> str:
    header = (
        f"{'GPUs':>5} {'layout':<20} {'pp x repl x shard x tp':>22} {'ep':>3} {'schedule':<15} {'batch':>5} "
        f"{'bubble':>6} {'peak GiB':>9} {'fits':>5} {'step ms':>9} {'TP ms':>7} {'a2a ms':>7} {'tok/s/GPU':>10} "
        f"{'MFU %':>6}  verdict"
    )
    rows = [header]
    for r in results:
        layout, timing, memory = r["layout"], r["step_time"], r.get("memory")
        if memory is None:  # the floor only: a layout that surely does not fit says so
            peak, fit = "-", "-" if _fits(r) else "NO"
        else:
            more = ">" if memory.get("floor_only") else ""
            peak, fit = f"{more}{memory['peak_bytes'] / GIB:.2f}", "yes" if memory["fits"] else "NO"
        degrees = f"{layout.get('pp', 1)} x {layout['dp_replicate']} x {layout['dp_shard']} x {layout['tp']}"
        rows.append(
            f"{layout['world_size']:>5} {layout['strategy']:<20} {degrees:>22} {layout.get('ep', 1):>3} "
            f"{layout.get('schedule') or '-':<15} {layout['local_batch_size']:>5} {timing['bubble']:>6.1%} {peak:>9} "
            f"{fit:>5} {timing['step_s'] * 1e3:>9.1f} {timing['tp_s'] * 1e3:>7.1f} {timing['ep_s'] * 1e3:>7.1f} "
            f"{timing['tokens_per_second_per_device']:>10,.0f} {timing['mfu_percent']:>6.1f}  {timing['verdict']}"
        )
    return "\n".join(rows)


def _throughput(result: dict) -> float:
    return result["step_time"]["tokens_per_second_per_device"]


def _fits(result: dict) -> bool:
    """Whether the layout fits; with memory skipped, whether its floor fits."""
    if "memory" in result:
        return result["memory"]["fits"]
    return "memory_floor" not in result or result["memory_floor"]["fits"]


def _data_parallel_seconds(timing: dict) -> float:
    return timing["all_gather_s"] + timing["reduce_scatter_s"] + timing["all_reduce_s"]


def _degree(result: dict, dim: str) -> int:
    """The layout's degree of "tp", "pp" or "ep" (1 where the layout has none)."""
    return result["layout"].get(dim, 1)


# Per dimension: its name in the verdicts, how it cuts the data-parallel traffic, and what it
# costs when it loses.
_DIMENSIONS = {
    "tp": (
        "TP",
        lambda result: (
            f"TP {_degree(result, 'tp')} divides the bytes each GPU gathers and reduces by the TP degree"
            # only an MoE model's TP ranks repeat work: the MoE layers, whose experts TP holds whole
            + (" (the dense weights': TP holds the experts whole)" if _moe_under_tp(result) else "")
        ),
        lambda timing: f"its collectives adding {timing['tp_s'] * 1e3:,.0f} ms a step over {timing['tp_link']}",
    ),
    "pp": (
        "PP",
        lambda result: f"PP {_degree(result, 'pp')} leaves each GPU only its stages' weights to gather and reduce",
        lambda timing: (
            f"its pipeline bubble idling {timing['bubble']:.0%} of its compute ({timing['microbatches']} micro-batches)"
        ),
    ),
    "ep": (
        "EP",
        lambda result: (
            f"EP {_degree(result, 'ep')} leaves each GPU 1/{_degree(result, 'ep')} of the experts to gather and reduce"
        ),
        lambda timing: f"its all-to-alls adding {timing['ep_s'] * 1e3:,.0f} ms a step over {timing['ep_link']}",
    ),
}


def _moe_under_tp(result: dict) -> bool:
    return result["step_time"]["redundant_compute_s"] > 0


def _why_it_wins(dim: str, winner: dict, without: list[dict], tried_without: list[dict]) -> str:
    """Why the winning layout with TP (or PP) beats every layout without it, in one clause."""
    label, helps, _ = _DIMENSIONS[dim]
    if not without:
        if not tried_without:
            return f"no layout without {label} has a sequence per data-parallel rank"
        smallest = min(tried_without, key=lambda r: r["memory"]["peak_bytes"])
        return (
            f"no layout without {label} fits in memory (the smallest peak, {_layout_name(smallest['layout'])}, "
            f"is {smallest['memory']['peak_bytes'] / GIB:.1f} GiB of {smallest['memory']['device_bytes'] / GIB:.0f})"
        )
    best = max(without, key=_throughput)
    gain = _throughput(winner) / _throughput(best) - 1
    timing = best["step_time"]
    if _data_parallel_seconds(timing) > timing["compute_s"]:
        return (
            f"{gain:+.0%} over the best without {label}, {_layout_name(best['layout'])}, whose data-parallel "
            f"collectives ({_data_parallel_seconds(timing) * 1e3:,.0f} ms over {timing['shard_link']}) exceed its "
            f"compute ({timing['compute_s'] * 1e3:,.0f} ms); {helps(winner)}"
        )
    return f"{gain:+.0%} over the best without {label}, {_layout_name(best['layout'])}"


def _dimension_clause(dim: str, winner: dict, tried: list[dict], fitting: list[dict]) -> str:
    """ "; TP wins: why" or "; TP does not: ..." (or PP), or nothing when no layout has it."""
    label, _, cost = _DIMENSIONS[dim]
    if _degree(winner, dim) > 1:
        without = [r for r in fitting if _degree(r, dim) == 1]
        tried_without = [r for r in tried if _degree(r, dim) == 1]
        return f"; {label} wins: " + _why_it_wins(dim, winner, without, tried_without)
    with_it = [r for r in fitting if _degree(r, dim) > 1]
    if not with_it:
        return ""
    best = max(with_it, key=_throughput)
    return (
        f"; {label} does not: the best with {label}, {_layout_name(best['layout'])}, reaches "
        f"{_throughput(best):,.0f} ({_throughput(best) / _throughput(winner) - 1:+.0%}), {cost(best['step_time'])}"
    )


def _sweep_verdicts(results: list[dict]) -> list[str]:
    """One line per world size: which layout wins (the most tokens/s per GPU among those that
    fit), whether TP and whether PP win, and why."""
    lines = []
    for world_size in dict.fromkeys(r["layout"]["world_size"] for r in results):
        tried = [r for r in results if r["layout"]["world_size"] == world_size]
        fitting = [r for r in tried if _fits(r)]
        if not fitting:
            lines.append(f"{world_size} GPUs: no layout fits")
            continue
        winner = max(fitting, key=_throughput)
        line = (
            f"{world_size} GPUs: {_layout_name(winner['layout'])} wins, {_throughput(winner):,.0f} tokens/s/GPU "
            f"(MFU {winner['step_time']['mfu_percent']:.1f}%)"
        )
        lines.append(line + "".join(_dimension_clause(dim, winner, tried, fitting) for dim in _DIMENSIONS))
    return lines


def _tensor_parallel_degrees(job_config, world_size: int, gpus_per_node: int) -> list[int]:
    """The TP degrees the sweep tries: the divisors of the GPUs per node (a TP group stays in
    one node, where its per-block collectives get the fast link) that divide the world size
    and that the model's TP plan accepts (whole heads and key/value heads, equal FFN slices)."""
    from titanlite.plan import run_model_args, tokenizer_for_estimate
    from titanlite.registry import get_model_spec

    args = run_model_args(job_config, tokenizer_for_estimate(job_config)[0])
    spec = get_model_spec(job_config.model.name)
    return [
        tp
        for tp in range(1, gpus_per_node + 1)
        if gpus_per_node % tp == 0 and world_size % tp == 0 and spec.tensor_parallel_problem(args, tp) is None
    ]


def _sweep_layouts(world_size: int, gpus_per_node: int, tp_degrees: list[int]) -> list[tuple[int, int, int]]:
    """(replicate, shard, tp) for each TP degree: FSDP over all the data-parallel ranks, and,
    beyond one node, HSDP with one shard x TP group per node (the replicas across nodes)."""
    layouts = []
    for tp in tp_degrees:
        layouts.append((1, world_size // tp, tp))
        if world_size > gpus_per_node and world_size % gpus_per_node == 0:
            layouts.append((world_size // gpus_per_node, gpus_per_node // tp, tp))
    return layouts


def _expert_parallel_degrees(job_config, options, shard: int) -> list[int]:
    """The EP degrees the sweep tries for a layout of ``shard`` FSDP ranks: those of --sweep_ep
    that divide the shard degree (whose ranks EP borrows) and the model's experts; 1 alone for a
    dense model."""
    from titanlite.plan import run_model_args, tokenizer_for_estimate

    n_experts = getattr(run_model_args(job_config, tokenizer_for_estimate(job_config)[0]), "n_experts", 0)
    degrees = _positive_ints("--sweep_ep", options.sweep_ep, "expert-parallel degrees like 1,2,4,8")
    if not n_experts:
        return [1]
    return sorted({1} | {ep for ep in degrees if shard % ep == 0 and n_experts % ep == 0})


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


def sweep(job_config, hardware, options) -> tuple[list[dict], list[str]]:
    """Every layout of the sweep that holds the global batch, estimated; and a line for each
    layout left out: its data-parallel ranks do not split the global batch, or its pipeline
    cannot run (too few blocks for the stages, micro-batches that do not fill the rounds)."""
    from titanlite.config import ConfigError

    results, skipped, cache = [], [], {}
    training = job_config.training
    pipelines = _sweep_pipelines(options)
    for world_size in _sweep_sizes(options):
        global_batch = training.global_batch_size
        if global_batch == -1:
            global_batch = training.local_batch_size * world_size
        tp_degrees = _tensor_parallel_degrees(job_config, world_size, hardware.gpus_per_node)
        for pp, schedule in pipelines:
            if world_size % pp:
                continue
            stage_ranks = world_size // pp
            stage_tp = [tp for tp in tp_degrees if stage_ranks % tp == 0]
            for replicate, shard, tp in _sweep_layouts(stage_ranks, hardware.gpus_per_node, stage_tp):
                data_parallel = replicate * shard
                name = (
                    f"{replicate} x {shard} x {tp}" if pp == 1 else f"{pp} x {replicate} x {shard} x {tp} ({schedule})"
                )
                if global_batch % data_parallel:
                    skipped.append(
                        f"skipped {world_size} GPUs {name}: the global batch of {global_batch} "
                        f"sequences does not split over {data_parallel} data-parallel ranks"
                    )
                    continue
                for ep in _expert_parallel_degrees(job_config, options, shard):
                    layout = _with_layout(
                        job_config, replicate, shard, tp, global_batch // data_parallel, pp, schedule, ep
                    )
                    try:
                        results.append(estimate_one(layout, world_size, hardware, options, cache, screen=True))
                    except (ConfigError, ValueError) as error:
                        skipped.append(f"skipped {world_size} GPUs {name}{f' ep {ep}' if ep > 1 else ''}: {error}")
    return results, skipped


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
        results, skipped = sweep(job_config, hardware, options)
        if options.json:
            print(json.dumps(results, indent=2))
        else:
            global_batch = job_config.training.global_batch_size
            held = "local batch x GPUs" if global_batch == -1 else f"{global_batch} sequences"
            print(f"{model} on {hardware.name}; global batch held at {held}, no accumulation")
            print("\n".join([_sweep_rows(results), *skipped, "", *_sweep_verdicts(results)]))
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
