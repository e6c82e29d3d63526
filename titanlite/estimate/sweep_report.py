"""The sweep's answers as text: a table of every layout tried (100 columns wide, a legend under
it for its codes) and one verdict per GPU count: which layout wins, whether TP, PP, EP and CP win,
and why (titanlite.estimate.sweep makes the results these read)."""

import textwrap

GIB = 2**30
WIDTH = 100

# (header, width, right-aligned) of each column of the table, in order.
_COLUMNS = (
    ("GPUs", 5, True),
    ("layout", 11, False),
    ("ep", 3, True),
    ("sched", 6, False),
    ("batch", 5, True),
    ("bubble", 6, True),
    ("rsvd GiB", 8, True),
    ("fits", 4, False),
    ("step ms", 7, True),
    ("TP ms", 6, True),
    ("a2a ms", 6, True),
    ("tok/s/GPU", 9, True),
    ("MFU%", 5, True),
    ("bound", 5, False),
)

# What each code of the "fits" column means, in the legend's order.
_FIT_CODES = {
    "NO f": "over its memory floor (what a rank surely holds), so not simulated; its peak is at least the floor",
    "- w": "not simulated: a faster layout fits, so this one cannot win",
    "- s": "not simulated (--skip_memory); its memory floor fits",
}


def throughput(result: dict) -> float:
    return result["step_time"]["tokens_per_second_per_device"]


def fits(result: dict) -> bool | None:
    """Whether the layout fits: its simulated memory says, or its floor when that alone does
    not fit; None for a layout not simulated because a faster one fits (it may or may not).
    With memory skipped (--skip_memory) the floor stands in for the fit."""
    if "memory" in result:
        return result["memory"]["fits"]
    if result.get("not_simulated") == "faster_fits":
        return None
    return "memory_floor" not in result or result["memory_floor"]["fits"]


def _fit_cell(result: dict) -> tuple[str, str]:
    """(reserved GiB, fits) cells of a row: the figure the fit was decided on, what the
    caching allocator reserves at the peak (a floor-only row: at least its floor)."""
    memory = result.get("memory")
    if memory is not None and memory.get("floor_only"):
        return f">{memory['peak_bytes'] / GIB:.1f}", "NO f"
    if memory is not None:
        return f"{memory.get('reserved_bytes', memory['peak_bytes']) / GIB:.2f}", "yes" if memory["fits"] else "NO"
    return "-", "- w" if result.get("not_simulated") == "faster_fits" else "- s"


def _milliseconds(seconds: float) -> str:
    """A time in ms for a table cell: one decimal below 100 ms, whole ms above."""
    return f"{seconds * 1e3:.1f}" if seconds < 0.1 else f"{seconds * 1e3:,.0f}"


def schedule_code(schedule: str | None) -> str:
    """A schedule's name in the table: whole up to 6 characters (GPipe, 1F1B), else its capitals
    and digits (Interleaved1F1B -> I1F1B, ZBVZeroBubble -> ZBVZB); the legend spells them out."""
    if schedule is None:
        return "-"
    return schedule if len(schedule) <= 6 else "".join(c for c in schedule if c.isupper() or c.isdigit())


def _cells(result: dict) -> tuple:
    layout, timing = result["layout"], result["step_time"]
    peak, fit = _fit_cell(result)
    return (
        layout["world_size"],
        f"{layout.get('pp', 1)}x{layout['dp_replicate']}x{layout['dp_shard']}x{layout['tp']}"
        + (f"c{layout['cp']}" if "cp" in layout else ""),
        layout.get("ep", 1),
        schedule_code(layout.get("schedule")),
        layout["local_batch_size"],
        f"{timing['bubble']:.1%}",
        peak,
        fit,
        _milliseconds(timing["step_s"]),
        _milliseconds(timing["tp_s"]),
        _milliseconds(timing["ep_s"]),
        f"{timing['tokens_per_second_per_device']:,.0f}",
        f"{timing['mfu_percent']:.1f}",
        "comp" if timing["verdict"] == "compute-bound" else "comm",
    )


def _row(cells) -> str:
    return " ".join(
        f"{cell:>{width}}" if right else f"{cell:<{width}}"
        for cell, (_, width, right) in zip(cells, _COLUMNS, strict=True)
    ).rstrip()


def sweep_table(results: list[dict]) -> str:
    """Every layout tried, one row each, then the legend of the codes the rows use."""
    rows = [_row(header for header, _, _ in _COLUMNS), *(_row(_cells(result)) for result in results)]
    return "\n".join(rows + _legend(results))


def _legend(results: list[dict]) -> list[str]:
    fit_codes = {_fit_cell(result)[1] for result in results}
    schedules = {result["layout"].get("schedule") for result in results} - {None}
    context_parallel = any("cp" in result["layout"] for result in results)
    parts = [
        "layout: pp x replicas x shards x TP degree"
        + (", cN: each sequence split over N context-parallel GPUs" if context_parallel else ""),
        "batch: sequences per data-parallel rank",
        "bound: compute- or communication-bound",
        "rsvd GiB: what the caching allocator reserves at the simulated peak, what fits compares with the GPU",
        "fits: yes / NO as simulated",
        *(f"{code}: {meaning}" for code, meaning in _FIT_CODES.items() if code in fit_codes),
        *(f"{schedule_code(name)}: {name}" for name in sorted(schedules) if schedule_code(name) != name),
    ]
    return textwrap.wrap("; ".join(parts), WIDTH, subsequent_indent="  ")


def layout_name(layout: dict) -> str:
    degrees = f"{layout['dp_replicate']}x{layout['dp_shard']}x{layout['tp']}"
    if layout.get("ep", 1) > 1:
        degrees += f" ep {layout['ep']}"
    if layout.get("cp", 1) > 1:
        degrees += f" cp {layout['cp']}"
    if layout.get("pp", 1) > 1:
        return f"{layout['strategy']} {layout['pp']}x{degrees} {layout['schedule']}"
    return f"{layout['strategy']} {degrees}"


def _named(result: dict) -> str:
    """The layout's name in a verdict, saying so when its memory was not simulated."""
    return layout_name(result["layout"]) + (" (memory not simulated)" if fits(result) is None else "")


def _data_parallel_seconds(timing: dict) -> float:
    return timing["all_gather_s"] + timing["reduce_scatter_s"] + timing["all_reduce_s"]


def _degree(result: dict, dim: str) -> int:
    """The layout's degree of "tp", "pp", "ep" or "cp" (1 where the layout has none)."""
    return result["layout"].get(dim, 1)


def _experts_whole_under_tp(result: dict) -> bool:
    """Whether every TP rank of the layout holds an MoE model's experts (TP without EP)."""
    timing = result["step_time"]
    return timing["moe_tokens_per_device_per_micro_batch"] > 0 and timing["ep"] == 1


# Per dimension: its name in the verdicts, how it cuts the data-parallel traffic, and what it
# costs when it loses.
_DIMENSIONS = {
    "tp": (
        "TP",
        lambda result: (
            f"TP {_degree(result, 'tp')} divides the bytes each GPU gathers and reduces by the TP degree"
            # an MoE model's experts TP holds whole, unless EP (over the TP ranks) splits them
            + (" (the dense weights': TP holds the experts whole)" if _experts_whole_under_tp(result) else "")
        ),
        lambda timing: f"its collectives adding {timing['tp_s'] * 1e3:,.0f} ms a step over {timing['tp_link']}",
    ),
    "pp": (
        "PP",
        lambda result: f"PP {_degree(result, 'pp')} leaves each GPU only its stages' weights to gather and reduce",
        lambda timing: (
            f"its pipeline bubble idling {timing['bubble']:.0%} of its step ({timing['microbatches']} micro-batches)"
        ),
    ),
    "ep": (
        "EP",
        lambda result: (
            f"EP {_degree(result, 'ep')} leaves each GPU 1/{_degree(result, 'ep')} of the experts to gather and reduce"
        ),
        lambda timing: f"its all-to-alls adding {timing['ep_s'] * 1e3:,.0f} ms a step over {timing['ep_link']}",
    ),
    "cp": (
        "CP",
        lambda result: f"CP {_degree(result, 'cp')} gives each GPU 1/{_degree(result, 'cp')} of every sequence",
        lambda timing: (
            f"its key/value all-gathers adding {(timing['cp_s'] - timing['cp_hidden_s']) * 1e3:,.0f} ms a step over "
            f"{timing['cp_link']} ({timing['cp_hidden_s'] * 1e3:,.0f} ms more hidden behind attention)"
        ),
    ),
}


def _why_it_wins(dim: str, winner: dict, without: list[dict], tried_without: list[dict]) -> str:
    """Why the winning layout with TP (or PP, EP) beats every layout without it, in one clause."""
    label, helps, _ = _DIMENSIONS[dim]
    if not without:
        if not tried_without:
            return f"no layout without {label} has a sequence per data-parallel rank"
        smallest = min(tried_without, key=lambda r: r["memory"]["peak_bytes"])
        memory = smallest["memory"]
        at_least = "at least " if memory.get("floor_only") else ""
        return (
            f"no layout without {label} fits in memory (the smallest peak, {layout_name(smallest['layout'])}, "
            f"is {at_least}{memory['peak_bytes'] / GIB:.1f} GiB of {memory['device_bytes'] / GIB:.0f})"
        )
    best = max(without, key=throughput)
    gain = throughput(winner) / throughput(best) - 1
    timing = best["step_time"]
    if _data_parallel_seconds(timing) > timing["compute_s"]:
        return (
            f"{gain:+.0%} over the best without {label}, {_named(best)}, whose data-parallel "
            f"collectives ({_data_parallel_seconds(timing) * 1e3:,.0f} ms over {timing['shard_link']}) exceed its "
            f"compute ({timing['compute_s'] * 1e3:,.0f} ms); {helps(winner)}"
        )
    return f"{gain:+.0%} over the best without {label}, {_named(best)}"


def _dimension_clause(dim: str, winner: dict, tried: list[dict], may_fit: list[dict]) -> str:
    """ "; TP wins: why" or "; TP does not: ..." (or PP, EP), or nothing when no layout has it.
    ``may_fit``: the layouts that fit or were not simulated (a faster one fits)."""
    label, _, cost = _DIMENSIONS[dim]
    if _degree(winner, dim) > 1:
        without = [r for r in may_fit if _degree(r, dim) == 1]
        tried_without = [r for r in tried if _degree(r, dim) == 1]
        return f"; {label} wins: " + _why_it_wins(dim, winner, without, tried_without)
    with_it = [r for r in may_fit if _degree(r, dim) > 1]
    if not with_it:
        return ""
    best = max(with_it, key=throughput)
    return (
        f"; {label} does not: the best with {label}, {_named(best)}, reaches "
        f"{throughput(best):,.0f} ({throughput(best) / throughput(winner) - 1:+.0%}), {cost(best['step_time'])}"
    )


def sweep_verdicts(results: list[dict]) -> list[str]:
    """One line per world size: which layout wins (the most tokens/s per GPU among those that
    fit, the first of equals), whether TP, PP and EP win, and why. A comparison may name a
    layout whose memory was not simulated (a faster one fits): it says so."""
    lines = []
    for world_size in dict.fromkeys(r["layout"]["world_size"] for r in results):
        tried = [r for r in results if r["layout"]["world_size"] == world_size]
        fitting = [r for r in tried if fits(r)]
        if not fitting:
            lines.append(f"{world_size} GPUs: no layout fits")
            continue
        winner = max(fitting, key=throughput)
        may_fit = [r for r in tried if fits(r) is not False]
        line = (
            f"{world_size} GPUs: {layout_name(winner['layout'])} wins, {throughput(winner):,.0f} tokens/s/GPU "
            f"(MFU {winner['step_time']['mfu_percent']:.1f}%)"
        )
        lines.append(line + "".join(_dimension_clause(dim, winner, tried, may_fit) for dim in _DIMENSIONS))
    return lines
