"""The loss comparison: titanlite/metrics/compare.py on made-up series, and
scripts/loss_compare.py end to end on the debug model (a few tiny steps per side), with the
bad-input cases that must end in one line and exit status 2."""

import json
import math
from pathlib import Path

import pytest

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

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "loss_compare.py"
# Tiny sides: 3 steps of 2 x 32 tokens per rank, a global batch of 4 sequences whatever the
# launch size (2 ranks: 2 x 2; 1 rank: 2 accumulation steps of 2).
TINY_COMMON = "--training.local_batch_size 2 --training.seq_len 32 --training.global_batch_size 4"
TINY = ["--steps", "3", "--common", TINY_COMMON]
# FSDP over 2 ranks against one process: the same sums in another order (see docs/metrics.md).
LAYOUT_TOLERANCE = ["--rtol", "1e-5", "--atol", "1e-5"]


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
    assert "largest loss difference: 5.000e-01 at step 2" in text
    assert "first step beyond tolerance (rtol 0, atol 0.1): 2 (loss)" in text
