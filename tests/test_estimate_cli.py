"""scripts/estimate.py: the answers a user reads before renting GPUs, and its bad input."""

import io
import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from titanlite.estimate.sweep import SweepCandidate, simulate_where_needed
from titanlite.estimate.sweep_report import WIDTH, fits, layout_name, sweep_table, sweep_verdicts, throughput
from titanlite.models.llama import LLAMA3_FLAVORS, Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEBUG = str(REPO / "train_configs" / "debug_model.toml")


def run_json(capsys, *argv: str) -> dict | list:
    assert estimate.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def one_error_line(capsys, *argv: str) -> str:
    assert estimate.main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("estimate: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def test_the_json_memory_equals_the_arithmetic(capsys):
    # The library's own arithmetic test holds Llama 2 7B on 8 ranks (tests/test_estimate_memory.py);
    # this one holds the command line's JSON to the same rule on the debug model, in seconds.
    result = run_json(capsys, "--job.config_file", DEBUG, "--world_size", "2", "--hardware", "h100")
    with torch.device("meta"):
        params = list(Transformer(LLAMA3_FLAVORS["debugmodel"]).parameters())
    assert all(p.shape[0] % 2 == 0 for p in params)  # FSDP 2 pads nothing
    numel = sum(p.numel() for p in params)
    memory = result["memory"]
    # float32 master weights and gradients, AdamW's two float32 moments, over 2 shards, plus
    # AdamW's float32 step counter per tensor.
    assert memory["parameters"] == numel * 4 // 2
    assert memory["gradients"] == numel * 4 // 2
    assert memory["optimizer_state"] == numel * 8 // 2 + 4 * len(params)
    categories = memory["by_category_at_peak"]
    assert {"parameters", "gradients", "optimizer_state", "activations", "temporary"} <= categories.keys()
    assert categories["activations"] > 0 and memory["peak_bytes"] == categories["total"]
    assert memory["fits"] and memory["device_bytes"] == 80 * 2**30
    assert result["layout"] == {
        "strategy": "FSDP",
        "world_size": 2,
        "dp_replicate": 1,
        "dp_shard": 2,
        "tp": 1,
        "local_batch_size": 8,
        "hardware": "h100",
    }
    assert result["step_time"]["shard_link"] == "intra-node"


def test_the_table_names_every_category(capsys):
    assert estimate.main(["--job.config_file", DEBUG, "--world_size", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("parameters", "gradients", "optimizer state", "activations", "temporary", "peak", "verdict:"):
        assert label in out, out


def test_a_model_that_does_not_fit_is_an_answer(capsys):
    result = run_json(
        capsys, "--job.config_file", DEBUG, "--world_size", "2", "--memory_gib", "0.05", "--reserve_gib", "0"
    )
    assert result["memory"]["fits"] is False and result["memory"]["headroom_bytes"] < 0
    assert estimate.main(["--job.config_file", DEBUG, "--world_size", "2", "--memory_gib", "0.05"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def _layouts(results: list[dict]) -> list[tuple[int, int, int, int]]:
    """(GPUs, replicas, shards, TP degree) of each row of a sweep."""
    return [
        (r["layout"]["world_size"], r["layout"]["dp_replicate"], r["layout"]["dp_shard"], r["layout"]["tp"])
        for r in results
    ]


def test_sweep_covers_fsdp_and_hsdp_with_every_tp_degree(capsys):
    results = run_json(capsys, "--job.config_file", DEBUG, "--sweep", "--skip_memory", "--sweep_pp", "1")
    assert all("pp" not in result["layout"] for result in results)
    layouts = _layouts(results)
    assert [layout[:3] for layout in layouts if layout[3] == 1] == [
        (8, 1, 8),
        (64, 1, 64),
        (64, 8, 8),
        (512, 1, 512),
        (512, 64, 8),
        (4096, 1, 4096),
        (4096, 512, 8),
    ]
    # The divisors of the 8 GPUs per node that the debug model's 4 key/value heads allow.
    assert sorted({layout[3] for layout in layouts}) == [1, 2, 4]
    assert (8, 1, 4, 2) in layouts and (64, 8, 2, 4) in layouts and (4096, 1, 1024, 4) in layouts
    by_layout = {layout: r["step_time"] for layout, r in zip(layouts, results, strict=True)}
    # HSDP keeps the shard group in a node; 64-way FSDP crosses nodes; TP groups never do.
    assert by_layout[(64, 8, 8, 1)]["shard_link"] == "intra-node"
    assert by_layout[(64, 1, 64, 1)]["shard_link"] == "inter-node"
    assert {by_layout[layout]["tp_link"] for layout in layouts if layout[3] > 1} == {"intra-node"}
    # The global batch is held (8 sequences per GPU, the config's local batch): a TP group
    # gets its GPUs' worth, so every layout has the same tokens per GPU.
    for (world_size, replicate, shard, _), result in zip(layouts, results, strict=True):
        assert result["layout"]["local_batch_size"] * replicate * shard == 8 * world_size
        assert result["step_time"]["tokens_per_device_per_step"] == 8 * 128


def test_sweep_says_tp_wins_when_no_layout_without_it_has_a_sequence_per_rank(capsys):
    argv = ["--job.config_file", DEBUG, "--sweep", "--skip_memory", "--sweep_sizes", "64", "--sweep_pp", "1"]
    assert estimate.main([*argv, "--training.global_batch_size", "16"]) == 0
    out = capsys.readouterr().out
    # 16 sequences: FSDP 64 and HSDP 8 x 8 have none for some ranks; TP 4 leaves 16 data-parallel ranks.
    assert "skipped 64 GPUs 1 x 64 x 1: the global batch of 16 sequences does not split over 64" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("64 GPUs: ") and "x4 wins" in verdict, verdict
    assert verdict.endswith("TP wins: no layout without TP has a sequence per data-parallel rank"), verdict


def test_sweep_says_tp_wins_when_fsdp_traffic_dominates(capsys):
    # Llama 3 8B, short sequences, in one node whose links are slow (20 GB/s): FSDP's per-rank
    # bytes swamp the compute; TP 4 divides them by 4 for less TP traffic of its own.
    argv = ["--job.config_file", str(REPO / "train_configs" / "llama3_8b.toml"), "--sweep", "--skip_memory"]
    argv += ["--sweep_sizes", "8", "--intra_node_gbps", "20", "--training.seq_len", "2048", "--sweep_pp", "1"]
    assert estimate.main(argv) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("8 GPUs: FSDP + TP 1x2x4 wins"), verdict
    assert "over the best without TP, FSDP 1x8x1, whose data-parallel collectives" in verdict, verdict
    assert "exceed its compute" in verdict


def _sweep_row(tp: int, tokens_per_s: float, fits: bool, peak_gib: float) -> dict:
    """A sweep result with only what the verdicts read."""
    strategy = "FSDP + TP" if tp > 1 else "FSDP"
    return {
        "layout": {"world_size": 8, "dp_replicate": 1, "dp_shard": 8 // tp, "tp": tp, "strategy": strategy},
        "step_time": {"tokens_per_second_per_device": tokens_per_s, "mfu_percent": 40.0, "tp_s": 0.1},
        "memory": {"fits": fits, "peak_bytes": peak_gib * 2**30, "device_bytes": 80 * 2**30},
    }


def test_sweep_says_tp_wins_when_nothing_else_fits():
    rows = [_sweep_row(1, 9000, False, 91.5), _sweep_row(2, 8000, True, 70), _sweep_row(4, 7000, True, 60)]
    assert sweep_verdicts(rows) == [
        "8 GPUs: FSDP + TP 1x4x2 wins, 8,000 tokens/s/GPU (MFU 40.0%); TP wins: no layout without TP fits in "
        "memory (the smallest peak, FSDP 1x8x1, is 91.5 GiB of 80)"
    ]
    assert sweep_verdicts([_sweep_row(1, 9000, False, 91.5)]) == ["8 GPUs: no layout fits"]


def test_a_tensor_parallel_layout_is_reported(capsys):
    argv = ["--job.config_file", DEBUG, "--world_size", "4", "--parallelism.tensor_parallel_degree", "2"]
    result = run_json(capsys, *argv)
    assert result["layout"]["strategy"] == "FSDP + TP" and result["layout"]["tp"] == 2
    assert result["step_time"]["tp_link"] == "intra-node" and result["step_time"]["tp_bytes"] > 0
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(LLAMA3_FLAVORS["debugmodel"]).parameters())
    # float32 master weights over 2 shards x 2 TP ranks (the norms, 1/2 only, are a rounding error)
    assert result["memory"]["parameters"] == pytest.approx(params * 4 / 4, rel=0.01)
    assert estimate.main(argv) == 0
    out = capsys.readouterr().out
    assert "FSDP + TP, 1 replica(s) x 2 shard(s) x tp 2" in out and "\n  TP  " in out


def test_nodes_give_the_world_size(capsys):
    result = run_json(capsys, "--job.config_file", DEBUG, "--nodes", "2", "--skip_memory")
    assert result["layout"]["world_size"] == 16


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--hardware", "h1000"], "hardware 'h1000' is not known (choose from h100"),
        (["--world_size", "8", "--parallelism.data_parallel_shard_degree", "3"], "must equal the world size (8)"),
        (["--world_size", "8", "--nodes", "2"], "--world_size 8 does not equal --nodes 2 x 8 GPUs per node = 16"),
        (["--training.stepz", "3"], "training.stepz"),
        (["--world_size", "8", "--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree (3) must divide"),
        (["--sweep", "--sweep_sizes", "8,x"], "--sweep_sizes '8,x': expected GPU counts like 8,64"),
        (["--sweep", "--sweep_pp", "1,0"], "--sweep_pp '1,0': expected positive pipeline degrees"),
        (["--sweep", "--sweep_schedules", "1F1B,Zigzag"], "unknown schedule 'Zigzag' (choose from GPipe, 1F1B,"),
        (["--sweep", "--sweep_simulate", "some"], "--sweep_simulate 'some': expected needed or all"),
        (
            ["--world_size", "8", "--parallelism.pipeline_parallel_degree", "3"],
            "pipeline_parallel_degree (3) must divide",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, expected):
    assert expected in one_error_line(capsys, "--job.config_file", DEBUG, "--skip_memory", *argv)


# --- the sweep: memory simulated only where it can change the winner --------------------------

LLAMA3_70B = str(REPO / "train_configs" / "llama3_70b.toml")
# CPU seconds the default sweep of Llama 3 70B on 64 GPUs may take. It simulates one layout's
# memory (the winner's: every faster one is over its floor); it measured 25 to 27 s of CPU on
# the CPU VM (2 cores shared with other work; 32 to 38 s of wall time at load averages of 3.7 to
# 5.4), and 29 s of CPU (71 s of wall time) beside two test workers. CPU time, not wall time: on
# shared cores the wall clock also counts the others' work.
SWEEP_70B_CPU_SECONDS = 55


def test_the_default_sweep_for_70b_on_64_gpus_answers_within_a_bound(capsys):
    start = time.process_time()
    assert estimate.main(["--job.config_file", LLAMA3_70B, "--sweep", "--sweep_sizes", "64", "--json"]) == 0
    seconds = time.process_time() - start
    captured = capsys.readouterr()
    assert seconds < SWEEP_70B_CPU_SECONDS, f"the 70B sweep took {seconds:.0f} s of CPU"
    # Progress on stderr (plain lines: not a terminal): the step times, then one simulation.
    assert "estimating step time 1/54: 64 GPUs 1 x 64 x 1" in captured.err, captured.err
    simulations = [line for line in captured.err.splitlines() if "simulating memory" in line]
    assert len(simulations) == 1 and simulations[0].endswith("simulating memory 1 of at most 34: 64 GPUs 1 x 32 x 2")
    results = json.loads(captured.out)
    winner = max((r for r in results if fits(r)), key=throughput)
    assert layout_name(winner["layout"]) == "FSDP + TP 1x32x2" and winner["memory"]["fits"]
    assert "floor_only" not in winner["memory"] and winner["memory"]["peak_bytes"] > winner["memory_floor"]["bytes"]
    # Full simulation would name the same winner: each layout ranked above it (faster, or as fast
    # and earlier) is known not to fit, over its floor (HSDP: the sharded state alone is 1/8).
    index = results.index(winner)
    above = [r for i, r in enumerate(results) if (throughput(r), -i) > (throughput(winner), -index)]
    assert len(above) == 2 and all(r["memory"]["floor_only"] and not r["memory"]["fits"] for r in above)
    assert {r.get("not_simulated") for r in results if "memory" not in r} == {"faster_fits"}
    table = sweep_table(results).splitlines()
    assert max(len(line) for line in table) <= WIDTH
    assert {line.split()[7] for line in table[1:55]} == {"yes", "NO", "-"}  # "NO f", "- w" split in two
    legend = " ".join(line.strip() for line in table[55:])
    assert "NO f: over its memory floor" in legend and "- w: not simulated: a faster layout fits" in legend
    assert "- s:" not in legend and "I1F1B: Interleaved1F1B" in legend
    assert sweep_verdicts(results)[0].startswith(
        "64 GPUs: FSDP + TP 1x32x2 wins, 802 tokens/s/GPU (MFU 36.4%); TP wins: +9% over the best without TP, "
        "FSDP 1x64x1 (memory not simulated), whose data-parallel collectives"
    )


def test_every_floor_is_below_its_simulated_peak(capsys):
    # The premise of simulating only what can win: a layout over its floor is over its peak.
    argv = ["--model.name=llama3", "--model.flavor=tiny", "--training.seq_len=64", "--training.local_batch_size=2"]
    argv += ["--sweep", "--sweep_sizes", "4", "--gpus_per_node", "2", "--sweep_pp", "1,2", "--sweep_schedules", "1F1B"]
    results = run_json(capsys, *argv, "--sweep_simulate", "all", "--sweep_cp", "1,2")
    layouts = {
        (r["layout"].get("pp", 1), r["layout"]["dp_replicate"], r["layout"]["dp_shard"], r["layout"]["tp"])
        + (r["layout"].get("cp", 1),)
        for r in results
    }
    # CP 2 takes two of the shard ranks, the global batch of 8 sequences held.
    assert layouts == {
        *((1, 1, 4, 1, 1), (1, 2, 2, 1, 1), (1, 1, 2, 2, 1), (1, 2, 1, 2, 1), (2, 1, 2, 1, 1), (2, 1, 1, 2, 1)),
        *((1, 1, 2, 1, 2), (1, 2, 1, 1, 2), (1, 1, 1, 2, 2), (2, 1, 1, 1, 2)),
    }
    for result in results:
        assert "floor_only" not in result["memory"] and "not_simulated" not in result
        assert 0 < result["memory_floor"]["bytes"] <= result["memory"]["peak_bytes"], result["layout"]


def _synthetic(world_size: int, index: int, tokens_per_s: float, key: int, floor_fits: bool) -> SweepCandidate:
    """A sweep candidate with only what the selection and the verdicts read; ``key`` stands for
    its per-rank memory (its shard degree), which decides its floor and fit."""
    result = {
        "layout": {"world_size": world_size, "dp_replicate": 1, "dp_shard": key, "tp": 1, "local_batch_size": 1},
        "step_time": {"tokens_per_second_per_device": tokens_per_s},
        "memory_floor": {"fits": floor_fits, "bytes": 1},
    }
    result["layout"]["strategy"] = f"layout {index}"
    if not floor_fits:
        result["memory"] = {"fits": False, "floor_only": True, "peak_bytes": 1}
    return SweepCandidate(world_size, f"layout {index}", None, result)


def _winners(candidates: list[SweepCandidate]) -> dict[int, str | None]:
    """Each GPU count's winner (as the verdicts pick it), by name, or None."""
    winners = {}
    for world_size in dict.fromkeys(c.world_size for c in candidates):
        fitting = [c.result for c in candidates if c.world_size == world_size and fits(c.result)]
        winners[world_size] = max(fitting, key=throughput)["layout"]["strategy"] if fitting else None
    return winners


def test_simulating_only_what_can_win_names_the_winner_full_simulation_names():
    rng = random.Random(0)
    for _ in range(300):
        # Per-rank memories (keys) shared by some layouts, ties in throughput, floors that do or
        # do not fit, peaks that fit only where the floor does (the floor is a floor).
        floor_fits = {key: rng.random() < 0.7 for key in range(6)}
        peak_fits = {key: floor_fits[key] and rng.random() < 0.4 for key in range(6)}
        layouts = [
            (world_size, rng.choice((100.0, 200.0, 300.0, 400.0)), rng.randrange(6))
            for world_size in (8, 64)
            for _ in range(rng.randrange(1, 9))
        ]
        answers = {}
        for mode in ("needed", "all"):
            calls = []

            def measure(candidate, calls=calls, peak_fits=peak_fits):
                calls.append(candidate.result["layout"]["dp_shard"])
                return {"fits": peak_fits[calls[-1]], "peak_bytes": 1}

            candidates = [_synthetic(w, i, t, key, floor_fits[key]) for i, (w, t, key) in enumerate(layouts)]
            simulate_where_needed(candidates, mode, measure)
            assert len(calls) == len(set(calls)), "one simulation per per-rank memory"
            answers[mode] = (_winners(candidates), candidates, calls)
        (lazy, candidates, calls), (full, _, all_calls) = answers["needed"], answers["all"]
        assert lazy == full, layouts
        assert set(calls) <= set(all_calls)
        for world_size, name in lazy.items():
            same_size = [c.result for c in candidates if c.world_size == world_size]
            ranked = sorted(same_size, key=throughput, reverse=True)
            cut = len(ranked) if name is None else [r["layout"]["strategy"] for r in ranked].index(name)
            # Everything ranked above the winner is known not to fit; nothing below it was
            # simulated for nothing but what a shared simulation answered.
            assert all(fits(r) is False for r in ranked[:cut])
            assert all(fits(r) is not None for r in ranked[: cut + 1])


def _table_row(code: str, schedule: str | None = None) -> dict:
    """A sweep result whose "fits" cell is ``code``."""
    memory = {
        "yes": {"fits": True, "peak_bytes": 40 * 2**30},
        "NO": {"fits": False, "peak_bytes": 90 * 2**30},
        "NO f": {"fits": False, "peak_bytes": 200 * 2**30, "floor_only": True},
    }
    layout = {"world_size": 4096, "dp_replicate": 512, "dp_shard": 8, "tp": 1, "local_batch_size": 1}
    layout.update({"pp": 16, "schedule": schedule} if schedule else {})
    step_time = {"bubble": 0.25, "step_s": 123.456, "tp_s": 12.3456, "ep_s": 0.0123, "mfu_percent": 12.3}
    step_time.update({"tokens_per_second_per_device": 123456.7, "verdict": "communication-bound"})
    result = {"layout": layout, "step_time": step_time, "memory_floor": {"fits": code != "NO f", "bytes": 1}}
    if code in memory:
        result["memory"] = memory[code]
    else:
        result["not_simulated"] = {"- w": "faster_fits", "- s": "skip_memory"}[code]
    return result


def test_the_sweep_table_fits_100_columns_and_says_why_a_fit_is_missing():
    rows = [_table_row("yes"), _table_row("NO f", "InterleavedZeroBubble"), _table_row("- w", "1F1B")]
    lines = sweep_table(rows).splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert lines[0].split()[:4] == ["GPUs", "layout", "ep", "sched"]
    assert lines[1].split() == [
        *("4096", "1x512x8x1", "1", "-", "1", "25.0%", "40.00", "yes"),
        *("123,456", "12,346", "12.3", "123,457", "12.3", "comm"),
    ]
    assert lines[2].split()[1:8] == ["16x512x8x1", "1", "IZB", "1", "25.0%", ">200.0", "NO"]
    legend = " ".join(line.strip() for line in lines[4:])
    assert "NO f: over its memory floor" in legend and "- w: not simulated: a faster layout fits" in legend
    assert "IZB: InterleavedZeroBubble" in legend and "1F1B:" not in legend and "- s:" not in legend
    skipped = sweep_table([_table_row("NO"), _table_row("- s")])
    assert "- s: not simulated (--skip_memory)" in skipped and "- w:" not in skipped


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_line_on_a_terminal_and_plain_lines_elsewhere():
    for stream in (io.StringIO(), _Terminal()):
        progress = estimate.ProgressLine(stream)
        for done in (1, 2, 3):
            progress("estimating step time", done, 3, f"layout {done}")
        progress("simulating memory", 1, 5, "8 GPUs 1 x 8 x 1")
        progress.close()
        out = stream.getvalue()
        if isinstance(stream, _Terminal):  # rewritten in place, then cleared
            assert "\n" not in out and out.count("\r") == 5 and out.endswith("\r\x1b[K")
        else:  # the first and last step times, every simulation
            assert out.splitlines() == [
                "[0:00] estimating step time 1/3: layout 1",
                "[0:00] estimating step time 3/3: layout 3",
                "[0:00] simulating memory 1 of at most 5: 8 GPUs 1 x 8 x 1",
            ]


def test_bad_sweep_cp_is_one_line(capsys):
    line = one_error_line(capsys, "--job.config_file", DEBUG, "--sweep", "--sweep_cp", "1,x")
    assert "--sweep_cp '1,x': expected context-parallel degrees like 1,2,4,8" in line
