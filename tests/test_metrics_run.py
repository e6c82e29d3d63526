"""Metrics of a real training run: TensorBoard and JSONL agree, the derived numbers
follow from tokens/s, validation and profiling write where the docs say, and the
start-up diagnostics describe the sharding that was really built.

The 2-rank runs are jobs of one launch (the `two_rank` fixture)."""

import contextlib
import io
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.helpers import TINY, capture_log_lines, tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from titanlite import metrics
from titanlite.config import parse_args
from titanlite.metrics import tags
from titanlite.metrics.diagnostics import ComputeDtypeProbe, fsdp_unit_names, log_startup
from titanlite.models.llama import Transformer
from titanlite.train import Trainer

STEPS, LOG_FREQ = 5, 2
LOGGED_STEPS = [1, 2, 4, 5]
VALIDATED_STEPS = [3, 5]
BASE = tiny_args({"training.steps": STEPS, "metrics.log_freq": None})
ARGS = BASE + [
    f"--metrics.log_freq={LOG_FREQ}",
    "--metrics.enable_tensorboard",
    "--metrics.peak_tflops",
    "0.5",
    "--validation.enable",
    "--validation.freq=3",
    "--validation.steps=2",
    "--profiling.enable_profiling",
    "--profiling.profile_freq=2",
]
TRAIN_TAGS = [
    tags.LOSS,
    tags.MAX_LOSS,
    tags.GRAD_NORM,
    tags.LR,
    tags.TPS,
    tags.TFLOPS,
    tags.MFU,
    tags.STEP_TIME,
    tags.DATA_TIME,
    tags.DATA_PCT,
    tags.RSS_GIB,
    tags.PEAK_RSS_GIB,
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    dump = tmp_path_factory.mktemp("run")
    records = Trainer(parse_args(ARGS + ["--job.dump_folder", str(dump)])).train()
    (jsonl,) = (dump / "metrics").glob("*/metrics.jsonl")
    (tb_folder,) = (dump / "tb").iterdir()
    events = EventAccumulator(str(tb_folder))
    events.Reload()
    return {
        "dump": dump,
        "records": records,
        "lines": [json.loads(line) for line in jsonl.read_text().splitlines()],
        "events": events,
    }


def test_tensorboard_has_one_value_per_logged_step_and_jsonl_the_same(run):
    events, lines = run["events"], run["lines"]
    train_lines = {line["step"]: line for line in lines if tags.LOSS in line}
    assert sorted(train_lines) == LOGGED_STEPS
    for tag in TRAIN_TAGS:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == LOGGED_STEPS, tag
        for scalar in scalars:  # TensorBoard stores float32
            assert scalar.value == pytest.approx(train_lines[scalar.step][tag], rel=1e-6, abs=1e-12), tag
    # The console's numbers are the same ones.
    assert [r.loss for r in run["records"]] == [train_lines[s][tags.LOSS] for s in LOGGED_STEPS]


def test_validation_is_logged_at_its_steps(run):
    val_lines = [line for line in run["lines"] if tags.VAL_LOSS in line]
    assert [line["step"] for line in val_lines] == VALIDATED_STEPS
    for line in val_lines:
        assert line[tags.VAL_PERPLEXITY] == pytest.approx(math.exp(line[tags.VAL_LOSS]))
    assert [s.step for s in run["events"].Scalars(tags.VAL_LOSS)] == VALIDATED_STEPS


def test_derived_numbers_follow_from_tokens_per_second(run):
    per_token = metrics.flops_per_token(TINY.with_seq_len(32), 32)
    for line in run["lines"]:
        if tags.TPS not in line:
            continue
        assert line[tags.TFLOPS] == pytest.approx(line[tags.TPS] * per_token / 1e12, rel=1e-9)
        assert line[tags.MFU] == pytest.approx(100 * line[tags.TFLOPS] / 0.5, rel=1e-9)
        assert line[tags.MAX_LOSS] == line[tags.LOSS]  # one process: its mean is the global one
        assert 0 <= line[tags.DATA_PCT] <= 100
        assert line[tags.PEAK_RSS_GIB] >= line[tags.RSS_GIB] > 0


def test_a_profiler_trace_appears(run):
    traces = sorted(p.relative_to(run["dump"]) for p in (run["dump"] / "profile_traces").rglob("*.json"))
    assert traces == [Path(f"profile_traces/iteration_{s}/rank0_trace.json") for s in (2, 4)]
    assert json.loads((run["dump"] / traces[0]).read_text())["traceEvents"]


def test_no_mfu_on_cpu_without_a_configured_peak(tmp_path):
    args = [a for a in ARGS if a not in ("--metrics.peak_tflops", "0.5")]
    Trainer(parse_args(args + ["--job.dump_folder", str(tmp_path), "--training.steps=1"])).train()
    (jsonl,) = (tmp_path / "metrics").glob("*/metrics.jsonl")
    first = json.loads(jsonl.read_text().splitlines()[0])
    assert tags.TFLOPS in first and tags.MFU not in first


def test_a_dtype_that_did_not_propagate_is_reported(caplog):
    model = Transformer(TINY)
    model.init_weights(seed=0)
    probe = ComputeDtypeProbe(model, expected=torch.bfloat16)
    model(torch.zeros(1, 8, dtype=torch.long))  # no autocast, no FSDP: float32
    with caplog.at_level(logging.INFO, logger="titanlite"):
        probe.report()
    assert "MIXED PRECISION PROBLEM: the model computes in float32, the config asks for bfloat16" in caplog.text


def diagnose_two_ranks(dump: str) -> dict:
    captured, stdout = capture_log_lines(), io.StringIO()
    with contextlib.redirect_stdout(stdout):  # where the log handler writes
        trainer = Trainer(
            parse_args(
                BASE
                + [
                    "--job.dump_folder",
                    dump,
                    "--training.steps=2",
                    "--metrics.log_freq=1",
                    "--metrics.save_for_all_ranks",
                ]
            )
        )
        units = fsdp_unit_names(trainer.model)
        local_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in trainer.model.parameters())
        trainer.train()
    dist.destroy_process_group()
    return {"units": units, "local_bytes": local_bytes, "lines": captured.lines, "stdout": stdout.getvalue()}


def test_two_rank_diagnostics(two_rank):
    ranks = two_rank["diagnostics"]
    expected_units = ["<root>"] + [f"layers.{i}" for i in range(TINY.n_layers)]
    model_bytes = sum(p.numel() * 4 for p in Transformer(TINY).parameters())
    assert sum(rank["local_bytes"] for rank in ranks) == model_bytes
    for rank in ranks:
        assert rank["units"] == expected_units
        assert not any("SHARDING PROBLEM" in line for line in rank["lines"])
    # Rank 0 prints its own shard size; rank 1, which LOG_RANK (default 0) silences, prints nothing.
    assert f"rank 0: local trainable parameters {ranks[0]['local_bytes'] / 2**20:.2f} MiB" in ranks[0]["stdout"]
    assert ranks[1]["stdout"] == ""
    assert any(line.startswith(f"FSDP units: {TINY.n_layers + 1} (<root>, layers.0") for line in ranks[0]["lines"])
    assert any("after forward" in line and "after optimizer" in line for line in ranks[0]["lines"])
    # Each rank logged its own metrics, and the max loss is one of the ranks' own means.
    for rank_id in range(2):
        (jsonl,) = two_rank["dump"].glob(f"metrics/*/rank_{rank_id}/metrics.jsonl")
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2]
        assert all(line[tags.MAX_LOSS] >= line[tags.LOSS] for line in lines)


def tensor_parallel_start_up(dump: str) -> list[str]:
    captured = capture_log_lines()
    Trainer(parse_args(BASE + ["--job.dump_folder", dump, "--parallelism.tensor_parallel_degree=2"]))
    dist.destroy_process_group()
    return captured.lines


def test_tensor_parallel_start_up_shows_the_split(two_rank):
    lines = two_rank["tensor parallel"][0]
    assert any("strategy=TP" in line and "tensor_parallel=2" in line and "loss_parallel=True" in line for line in lines)
    (shards,) = [line for line in lines if line.startswith("parameter shards of block 0 on rank 0: ")]
    dim, hidden = TINY.dim, TINY.ffn_hidden_dim
    kv_dim = TINY.kv_heads * TINY.head_dim
    for expected in (
        f"attention.wq.weight [{dim}, {dim}] -> [{dim // 2}, {dim}]",  # by query heads
        f"attention.wk.weight [{kv_dim}, {dim}] -> [{kv_dim // 2}, {dim}]",  # by key/value heads
        f"attention.wo.weight [{dim}, {dim}] -> [{dim}, {dim // 2}]",  # by input features
        f"feed_forward.w1.weight [{hidden}, {dim}] -> [{hidden // 2}, {dim}]",
        f"feed_forward.w2.weight [{dim}, {hidden}] -> [{dim}, {hidden // 2}]",
        f"attention_norm.weight [{dim}] -> [{dim}]",  # whole on each TP rank
    ):
        assert expected in shards, (expected, shards)


def shard_root_only() -> list[str]:
    """The mistake the warning is for: fully_shard on the root alone."""
    dist.init_process_group("gloo")
    captured = capture_log_lines()
    logging.getLogger("titanlite").setLevel(logging.INFO)
    model = fully_shard(Transformer(TINY))
    assert isinstance(model.tok_embeddings.weight, DTensor)
    log_startup(model, {"strategy": "FSDP"}, TINY.n_layers, sharded=True, rank=dist.get_rank())
    dist.destroy_process_group()
    return captured.lines


def test_a_wrap_that_matched_nothing_is_flagged(two_rank):
    lines = two_rank["root only"][0]
    assert any("SHARDING PROBLEM: only 1 FSDP unit(s) for a model of 3 blocks" in line for line in lines), lines


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory) -> dict:
    dump = tmp_path_factory.mktemp("two_rank")
    jobs = {
        "diagnostics": Job(2, diagnose_two_ranks, (str(dump / "diagnostics"),)),
        "tensor parallel": Job(2, tensor_parallel_start_up, (str(dump / "tensor_parallel"),)),
        "root only": Job(2, shard_root_only),
    }
    return {"dump": dump / "diagnostics", **run_jobs_on_ranks(4, jobs)}
