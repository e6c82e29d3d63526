"""Unit tests for titanlite.metrics: the logging backends and their folders, the console
line, FLOPs per token and parameter counts, the peak-FLOPs table, MFU, and memory stats."""

import dataclasses
import json
import logging
import math
import os
import sys

import pytest
import torch

from titanlite.config import Metrics
from titanlite.metrics import (
    ConsoleLogger,
    FanOutLogger,
    JsonlLogger,
    MemoryMonitor,
    TensorBoardLogger,
    build_loggers,
    count_params,
    flops_per_token,
    mfu,
    peak_flops_per_device,
    phase_peak_gib,
    resolve_peak_flops,
    tags,
    tflops,
)
from titanlite.metrics import memory as memory_module
from titanlite.models.llama import LLAMA2_FLAVORS, LLAMA3_FLAVORS, LlamaArgs, Transformer
from titanlite.models.llama.model import TransformerBlock

STEPS = (1, 2, 5)


def sample_metrics(step: int) -> dict[str, float]:
    """Different, exactly representable-in-float32 values for every tag at every step."""
    return {tag: float(step * 100 + index) for index, tag in enumerate(tags.ALL_TAGS)}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def test_tensorboard_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardLogger(str(tmp_path))
    for step in STEPS:
        writer.log(sample_metrics(step), step)
    writer.close()

    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(tags.ALL_TAGS)
    for tag in tags.ALL_TAGS:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == list(STEPS), tag
        assert [s.value for s in scalars] == [sample_metrics(step)[tag] for step in STEPS], tag


def test_jsonl_round_trip_flushes_each_line_and_appends(tmp_path):
    path = tmp_path / "metrics" / "metrics.jsonl"
    writer = JsonlLogger(str(path))
    writer.log({tags.LOSS: 2.5, tags.TPS: 1000.0}, 1)
    # Readable before close: a crash after this point loses nothing.
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 1, tags.LOSS: 2.5, tags.TPS: 1000.0}
    writer.log({tags.LOSS: float("nan")}, 2)
    writer.close()

    # A resumed run appends instead of truncating.
    again = JsonlLogger(str(path))
    again.log({tags.LOSS: 1.25}, 5)
    again.close()

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 5]
    assert math.isnan(rows[1][tags.LOSS])
    assert rows[2] == {"step": 5, tags.LOSS: 1.25}


def test_fan_out_sends_to_every_logger_and_closes_all(tmp_path):
    class Recorder:
        def __init__(self, fail_close=False):
            self.calls, self.closed, self.fail_close = [], False, fail_close

        def log(self, metrics, step):
            self.calls.append((step, metrics))

        def close(self):
            self.closed = True
            if self.fail_close:
                raise OSError("disk full")

    first, second = Recorder(fail_close=True), Recorder()
    fan_out = FanOutLogger([first, second])
    fan_out.log({tags.LOSS: 1.0}, 3)
    assert first.calls == second.calls == [(3, {tags.LOSS: 1.0})]
    with pytest.raises(OSError, match="disk full"):
        fan_out.close()
    assert first.closed and second.closed


# ---------------------------------------------------------------------------
# build_loggers: which backends, in which folders, on which rank
# ---------------------------------------------------------------------------


def kinds(fan_out) -> list[str]:
    return [type(each).__name__ for each in fan_out.loggers]


def built_files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(folder, name), root) for folder, _, names in os.walk(root) for name in names
    )


@pytest.mark.parametrize("save_for_all_ranks", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_build_loggers_folders(tmp_path, rank, save_for_all_ranks):
    config = Metrics(enable_tensorboard=True, save_for_all_ranks=save_for_all_ranks)
    fan_out = build_loggers(config, str(tmp_path), rank, "run1")
    fan_out.log({tags.LOSS: 1.0}, 1)
    fan_out.close()

    expected = (["ConsoleLogger"] if rank == 0 else []) + (
        ["TensorBoardLogger", "JsonlLogger"] if rank == 0 or save_for_all_ranks else []
    )
    assert kinds(fan_out) == expected
    files = built_files(tmp_path)
    if rank != 0 and not save_for_all_ranks:
        assert files == []
        return
    sub = [f"rank_{rank}"] if save_for_all_ranks else []
    assert os.path.join("metrics", "run1", *sub, "metrics.jsonl") in files
    tb_folder = os.path.join("tb", "run1", *sub)
    assert [f for f in files if f.startswith("tb")] and all(
        os.path.dirname(f) == tb_folder for f in files if f.startswith("tb")
    )


def test_build_loggers_respects_switches_and_tb_folder(tmp_path):
    config = Metrics(enable_tensorboard=True, enable_jsonl=False, save_tb_folder="board", disable_color_printing=True)
    fan_out = build_loggers(config, str(tmp_path), 0, "r")
    assert kinds(fan_out) == ["ConsoleLogger", "TensorBoardLogger"]
    assert fan_out.loggers[0].color is False
    assert fan_out.loggers[1].folder == os.path.join(str(tmp_path), "board", "r")
    fan_out.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_wandb_is_one_clear_value_error_on_every_rank(tmp_path, monkeypatch, rank):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail even if installed
    with pytest.raises(ValueError, match=r"^metrics\.enable_wandb .* wandb package is not installed") as info:
        build_loggers(Metrics(enable_wandb=True), str(tmp_path), rank, "r")
    assert "\n" not in str(info.value)
    assert built_files(tmp_path) == []  # failed before creating anything


# ---------------------------------------------------------------------------
# Console line
# ---------------------------------------------------------------------------

GPU_STEP = {
    tags.LOSS: 5.123456,
    tags.GRAD_NORM: 0.81234,
    tags.LR: 8e-4,
    tags.TPS: 12345.4,
    tags.TFLOPS: 123.456,
    tags.MFU: 41.2,
    tags.MAX_RESERVED_GIB: 12.3,
    tags.MAX_RESERVED_PCT: 15.49,
    tags.STEP_TIME: 0.5123,
}


def console_lines(caplog, color: bool, metrics: dict, step: int = 10) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ConsoleLogger(color=color).log(metrics, step)
    return [r.getMessage() for r in caplog.records if r.name == "titanlite"]


def test_console_line_plain(caplog):
    (line,) = console_lines(caplog, False, GPU_STEP)
    assert "\033[" not in line
    assert line == (
        "step: 10  loss: 5.1235  grad_norm: 0.8123  lr: 8.00e-04  tps: 12,345  tflops: 123.46  "
        "mfu: 41.20%  memory: 12.30GiB(15.5%)  step_time: 0.512s"
    )


def test_console_line_colored_has_same_text(caplog):
    (line,) = console_lines(caplog, True, GPU_STEP)
    assert "\033[31m" in line and line.endswith("\033[0m")
    stripped = line
    for code in (
        "\033[0m",
        "\033[31m",
        "\033[32m",
        "\033[33m",
        "\033[34m",
        "\033[35m",
        "\033[36m",
        "\033[37m",
        "\033[90m",
    ):
        stripped = stripped.replace(code, "")
    (plain,) = console_lines(caplog, False, GPU_STEP)
    assert stripped == plain


def test_console_line_cpu_leaves_out_mfu_and_shows_rss(caplog):
    cpu_step = {
        tags.LOSS: 4.0,
        tags.TPS: 2048.0,
        tags.TFLOPS: 0.00123,
        tags.RSS_GIB: 0.5,
        tags.PEAK_RSS_GIB: 0.75,
        tags.STEP_TIME: 1.5,
    }
    (line,) = console_lines(caplog, False, cpu_step, step=1)
    assert line == "step:  1  loss: 4.0000  tps: 2,048  tflops: 0.00123  memory: 0.50GiB(peak 0.75)  step_time: 1.500s"
    assert "mfu" not in line


def test_console_line_validation(caplog):
    (line,) = console_lines(caplog, False, {tags.VAL_LOSS: 2.0, "validation_metrics/perplexity": math.exp(2.0)}, 20)
    assert line == "step: 20  val_loss: 2.0000  val_ppl: 7.39"


# ---------------------------------------------------------------------------
# FLOPs and parameter counts
# ---------------------------------------------------------------------------


def test_flops_per_token_debug_model_hand_count():
    args = LLAMA3_FLAVORS["debugmodel"]
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (256, 6, 16, 4, 2048)
    assert args.ffn_hidden_dim == 704  # int(2 * 4 * 256 / 3) = 682, rounded up to a multiple of 64
    head_dim = 256 // 16
    attention = 256 * 256 + 2 * 256 * (4 * head_dim) + 256 * 256  # wq, wk, wv, wo
    feed_forward = 3 * 256 * 704
    norms = 2 * 256
    block = attention + feed_forward + norms
    assert block == 705_024
    non_embedding = 6 * block + 256 + 256 * 2048  # blocks, final norm, output projection
    assert non_embedding == 4_754_688
    attention_term = 6 * 6 * 16 * head_dim * 2048  # 6 x L x H x Dh x T: the causal half of the scores
    assert flops_per_token(args, 2048) == 6 * non_embedding + attention_term == 47_402_496


@pytest.mark.parametrize("flavor, seq_len", [("debugmodel", 2048), ("8B", 8192), ("70B", 131072)])
def test_full_attention_convention_adds_exactly_the_other_half_of_the_scores(flavor, seq_len):
    # torchtitan's and PaLM's MFU count the whole score matrix (12 x L x H x Dh x T), the
    # default counts its causal half (6 x ...): the two differ by exactly 6 x L x H x Dh x T.
    args = LLAMA3_FLAVORS[flavor]
    causal, whole = flops_per_token(args, seq_len), flops_per_token(args, seq_len, causal_attention=False)
    assert whole - causal == 6 * args.n_layers * args.n_heads * args.head_dim * seq_len
    assert causal == 6 * count_params(args, include_embedding=False) + 6 * args.n_layers * args.dim * seq_len


def meta_param_count(args: LlamaArgs) -> int:
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "args",
    [
        LLAMA3_FLAVORS["debugmodel"],
        LLAMA2_FLAVORS["debugmodel"],
        LlamaArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=1000, multiple_of=32, ffn_dim_multiplier=1.3),
        LLAMA3_FLAVORS["8B"],
    ],
    ids=["llama3-debug", "llama2-debug", "gqa-ffn-multiplier", "llama3-8B"],
)
def test_param_count_matches_meta_transformer(args):
    assert count_params(args) == meta_param_count(args)
    assert count_params(args, include_embedding=False) == count_params(args) - args.vocab_size * args.dim


def test_llama3_8b_param_count_is_the_published_one():
    assert count_params(LLAMA3_FLAVORS["8B"]) == 8_030_261_248


class _GatedBlock(TransformerBlock):
    """A block with one more weight than Llama's: a gate vector on its output."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__(layer_id, args)
        self.gate = torch.nn.Parameter(torch.ones(args.dim))


class _GatedTransformer(Transformer):
    block_cls = _GatedBlock


@dataclasses.dataclass(frozen=True)
class _GatedArgs(LlamaArgs):
    """A family metrics.flops has never heard of: only its args name its model class."""

    @classmethod
    def model_cls(cls) -> type:
        return _GatedTransformer


def test_flop_count_is_taken_on_the_model_class_the_args_name():
    shape = dict(dim=64, n_layers=3, n_heads=4, vocab_size=258, multiple_of=32)
    llama, gated = LlamaArgs(**shape), _GatedArgs(**shape)
    assert (
        count_params(gated)
        == count_params(llama) + 3 * 64
        == sum(p.numel() for p in _GatedTransformer(gated).parameters())
    )
    assert flops_per_token(gated, 128) - flops_per_token(llama, 128) == 6 * 3 * 64


def test_tflops_and_mfu_arithmetic():
    assert tflops(1000.0, 6_000_000_000) == pytest.approx(6.0)
    assert mfu(1000.0, 6_000_000_000, 12e12) == pytest.approx(50.0)
    assert mfu(0.0, 1, 1e12) == 0.0
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        mfu(1.0, 1, 0.0)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("Tesla V100-SXM2-16GB", 125e12),
        ("NVIDIA B200", 2.25e15),
        ("AMD Instinct MI300X", 1307e12),
        ("cpu", None),
        ("NVIDIA GeForce GTX 1080", None),
        ("", None),
    ],
)
def test_peak_flops_table(name, peak):
    assert peak_flops_per_device(name) == peak


def test_resolve_peak_flops_prefers_the_config_and_gives_none_on_cpu():
    assert resolve_peak_flops(100.0, torch.device("cpu")) == 100e12
    assert resolve_peak_flops(0.0, torch.device("cpu")) is None


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def test_memory_monitor_cpu_reports_rss_and_peak():
    monitor = MemoryMonitor(torch.device("cpu"))
    keep = torch.ones(16 * 1024 * 1024 // 4)  # 16 MiB, so the RSS is certainly not zero
    stats = monitor.stats()
    assert set(stats) == {tags.RSS_GIB, tags.PEAK_RSS_GIB}
    assert stats[tags.RSS_GIB] > 0
    assert stats[tags.PEAK_RSS_GIB] >= stats[tags.RSS_GIB]
    monitor.reset_peak()  # must not raise, whether or not the kernel lets us reset
    assert phase_peak_gib(torch.device("cpu")) > 0 and monitor.phase_peak_gib() > 0
    assert monitor.kind == "CPU peak RSS"
    del keep


def test_memory_monitor_cuda_arithmetic(monkeypatch):
    """The CUDA path without a GPU: the allocator's statistics are faked."""
    gib = 1024**3
    calls = []
    fake_stats = {
        "active_bytes.all.peak": 2 * gib,
        "reserved_bytes.all.peak": 4 * gib,
        "num_alloc_retries": 3,
        "num_ooms": 1,
    }
    properties = dataclasses.make_dataclass("Props", [("total_memory", int)])(80 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: fake_stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: gib // 2)

    monitor = MemoryMonitor(torch.device("cuda"))
    assert calls == ["reset"]
    assert monitor.stats() == {
        "memory/max_active(GiB)": 2.0,
        "memory/max_active(%)": 2.5,
        "memory/max_reserved(GiB)": 4.0,
        "memory/max_reserved(%)": 5.0,
        "memory/num_alloc_retries": 3,
        "memory/num_ooms": 1,
    }
    monitor.reset_peak()
    assert calls == ["reset", "reset"]
    assert monitor.phase_peak_gib() == 0.5
    assert monitor.kind == "CUDA max allocated"


def test_cpu_reset_peak_becomes_a_no_op_when_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_module, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    monitor = MemoryMonitor(torch.device("cpu"))
    assert monitor.cpu_peak_resettable is False
    monitor.reset_peak()
    assert monitor.stats()[tags.PEAK_RSS_GIB] > 0
