"""Smoke tests of the benchmark scripts: each runs with its smallest options as a
subprocess, exits 0 and ends with its key line. No timings are asserted: the numbers
depend on the machine and on whatever else runs on it."""

import os
from pathlib import Path

import pytest
import torch

from tests.forked_scripts import run_python, start_python
from tests.helpers import load_script

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO_ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: float = 180, fork_ranks: bool = True) -> list[str]:
    """Run a benchmark script; return its non-empty stdout lines after checking it succeeded.
    The ranks a script spawns fork from a fork server of its own (tests/forked_scripts.py,
    fork_ranks): importing titanlite once a script instead of once a rank saves about 2.5 s of
    CPU a rank; only a script whose ranks' own start and end it measures spawns them."""
    result = run_python([BENCHMARKS / script, *args], cwd=REPO_ROOT, timeout=timeout, fork_ranks=fork_ranks)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, result.stderr[-4000:]
    return lines


def test_throughput_quick_prints_the_table_and_the_key_ratio():
    lines = _run("throughput.py", "--quick")
    assert any(line.startswith("| debug (5.3 M) | FSDP | 2 (1 x 2) | eager |") for line in lines), lines
    assert lines[-1].startswith("key ratio (debug, eager): FSDP 2 ranks total tokens/s / 1 rank tokens/s = "), lines
    float(lines[-1].split(" = ")[1].split()[0])  # a number, whatever its value


def test_memory_scaling_quick_prints_every_rank_and_the_worst_ratio():
    lines = _run("memory_scaling.py", "--quick")
    rows = [line.rstrip(" |").split(" | ") for line in lines if line.startswith("| debug (5.3 M) |")]
    assert [(row[1], row[2]) for row in rows] == [("1", "single"), ("2", "FSDP 2"), ("2", "FSDP 2")] + [
        ("2", "TP 2")
    ] * 2, lines
    # Bytes, unlike timings, are deterministic: the debug model shards evenly over 2 ranks.
    ratios = {row[2]: float(row[9]) for row in rows}
    assert 0.99 < ratios["FSDP 2"] < 1.01, lines
    # TP 2 alone: every gradient in its parameter's layout (the norms, whole on both TP ranks,
    # are the only excess), including the embedding's, which DTensor's backward returns whole.
    assert 0.99 < ratios["TP 2"] < 1.01, lines
    # The estimator (a fake process group in the parent) gives every rank's bytes exactly.
    assert all(row[10] == row[7] for row in rows), lines
    assert "estimator vs measured, every rank of every layout: largest difference 0 bytes" in lines
    assert lines[-1].startswith("worst per-rank param+grad+optimizer bytes / (total / world size) = "), lines
    worst = float(lines[-1].split(" = ")[1].split()[0])
    assert worst == ratios["TP 2"], lines[-1]


def test_gpu_mfu_skips_without_a_gpu_or_runs_briefly_with_one():
    if torch.cuda.is_available():
        lines = _run("gpu_mfu.py", "--steps", "4", "--warmup", "2", "--seq-len", "512", "--batch", "1", timeout=600)
        assert lines[-1].startswith("MFU = "), lines
    else:
        assert _run("gpu_mfu.py") == ["no GPU: skipped"]


def test_gpu_check_skips_without_a_gpu_or_passes_with_one():
    if torch.cuda.is_available():
        lines = _run("gpu_check.py", timeout=900)
        assert lines[-1].endswith("checks passed"), lines
    else:
        assert _run("gpu_check.py") == ["no GPU: skipped"]


def test_estimate_check_prints_both_layouts_and_the_ratio():
    lines = _run("estimate_check.py", "--model", "debug", "--steps", "2")
    assert any(line.startswith("| single |") for line in lines) and any(line.startswith("| fsdp2 |") for line in lines)
    assert lines[-1].startswith("measured / predicted tokens/s per rank, FSDP 2 ranks = "), lines
    float(lines[-1].split(" = ")[1].split()[0])


def test_resume_seek_prints_both_tokenizers_and_the_bpe_line():
    lines = _run("resume_seek.py", "--tokens", "200000")
    assert any(line.startswith("| byte |") for line in lines) and any(line.startswith("| bpe |") for line in lines)
    assert lines[-1].startswith("bpe fast-forward: ") and lines[-1].endswith(" h to resume after 1e11 tokens"), lines


def test_data_loader_quick_prints_the_table_and_both_key_lines():
    lines = _run("data_loader.py", "--quick")
    for degree in (1, 8, 64, 512, 4096):
        assert any(line.startswith(f"| loader tokens/s, rank 0 of dp {degree} |") for line in lines), lines
    assert any(line.startswith("| BPE 8k: prepare / baseline |") for line in lines), lines
    ratio_line, seek_line = lines[-2:]
    assert ratio_line.startswith("loader tokens/s dp4096/dp1 = ") and ratio_line.endswith(" (target >= 0.9)"), lines
    assert seek_line.startswith("resume seek at 1e11 tokens = ") and seek_line.endswith(" ms (target <= 10)"), lines
    float(ratio_line.split(" = ")[1].split()[0])
    float(seek_line.split(" = ")[1].split()[0])


def test_cpu_scaling_quick_prints_each_repeat_and_the_median():
    lines = _run("cpu_scaling.py", "--quick", "--processes", "2")
    assert any(line.startswith("repeat 1: 1 process ") for line in lines), lines
    assert lines[-1].startswith("2-process scaling of a pure-Python integer loop = "), lines
    float(lines[-1].split(" = ")[1].split("x")[0])  # a number, whatever its value


def test_convert_quick_prints_every_row_and_the_ratios():
    lines = _run("convert.py", "--quick")
    for title in ("ours (", "ours with DCP's reader", "torchtitan: dcp.load + HuggingFaceStorageWriter"):
        assert any(line.startswith(f"| {title}") for line in lines), lines
    dcp_reader, torchtitan, throughput, memory = lines[-4:]
    assert dcp_reader.startswith("time ours / dcp-reader = "), lines
    assert torchtitan.startswith("time ours / torchtitan = "), lines
    assert throughput.startswith("throughput ratio convert/copy = "), lines
    assert memory.startswith("peak RSS / largest shard = "), lines
    for line in lines[-4:]:
        float(line.split(" = ")[1].split(";")[0].split()[0])


def test_exit_aborts_counts_the_runs_of_an_ending():
    (line,) = _run("exit_aborts.py", "--runs", "1", "--only", "exit_process", fork_ranks=False)
    assert line.startswith("exit_process: 0 aborts in 1 runs (0 other failures), "), line


def test_pipeline_quick_prints_each_schedule_and_micro_batch_count_and_the_ratios():
    lines = _run("pipeline.py", "--quick")
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and line.split(" | ")[1].isdigit()]
    schedules = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
    assert [(row[0], row[1]) for row in rows] == [(f"| {name}", "2") for name in schedules], lines
    # The predicted bubble at p = m = 2: GPipe and 1F1B (p - 1) / (m + p - 1); Interleaved1F1B
    # one round of 2 through 4 stages, 1/5; ZBV tests/test_pipeline_bubble.py's hand-worked 2/14.
    predicted = ["33.3%", "33.3%", "20.0%", "14.3%"]
    assert [row[2].split(" / ")[0] for row in rows] == predicted, lines
    for row in rows:
        float(row[2].split(" / ")[1].rstrip("%")), float(row[7])  # the measured bubble, the ratio
        tracked = not row[0].endswith("ZBVZeroBubble")  # the split backward's memory is not tracked
        assert all(cell.count(" = ") == tracked for cell in row[8:10]), lines
    for name, line in zip(schedules, lines[-4:], strict=True):
        assert line.startswith(f"measured / predicted step time, PP 2 {name}, m = 2: "), lines
        [float(ratio) for ratio in line.split(": ")[1].split(", ")]


def test_moe_quick_checks_both_paths_and_prints_the_ratios():
    lines = _run("moe.py", "--quick")
    # bf16 weights and tokens, and float32 ones under autocast: a row and a ratio line each.
    for precision, name in (("bf16", "bf16"), ("autocast", "autocast bf16")):
        (row,) = [line.rstrip(" |").split(" | ") for line in lines if line.startswith(f"| {precision} | 8 | 2 | 64 |")]
        assert float(row[-1]) <= 2e-2, row  # the check's largest grouped-vs-loop difference
        (gemm,) = [line for line in lines if line.startswith(f"loop / grouped forward+backward time, {name}: ")]
        assert gemm.endswith(" (experts/top-k/dim/hidden/tokens: 8/2/64/64/256)"), lines
        assert float(gemm.split(": ")[1].split()[0]) == float(row[-2]), lines
    # The all-to-all half: its bytes were checked against the routing (else exit 1); a plain and
    # a checkpointed row per rank, and the measured / estimated ratio of each rank.
    rows = [line.rstrip(" |").split(" | ") for line in lines if line.startswith(("| 0 | ", "| 1 | "))]
    assert [row[1] for row in rows[:4]] == ["plain", "checkpointed"] * 2, lines
    (a2a,) = [
        line for line in lines if line.startswith("measured / estimated all-to-all bytes, EP 2 on 2 gloo ranks: ")
    ]
    ratios = [float(ratio) for ratio in a2a.split(": ")[1].split(" (")[0].split(", ")]
    # Bytes are deterministic (seeded routing); an even load would give 1, random routing is near it.
    assert len(ratios) == 2 and all(0.8 < ratio < 1.2 for ratio in ratios), lines
    # Under TP 2 each rank routes half of the sequence (the split layer's output was checked
    # against the whole layer's, else exit 1): half the expert rows, about half the bytes.
    (tp,) = [line for line in lines if line.startswith("before / after per rank, TP 2 with EP 2 over its ranks: ")]
    assert tp.endswith(" (rank 0, rank 1; shape 8/2/64/64/256)"), lines
    rows_part, bytes_part = tp.split(": ", 1)[1].split(" (")[0].split("; ")
    rows_ratios = rows_part.removeprefix("expert rows ").split(", ")
    bytes_ratios = bytes_part.removeprefix("all-to-all bytes ").split(", ")
    assert [float(ratio) for ratio in rows_ratios] == [2.0, 2.0], lines
    assert all(1.8 < float(ratio) < 2.2 for ratio in bytes_ratios), lines
    # The estimator's Qwen3-30B-A3B table: each TP degree's figures 1/tp of TP 1's.
    table = [line.rstrip(" |").split(" | ") for line in lines if line.startswith(("| 2 | ", "| 4 | ", "| 8 | "))]
    assert [float(row[5]) for row in table[-3:]] == [2.0, 4.0, 8.0], lines


def test_moe_check_rejects_a_wrong_grouped_kernel(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import moe as moe_benchmark

    real_grouped_mm = torch._grouped_mm

    def rows_shifted_by_one(*args, **kwargs):  # as fast as the real kernel, but wrong
        return real_grouped_mm(*args, **kwargs).roll(1, dims=0)

    monkeypatch.setattr(torch, "_grouped_mm", rows_shifted_by_one)
    shape = moe_benchmark.parse_shape("8,2,64,64,256")
    with pytest.raises(SystemExit) as exit_info:
        moe_benchmark.check(*moe_benchmark.build(shape), shape)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.startswith(
        "moe benchmark: check failed: shape 8/2/64/64/256, bf16: output differs between grouped and loop by "
    )


def test_moe_balance_quick_prints_each_setting_and_the_loads():
    lines = _run("moe_balance.py", "--quick")
    trained = ("none", "aux@0.001", "lb@0.001", "bias_sigmoid_seq")
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in trained}
    assert list(rows) == list(trained), lines
    # The same model, seed and batches: the first step routes alike in every setting.
    assert len({row[1] for row in rows.values()}) == 1, lines
    # step 1, first and last window, the largest after the first window: 4 experts, top 2
    assert all(1 <= float(value) <= 2 for row in rows.values() for value in row[1:5]), lines
    assert rows["none"][7] == "1.0000" and all(0.9 < float(row[7]) < 1.1 for row in rows.values()), lines
    assert lines[-2].startswith("max/mean expert load, mean of the last 2 steps: none "), lines
    # The last window under the correction that balances it: a load like the others.
    assert all(1 <= float(row[8]) <= 2 for row in rows.values()), lines
    # The bias setting's spread after each step: the bias moves each expert by its rate
    # (1e-3) a step, so after k steps two experts are at most 2k x 1e-3 apart (printed to 3
    # decimals), and by the end some are apart.
    spreads = [float(value) for value in next(line for line in lines if "bias spread" in line).split(":")[1].split()]
    assert len(spreads) == 4 and spreads[-1] > 0, lines
    assert all(spread <= 2e-3 * step + 5e-4 for step, spread in enumerate(spreads, start=1)), lines
    # Every other setting the issue lists (each loss at two weights, the bias on either
    # router) planned its run: its keys fit the model.
    assert lines[-1] == "settings planned without training: 9 of 13", lines


def test_window_balanced_load_removes_what_the_steps_share_and_keeps_what_each_step_has_alone():
    """4 experts, top 2, softmax. Every step favouring experts 0 and 1 alike is undone by a
    constant correction (load near 1); steps that favour 0 and 1, then 2 and 3, in turn are
    balanced taken together with no correction, and each step keeps its load (near 2)."""
    from titanlite.models.moe import MoEArgs

    benchmark = load_script(BENCHMARKS / "moe_balance.py")
    args = MoEArgs(dim=8, hidden_dim=8, n_experts=4, top_k=2, score_func="softmax")
    layer = torch.nn.Module()
    layer.args = args
    noise = torch.randn(6, 256, 4, generator=torch.Generator().manual_seed(0))
    favour_01 = torch.tensor([3.0, 3.0, 0.0, 0.0])

    def window_of(*steps: torch.Tensor):
        kept = benchmark.WindowLogits(torch.nn.Module(), window=len(steps))
        kept.layers, kept.steps = [layer], [list(steps)]
        return kept

    shared = window_of(*(noise[step] + favour_01 for step in range(6)))
    assert benchmark.window_balanced_load(shared) < 1.2
    assert float(benchmark.step_load(shared.steps[0][0], args, torch.zeros(4)).max() / 128) > 1.8
    alternating = window_of(*(noise[step] + favour_01.roll(2 * (step % 2)) for step in range(6)))
    assert benchmark.window_balanced_load(alternating) > 1.8


def test_context_parallel_prints_each_layout_against_its_estimate_and_the_ratios():
    lines = _run("context_parallel.py", "--seq-len", "64", "--steps", "2")
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "MiB" not in line]
    layouts = ["1 rank at S/c = 32", "CP 2 at S = 64", "1 rank at S = 64", "FSDP 2 at S/c = 32"]
    assert [row[0].strip() for row in rows] == layouts, lines
    # Every figure and ratio is a positive number (each layout ran, and the estimator answered).
    assert all(float(cell.replace(",", "")) > 0 for row in rows for cell in row[1:]), lines
    ratios = [line for line in lines if line.startswith(("memory: CP 2 at S /", "step time: CP 2 at S /"))]
    assert len(ratios) == 4 and all(float(line.rsplit("=", 1)[1]) > 0 for line in ratios), lines
    # Each CP rank's attention work, counted at the dispatcher, is half its [S/2, S] rectangle.
    shares = next(line for line in lines if line.startswith("attention work per rank") and "(CP 2" in line)
    assert shares.rsplit(":", 1)[1].split(",") == [" 0.500", " 0.500"], lines
    against_fsdp = next(line for line in lines if line.startswith("CPU seconds a step, CP 2 at S / FSDP 2 at S/c"))
    assert float(against_fsdp.split(" = ")[1].split()[0]) > 0, lines


class _ForkedTrainer:
    """What benchmarks/fault_tolerance.py uses of its Popen (pid, poll, wait), for a training
    process forked from the preloaded fork server (tests/forked_scripts.py)."""

    def __init__(self, process):
        self.process, self.pid = process, process.pid

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        return self.process.exitcode


def test_fault_tolerance_quick_times_both_failures_and_prints_the_ratio(monkeypatch, capsys):
    """In this process, its training processes forked from the preloaded fork server instead
    of started by Popen: the 7 of them would otherwise import torch and titanlite each."""
    benchmark = load_script(BENCHMARKS / "fault_tolerance.py")

    def launch(args, log, env=None):
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        process = start_python(["-m", "titanlite.train", *args], cwd=REPO_ROOT, env=environ, stdout=log, stderr=None)
        return _ForkedTrainer(process)

    monkeypatch.setattr(benchmark, "launch", launch)
    assert benchmark.main(["--quick"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert any(line.startswith("| restart |") for line in lines), lines
    assert lines[-1].startswith("time lost to one failure: torchft ") and " ratio " in lines[-1], lines


def test_object_storage_saves_and_loads_locally_and_in_s3_and_prints_the_ratios():
    lines = _run("object_storage.py", "--gib", "0.01", "--repeats", "1", timeout=120)
    rows = [line.split(" | ") for line in lines if line.startswith(("| local |", "| S3 (moto)"))]
    assert [row[0] for row in rows] == ["| local", "| S3 (moto)", "| S3 (moto), one s3fs stream, no DCP"], lines
    assert all(float(cell) > 0 for row in rows for cell in row[1:5]), lines
    # The server counted the requests: the S3 save wrote objects and the load read them.
    assert "PUT" in rows[1][5] and "GET" in rows[1][6] and rows[1][6].endswith("GB fetched |"), lines
    save, load = lines[-2:]
    assert save.startswith("save time S3 / local = ") and load.startswith("load time S3 / local = "), lines
    float(save.split(" = ")[1]), float(load.split(" = ")[1])
