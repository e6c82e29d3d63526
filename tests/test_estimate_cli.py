"""scripts/estimate.py: the answers a user reads before renting GPUs, and its bad input."""

import json
import sys
from pathlib import Path

import pytest
import torch

from titanlite.models.llama import LLAMA2_FLAVORS, LLAMA3_FLAVORS, Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LLAMA7B = str(REPO / "train_configs" / "llama7b.toml")
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


def test_llama7b_on_8_h100_memory_equals_the_arithmetic(capsys):
    result = run_json(capsys, "--job.config_file", LLAMA7B, "--world_size", "8", "--hardware", "h100")
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(LLAMA2_FLAVORS["7B"]).parameters())
    assert params == 6_738_415_616
    memory = result["memory"]
    # float32 master weights and gradients, AdamW's two float32 moments, over 8 shards
    # (every 7B dimension divides by 8: no padding), plus AdamW's per-tensor step counters.
    n_tensors = 2 + 32 * 9 + 1
    assert memory["parameters"] == params * 4 // 8
    assert memory["gradients"] == params * 4 // 8
    assert memory["optimizer_state"] == params * 8 // 8 + 4 * n_tensors
    categories = memory["by_category_at_peak"]
    assert {"parameters", "gradients", "optimizer_state", "activations", "temporary"} <= categories.keys()
    assert categories["activations"] > 0 and memory["peak_bytes"] == categories["total"]
    assert memory["fits"] and memory["device_bytes"] == 80 * 2**30
    assert result["layout"] == {
        "strategy": "FSDP",
        "world_size": 8,
        "dp_replicate": 1,
        "dp_shard": 8,
        "tp": 1,
        "local_batch_size": 2,
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
    assert estimate._sweep_verdicts(rows) == [
        "8 GPUs: FSDP + TP 1x4x2 wins, 8,000 tokens/s/GPU (MFU 40.0%); TP wins: no layout without TP fits in "
        "memory (the smallest peak, FSDP 1x8x1, is 91.5 GiB of 80)"
    ]
    assert estimate._sweep_verdicts([_sweep_row(1, 9000, False, 91.5)]) == ["8 GPUs: no layout fits"]


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
        (
            ["--world_size", "8", "--parallelism.pipeline_parallel_degree", "3"],
            "pipeline_parallel_degree (3) must divide",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, expected):
    assert expected in one_error_line(capsys, "--job.config_file", DEBUG, "--skip_memory", *argv)
