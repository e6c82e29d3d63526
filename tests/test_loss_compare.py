"""The loss comparison: titanlite/metrics/compare.py on made-up series, and
scripts/loss_compare.py end to end on the debug model (a few tiny steps per side), with the
bad-input cases that must end in one line and exit status 2."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from tests.forked_scripts import run_python
from tests.s3_server import BUCKET, s3_server
from titanlite.checkpoint.files import commit
from titanlite.metrics import tags
from titanlite.metrics.compare import (
    FORMAT,
    LossSeries,
    compare,
    format_table,
    read_series,
    series_from_jsonl,
    write_series,
)
from titanlite.storage import location

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "loss_compare.py"
# Tiny sides: 3 steps of 2 x 32 tokens per rank, a global batch of 4 sequences whatever the
# launch size (2 ranks: 2 x 2; 1 rank: 2 accumulation steps of 2).
TINY_COMMON = "--training.local_batch_size 2 --training.seq_len 32 --training.global_batch_size 4"
TINY = ["--steps", "3", "--common", TINY_COMMON]
# The launch that compares layouts: deepseek_v3 debugmodel (MoE) over 2 ranks with expert
# parallelism 2, which composes FSDP 2 for the dense parts, against one process.
EP_TINY = ["--steps", "3", "--common", f"{TINY_COMMON} --model.name deepseek_v3 --model.flavor debugmodel"]
EP2 = ["--a-ranks", "2", "--a", "--parallelism.expert_parallel_degree 2"]
# FSDP and EP over 2 ranks against one process: the same sums in another order. Loss and grad norm
# agree to about 1e-6 relative (docs/metrics.md); the acceptance asks for 1e-5.
LAYOUT_TOLERANCE = ["--rtol", "1e-5"]


def series(loss, grad_norm=None, first=1, source=None) -> LossSeries:
    steps = list(range(first, first + len(loss)))
    return LossSeries(steps, list(loss), list(grad_norm or [1.0] * len(loss)), dict(source or {}))


# --- the file formats ----------------------------------------------------------------------


def test_a_loss_file_reads_back_bit_for_bit(tmp_path):
    original = series(
        [0.1 + 0.2, 7.123456789012345, 5e-324, math.nan, math.inf], [1 / 3, -math.inf, 2.0, 1e300, 0.0], first=4
    )
    original.source = {"config": "train_configs/debug_model.toml", "overrides": ["--optimizer.lr", "3e-3"]}
    path = tmp_path / "losses.json"
    write_series(original, path)

    document = json.loads(path.read_text())  # plain JSON: no NaN or Infinity tokens
    assert document["format"] == FORMAT and document["loss"][3] == "NaN" and document["grad_norm"][1] == "-Infinity"
    again = read_series(path)
    assert again.steps == original.steps and again.source == original.source
    assert [x.hex() for x in again.loss] == [x.hex() for x in original.loss]
    assert [x.hex() for x in again.grad_norm] == [x.hex() for x in original.grad_norm]
    assert [p.name for p in tmp_path.iterdir()] == ["losses.json"]  # no temporary file left


@pytest.mark.parametrize(
    "text, expected",
    [
        ("not json", "not a loss file (not JSON)"),
        ('{"format": "other/1"}', "not a loss file (format 'other/1', expected 'titanlite-losses/1')"),
        ('{"format": "titanlite-losses/1", "steps": [1, 2], "loss": [1.0], "grad_norm": [1.0, 2.0]}', "2 steps but 1"),
        ('{"format": "titanlite-losses/1", "steps": [1, 3], "loss": [1, 2], "grad_norm": [1, 2]}', "not consecutive"),
        ('{"format": "titanlite-losses/1", "steps": [1], "loss": ["x"], "grad_norm": [1]}', "entry 0 is 'x'"),
    ],
)
def test_a_bad_loss_file_is_one_line_naming_it(tmp_path, text, expected):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        read_series(path)
    message = str(error.value)
    assert message.startswith(str(path)) and expected in message and "\n" not in message


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_series_from_a_metrics_jsonl(tmp_path):
    records = [{"step": s, tags.LOSS: 8.0 - s, tags.GRAD_NORM: 1.0 + s, tags.LR: 1e-3} for s in (1, 2, 3)]
    # A run resumed into the same folder logs step 3 again: the later record is the one it went on from.
    records.append({"step": 3, tags.LOSS: 4.5, tags.GRAD_NORM: 9.0})
    records.append({"step": 3, tags.VAL_LOSS: 6.0})  # validation at the same step
    got = series_from_jsonl(_jsonl(tmp_path / "metrics.jsonl", records))
    assert (got.steps, got.loss, got.grad_norm) == ([1, 2, 3], [7.0, 6.0, 4.5], [2.0, 3.0, 9.0])


@pytest.mark.parametrize(
    "records, expected",
    [
        ([{"step": s, tags.LOSS: 1.0, tags.GRAD_NORM: 1.0} for s in (1, 3)], "step 2 is missing"),
        ([{"step": 1, tags.LOSS: 1.0}], f"line 1 (step 1) has no number '{tags.GRAD_NORM}'"),
        ([], "no training step logged"),
    ],
)
def test_a_metrics_jsonl_with_a_gap_or_a_missing_key_is_refused(tmp_path, records, expected):
    path = _jsonl(tmp_path / "metrics.jsonl", records)
    with pytest.raises(ValueError) as error:
        series_from_jsonl(path)
    assert str(error.value).startswith(str(path)) and expected in str(error.value)


# --- comparing ---------------------------------------------------------------------------


def test_identical_series_are_bit_exact_and_one_ulp_is_not():
    a = series([8.0, 7.5, 7.25], [3.0, 2.0, 1.0])
    assert compare(a, series(a.loss, a.grad_norm)).equal

    nudged = series([8.0, math.nextafter(7.5, 8.0), 7.0], [3.0, 2.0, 1.0])
    exact = compare(a, nudged)
    assert not exact.equal and exact.first_beyond == 2 and exact.loss.first_beyond == 2
    assert exact.grad_norm.equal
    assert (exact.loss.max_abs_diff, exact.loss.max_diff_step) == (0.25, 3)
    assert exact.loss.rows[2].diff == -0.25 and exact.loss.rows[2].rel == 0.25 / 7.25


def test_tolerances_decide_the_first_step_beyond_them():
    a = series([10.0, 10.0, 10.0, 10.0])
    b = series([10.0, 10.00001, 10.001, 10.1])
    assert compare(a, b, rtol=1e-7).first_beyond == 2
    assert compare(a, b, atol=1e-4).first_beyond == 3
    assert compare(a, b, rtol=1e-3, atol=1e-3).first_beyond == 4  # 1e-3 + 1e-3 * 10.1 < 0.1
    assert compare(a, b, atol=0.1).equal
    # The rule is symmetric: swapping the sides never changes the verdict.
    assert compare(b, a, rtol=1e-7).first_beyond == 2


def test_nan_counts_as_equal_only_against_nan_at_the_same_step():
    a = series([1.0, math.nan, math.inf, 1.0])
    assert compare(a, series([1.0, math.nan, math.inf, 1.0])).equal
    one_sided = compare(a, series([1.0, 2.0, math.inf, math.nan]), atol=10.0)
    assert one_sided.first_beyond == 2 and one_sided.loss.max_abs_diff == math.inf
    assert [r.beyond for r in one_sided.loss.rows] == [False, True, False, True]
    assert not compare(series([math.inf]), series([-math.inf])).equal


def test_runs_of_different_lengths_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"A has 20 steps \(1\.\.20\), B 30 steps \(1\.\.30\)"):
        compare(series([1.0] * 20), series([1.0] * 30))
    with pytest.raises(ValueError, match=r"A has 2 steps \(1\.\.2\), B 2 steps \(3\.\.4\)"):
        compare(series([1.0, 1.0]), series([1.0, 1.0], first=3))


def test_the_table_shows_every_step_and_the_verdict():
    text = format_table(compare(series([8.0, 7.0]), series([8.0, 6.5]), atol=0.1))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["step", "loss", "A"]
    assert lines[1].split()[:3] == ["1", "8.00000000", "8.00000000"] and not lines[1].endswith("*")
    assert lines[2].split()[:4] == ["2", "7.00000000", "6.50000000", "-5.00e-01"] and lines[2].endswith("*")
    assert "loss: largest difference 5.000e-01 at step 2, first beyond tolerance at step 2" in text
    assert "grad_norm: largest difference 0.000e+00 at step 1, within tolerance at every step" in text
    assert "first step beyond tolerance (rtol 0, atol 0.1): 2 (loss)" in text


# --- the command, in this process: the input checks, with the training replaced ----------


def _load_script():
    spec = importlib.util.spec_from_file_location("loss_compare_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script_with_fake_runs(monkeypatch):
    """The script, with every side's run replaced by a 3-step series, made-up resolved
    settings, and no seed checkpoint written."""
    script = _load_script()
    settings = {key: f"value of {key}" for key in script.MUST_MATCH_SETTINGS}

    def fake_run(side, args, out, seed_checkpoint, side_settings):
        source = {"config": script.DEFAULT_CONFIG, "settings": side_settings, "ranks": side.ranks}
        return series([8.0, 7.0, 6.0], [3.0, 2.0, 1.0], source=source)

    monkeypatch.setattr(script, "resolved_settings", lambda args, side: (dict(settings), 3))
    monkeypatch.setattr(script, "run_side", fake_run)
    monkeypatch.setattr(script, "write_seed_checkpoint", lambda args, folder: None)
    return script, settings


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_imported_reference_of_another_length_or_config_is_refused(script_with_fake_runs, tmp_path, capsys):
    script, settings = script_with_fake_runs
    reference = tmp_path / "reference.json"
    source = {"config": script.DEFAULT_CONFIG, "settings": settings}
    write_series(series([8.0, 7.0], source=source), reference)
    assert script.main(["--import", str(reference), "--out", str(tmp_path / "1")]) == 2
    assert (
        _error_line(capsys)
        == "loss_compare: error: the runs cover different steps: A has 3 steps (1..3), B 2 steps (1..2)"
    )
    assert not (tmp_path / "1").exists()  # refused before anything trained or was written

    write_series(
        series([8.0, 7.0, 6.0], source={**source, "settings": {**settings, "training.seq_len": 64}}), reference
    )
    assert script.main(["--import", str(reference), "--out", str(tmp_path / "2")]) == 2
    assert _error_line(capsys) == (
        f"loss_compare: error: {reference}: from a run with training.seq_len = 64, "
        "this run has 'value of training.seq_len'"
    )
    write_series(series([8.0, 7.0, 6.0], source={**source, "config": "train_configs/llama7b.toml"}), reference)
    assert script.main(["--import", str(reference), "--out", str(tmp_path / "3")]) == 2
    assert "from config 'train_configs/llama7b.toml', this run uses 'train_configs/debug_model.toml'" in _error_line(
        capsys
    )
    # The same file with matching settings compares: bit-exact here, so exit 0 with --assert-equal.
    write_series(series([8.0, 7.0, 6.0], [3.0, 2.0, 1.0], source=source), reference)
    assert script.main(["--import", str(reference), "--out", str(tmp_path / "4"), "--assert-equal"]) == 0
    assert "equal within tolerance (bit-exact) at all 3 steps" in capsys.readouterr().out


def test_exit_status_follows_the_tolerance_only_when_one_is_asked_for(script_with_fake_runs, tmp_path, monkeypatch):
    script, settings = script_with_fake_runs
    reference = tmp_path / "reference.json"
    source = {"config": script.DEFAULT_CONFIG, "settings": settings}
    write_series(series([8.0, 7.0, 6.5], [3.0, 2.0, 1.0], source=source), reference)
    base = ["--import", str(reference)]
    assert script.main([*base, "--out", str(tmp_path / "report")]) == 0  # report only
    assert script.main([*base, "--out", str(tmp_path / "exact"), "--assert-equal"]) == 1
    assert script.main([*base, "--out", str(tmp_path / "atol"), "--atol", "0.5"]) == 0
    assert script.main([*base, "--out", str(tmp_path / "rtol"), "--rtol", "0.01"]) == 1


def test_plot_without_matplotlib_is_one_line(script_with_fake_runs, tmp_path, monkeypatch, capsys):
    script, _ = script_with_fake_runs
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    out = tmp_path / "out"
    assert script.main(["--plot", str(tmp_path / "plot.png"), "--out", str(out)]) == 2
    assert _error_line(capsys) == "loss_compare: error: --plot needs matplotlib: pip install -e '.[plot]'"
    assert not out.exists()  # refused before anything was written


def test_plot_is_a_png_of_both_curves(script_with_fake_runs, tmp_path):
    script, settings = script_with_fake_runs
    reference, png = tmp_path / "reference.json", tmp_path / "plot.png"
    write_series(series([8.0, 7.0, 6.5], source={"config": script.DEFAULT_CONFIG, "settings": settings}), reference)
    assert script.main(["--import", str(reference), "--plot", str(png), "--out", str(tmp_path / "out")]) == 0
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    # IHDR's width and height: the figure's 8 x 6 inches at 120 dots per inch.
    assert (int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")) == (960, 720)


def test_contradicting_options_are_usage_errors(capsys):
    script = _load_script()
    for argv in (["--assert-equal", "--rtol", "1e-5"], ["--import", "x.json", "--b-ranks", "2"], ["--a-ranks", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            script.main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("loss_compare: error: ")


# --- the command end to end: real runs of the debug model ----------------------------------


def run_script(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return run_python([SCRIPT, *args], cwd=cwd, timeout=600)


def _output(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def fsdp_against_one_process(tmp_path_factory):
    """EP 2 x FSDP 2 on deepseek_v3 debugmodel (A, exported) against one process (B), from one
    seed checkpoint."""
    folder = tmp_path_factory.mktemp("loss_compare")
    reference, out = folder / "ep2.json", folder / "out"
    result = run_script(*EP_TINY, *EP2, "--out", str(out), *LAYOUT_TOLERANCE, "--export", str(reference))
    return result, reference, out


def test_expert_parallel_over_two_ranks_equals_one_process(fsdp_against_one_process):
    result, reference, out = fsdp_against_one_process
    assert result.returncode == 0, _output(result)
    assert "equal within tolerance (rtol 1e-05, atol 0) at all 3 steps" in result.stdout, _output(result)
    exported = read_series(reference)
    # ln 258 = 5.55: a byte-level model at its start.
    assert exported.steps == [1, 2, 3] and all(4.5 < loss < 7 for loss in exported.loss), exported.loss
    assert exported.source["ranks"] == 2 and exported.source["config"] == "train_configs/debug_model.toml"
    assert "--parallelism.expert_parallel_degree" in exported.source["overrides"], exported.source
    assert exported.source["settings"]["model.name"] == "deepseek_v3", exported.source
    assert exported.source["settings"]["training.global_batch_size"] == 4 and exported.source["seed_checkpoint"]
    # Both sides started from the seed checkpoint and logged TensorBoard events side by side.
    for side in ("a", "b"):
        assert "loaded checkpoint" in (out / side / "train.log").read_text()
        assert list((out / "tb" / side).glob("*/events.out.tfevents.*")), sorted(out.rglob("*"))


def test_a_learning_rate_change_differs_from_step_2(fsdp_against_one_process, tmp_path):
    _, reference, out = fsdp_against_one_process
    with s3_server():
        # The reference's seed checkpoint, read from a bucket: a seed given by URL.
        seed = f"s3://{BUCKET}/seed/step-0"
        fsspec.filesystem("s3", skip_instance_cache=True).put(f"{out}/seed/step-0/", seed, recursive=True)
        commit(location(seed))
        result = run_script(
            *EP_TINY,
            *("--a", "--optimizer.lr 1e-2", "--import", str(reference), "--out", str(tmp_path), *LAYOUT_TOLERANCE),
            "--loss-only",  # the verdict of the loss alone, which the learning rate moves from step 2
            *("--seed-checkpoint", seed),
        )
    assert f"loaded checkpoint {seed}" in (tmp_path / "a" / "train.log").read_text()
    assert result.returncode == 1, _output(result)
    # Step 1 runs before the first update: the learning rate shows from step 2 on.
    assert "loss: largest difference " in result.stdout, _output(result)
    assert ", first beyond tolerance at step 2\n" in result.stdout.split("loss: largest difference ")[1]
    assert "the loss alone decides (--loss-only): different" in result.stdout


def _git_state(repo: Path) -> list[str]:
    commands = (["status", "--porcelain"], ["rev-parse", "HEAD"], ["worktree", "list"], ["branch", "--list"])
    return [subprocess.run(["git", "-C", str(repo), *c], capture_output=True, text=True).stdout for c in commands]


# The throwaway commit's one change: a warmup twice as steep. TINY's 3 steps are all in the
# debug config's warmup, so every update is larger; step 1's loss and grad norm come before any
# update and cannot move.
WARMUP = "return (step + 1) / (warmup + 1)"
STEEPER_WARMUP = "return 2 * (step + 1) / (warmup + 1)"


def _commit_steeper_warmup(clone: Path) -> None:
    schedule_file = clone / "titanlite" / "optim" / "__init__.py"
    code = schedule_file.read_text()
    assert code.count(WARMUP) == 1, f"the throwaway change no longer applies to {schedule_file}: change another line"
    schedule_file.write_text(code.replace(WARMUP, STEEPER_WARMUP))
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", "-C", str(clone), *identity, "commit", "-qam", "throwaway: a steeper warmup"], check=True)


def test_a_commit_side_runs_its_own_code_in_a_worktree_and_leaves_the_checkout_alone(
    fsdp_against_one_process, tmp_path
):
    """Side A is a throwaway commit whose code changes the learning rate; side B the checkout's
    own run. They must agree at step 1 and differ from step 2: had the script run the
    checkout's code for the commit, the sides would agree throughout."""
    _, reference, _ = fsdp_against_one_process
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True)
    _commit_steeper_warmup(clone)
    (clone / "untracked.txt").write_text("the user's own file\n")
    before = _git_state(clone)
    head, side_a = before[1].strip(), tmp_path / "side_a.json"
    result = run_script(
        *EP_TINY,
        *("--repo", str(clone), "--config", str(clone / "train_configs" / "debug_model.toml")),
        *("--a-commit", "HEAD", "--import", str(reference), "--export", str(side_a), "--out", str(tmp_path / "out")),
        *LAYOUT_TOLERANCE,
        "--no-seed-checkpoint",
    )
    assert result.returncode == 1, _output(result)  # beyond the tolerance
    assert f"side A: 1 rank(s), commit {head[:10]}" in result.stdout
    assert "first step beyond tolerance (rtol 1e-05, atol 0): 2 (loss and grad_norm)" in result.stdout, _output(result)
    assert read_series(side_a).source["commit"] == head
    assert _git_state(clone) == before and (clone / "untracked.txt").read_text() == "the user's own file\n"


def test_an_unknown_commit_is_one_line(tmp_path):
    result = run_script("--b-commit", "no-such-revision", "--out", str(tmp_path / "out"))
    assert result.returncode == 2, _output(result)
    assert result.stderr.strip() == (
        f"loss_compare: error: --b-commit no-such-revision: not a commit of the repository {REPO_ROOT}"
    )
    assert not (tmp_path / "out").exists()


def test_a_side_that_fails_to_start_is_named_with_the_trainers_error(tmp_path):
    result = run_script(
        *TINY, "--no-seed-checkpoint", "--a", "--checkpoint.initial_load_path /no/such/step-0", "--out", str(tmp_path)
    )
    assert result.returncode == 2, _output(result)
    line = result.stderr.strip()
    assert "\n" not in line, _output(result)
    assert line.startswith("loss_compare: error: side A failed (exit "), line
    assert "titanlite: checkpoint error: checkpoint.initial_load_path /no/such/step-0" in line
    assert line.endswith(f"(log: {tmp_path / 'a' / 'train.log'})")
