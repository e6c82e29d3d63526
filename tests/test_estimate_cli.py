"""scripts/estimate.py: the answers a user reads before renting GPUs, and its bad input."""

import json
import sys
from pathlib import Path

import pytest
import torch

from titanlite.models.llama import LLAMA2_FLAVORS, Transformer

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


def test_sweep_covers_fsdp_and_hsdp_at_every_size(capsys):
    results = run_json(capsys, "--job.config_file", DEBUG, "--sweep", "--skip_memory")
    layouts = [(r["layout"]["world_size"], r["layout"]["dp_replicate"], r["layout"]["dp_shard"]) for r in results]
    assert layouts == [(8, 1, 8), (64, 1, 64), (64, 8, 8), (512, 1, 512), (512, 64, 8), (4096, 1, 4096), (4096, 512, 8)]
    by_layout = {layout: r["step_time"] for layout, r in zip(layouts, results, strict=True)}
    # HSDP keeps the shard group in a node; 64-way FSDP crosses nodes.
    assert by_layout[(64, 8, 8)]["shard_link"] == "intra-node"
    assert by_layout[(64, 1, 64)]["shard_link"] == "inter-node"


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
    ],
)
def test_bad_input_is_one_line(capsys, argv, expected):
    assert expected in one_error_line(capsys, "--job.config_file", DEBUG, "--skip_memory", *argv)
