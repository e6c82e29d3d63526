"""Per-step losses of two runs, side by side: did a change move the numbers?

A ``LossSeries`` is one run's loss and gradient norm at every step, with a ``source`` dict
saying what produced it (config, overrides, ranks, commit, versions, device). It is read
from a trainer's ``metrics.jsonl`` (logged every step, ``--metrics.log_freq 1``) or from a
loss file this module writes (format ``titanlite-losses/1``: JSON with "format",
"source", "steps", "loss", "grad_norm"). ``compare`` lines two series up step by step
against a tolerance; ``format_table`` prints the result. scripts/loss_compare.py and the
committed reference losses of the tests are built on it.

Tolerance: a value pair (a, b) is equal when ``|a - b| <= atol + rtol * max(|a|, |b|)``
(symmetric, so swapping the sides never changes the verdict); rtol = atol = 0 asks for
the same float, bit for bit. Non-finite values: NaN against NaN at the same step is equal
(both runs broke down at the same step, as a bit-exact rerun of a diverging run does),
and so are equal infinities; NaN or an infinity against anything else is a difference of
infinite size.
"""

import dataclasses
import json
import math
from pathlib import Path

from titanlite.files import write_text_atomically
from titanlite.metrics import tags

FORMAT = "titanlite-losses/1"
# The JSON text standard has no NaN or infinities: a loss file spells them as these strings.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclasses.dataclass
class LossSeries:
    """One run's loss and gradient norm at each of ``steps`` (consecutive optimizer steps)."""

    steps: list[int]
    loss: list[float]
    grad_norm: list[float]
    # What produced the numbers: config file, overrides (list[str]), ranks, commit, torch
    # version, python version, device. Free-form for a series read from metrics.jsonl.
    source: dict = dataclasses.field(default_factory=dict)

    def describe_steps(self) -> str:
        """'20 steps (1..20)': how a message names the steps a series holds."""
        if not self.steps:
            return "no steps"
        return f"{len(self.steps)} steps ({self.steps[0]}..{self.steps[-1]})"


# --- reading and writing -----------------------------------------------------------------


def series_from_jsonl(path) -> LossSeries:
    """The loss and grad norm of every step a trainer's metrics.jsonl logged. The steps must
    be consecutive (the run logged every step); a step logged twice (a run resumed into the
    same folder repeats the steps after its checkpoint) keeps its later record, the one the
    resumed run continued from. ValueError, one line naming the file, otherwise."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"{path}: cannot read the metrics file ({error.strerror})") from None
    by_step: dict[int, tuple[float, float]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}: line {number} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}: line {number} has no integer 'step'")
        if tags.LOSS not in record and tags.GRAD_NORM not in record:
            continue  # a validation-only record (logged at a step whose training line came earlier)
        for key in (tags.LOSS, tags.GRAD_NORM):
            if not isinstance(record.get(key), (int, float)):
                raise ValueError(f"{path}: line {number} (step {record['step']}) has no number '{key}'")
        by_step[record["step"]] = (float(record[tags.LOSS]), float(record[tags.GRAD_NORM]))
    if not by_step:
        raise ValueError(f"{path}: no training step logged")
    steps = sorted(by_step)
    missing = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
    if missing:
        raise ValueError(
            f"{path}: step {missing[0]} is missing (steps {steps[0]}..{steps[-1]} logged "
            f"{len(steps)} times); log every step with --metrics.log_freq 1"
        )
    return LossSeries(steps, [by_step[s][0] for s in steps], [by_step[s][1] for s in steps])


def _to_json_number(value: float):
    return value if math.isfinite(value) else {math.inf: "Infinity", -math.inf: "-Infinity"}.get(value, "NaN")


def write_series(series: LossSeries, path) -> None:
    """Write ``series`` as a loss file, atomically: a temporary file in the same folder,
    renamed over ``path`` once complete. Finite floats are JSON numbers in their shortest
    repr, which reads back as the same float bit for bit."""
    path = Path(path)
    document = {
        "format": FORMAT,
        "source": series.source,
        "steps": list(series.steps),
        "loss": [_to_json_number(v) for v in series.loss],
        "grad_norm": [_to_json_number(v) for v in series.grad_norm],
    }
    text = json.dumps(document, indent=1, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, text)


def _floats(document: dict, key: str, path: Path) -> list[float]:
    values = document.get(key)
    if not isinstance(values, list):
        raise ValueError(f"{path}: '{key}' is not a list")
    floats = []
    for index, value in enumerate(values):
        if isinstance(value, str) and value in _NON_FINITE:
            value = _NON_FINITE[value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: '{key}' entry {index} is {value!r}, not a number")
        floats.append(float(value))
    return floats


def read_series(path) -> LossSeries:
    """A loss file written by write_series; ValueError, one line naming the file, for a
    missing, unreadable or foreign file."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"{path}: cannot read the loss file ({error.strerror})") from None
    except ValueError:
        raise ValueError(f"{path}: not a loss file (not JSON)") from None
    found = document.get("format") if isinstance(document, dict) else None
    if found != FORMAT:
        raise ValueError(f"{path}: not a loss file (format {found!r}, expected {FORMAT!r})")
    steps = document.get("steps")
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValueError(f"{path}: 'steps' is not a list of integers")
    loss, grad_norm = _floats(document, "loss", path), _floats(document, "grad_norm", path)
    if not len(steps) == len(loss) == len(grad_norm):
        raise ValueError(f"{path}: {len(steps)} steps but {len(loss)} loss and {len(grad_norm)} grad_norm values")
    if not steps:
        raise ValueError(f"{path}: the loss file holds no steps")
    if steps != list(range(steps[0], steps[0] + len(steps))):
        raise ValueError(f"{path}: the steps are not consecutive ({steps[0]}..{steps[-1]} in {len(steps)} entries)")
    source = document.get("source", {})
    if not isinstance(source, dict):
        raise ValueError(f"{path}: 'source' is not an object")
    return LossSeries(steps, loss, grad_norm, source)


# --- comparing ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One step of one metric: A's and B's values, B - A, and |B - A| relative to max(|A|, |B|)."""

    step: int
    a: float
    b: float
    diff: float
    rel: float
    beyond: bool  # outside the tolerance


def _same_non_finite(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (math.isinf(a) and a == b)


def _row(step: int, a: float, b: float, rtol: float, atol: float) -> Row:
    if _same_non_finite(a, b):
        return Row(step, a, b, 0.0, 0.0, False)
    if not (math.isfinite(a) and math.isfinite(b)):
        return Row(step, a, b, math.inf, math.inf, True)
    diff, scale = b - a, max(abs(a), abs(b))
    rel = abs(diff) / scale if scale > 0 else 0.0
    return Row(step, a, b, diff, rel, abs(diff) > atol + rtol * scale)


@dataclasses.dataclass(frozen=True)
class MetricComparison:
    """One metric (loss or grad norm) of two series, step by step."""

    name: str
    rows: list[Row]

    @property
    def max_abs_diff(self) -> float:
        return max((abs(r.diff) for r in self.rows), default=0.0)

    @property
    def max_diff_step(self) -> int | None:
        """The first step where |diff| is largest (None: no rows)."""
        largest = self.max_abs_diff
        return next((r.step for r in self.rows if abs(r.diff) == largest), None)

    @property
    def first_beyond(self) -> int | None:
        """The first step outside the tolerance; None when every step is within it."""
        return next((r.step for r in self.rows if r.beyond), None)

    @property
    def equal(self) -> bool:
        return self.first_beyond is None


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Loss and grad norm of series A and B at the same steps, against one tolerance."""

    loss: MetricComparison
    grad_norm: MetricComparison
    rtol: float
    atol: float

    @property
    def steps(self) -> list[int]:
        return [r.step for r in self.loss.rows]

    @property
    def first_beyond(self) -> int | None:
        """The first step where the loss or the grad norm is outside the tolerance."""
        firsts = [s for s in (self.loss.first_beyond, self.grad_norm.first_beyond) if s is not None]
        return min(firsts, default=None)

    @property
    def equal(self) -> bool:
        return self.first_beyond is None

    @property
    def bit_exact(self) -> bool:
        return self.rtol == 0 and self.atol == 0


def compare(a: LossSeries, b: LossSeries, rtol: float = 0.0, atol: float = 0.0) -> Comparison:
    """A against B at every step; both must hold the same steps (ValueError, one line, when
    not). rtol = atol = 0 asks for bit-exact equality."""
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ValueError(f"tolerances must be >= 0 (rtol {rtol}, atol {atol})")
    if a.steps != b.steps:
        raise ValueError(f"the runs cover different steps: A has {a.describe_steps()}, B {b.describe_steps()}")

    def metric(name: str, values_a: list[float], values_b: list[float]) -> MetricComparison:
        rows = [_row(s, x, y, rtol, atol) for s, x, y in zip(a.steps, values_a, values_b, strict=True)]
        return MetricComparison(name, rows)

    return Comparison(metric("loss", a.loss, b.loss), metric("grad_norm", a.grad_norm, b.grad_norm), rtol, atol)


# --- printing ----------------------------------------------------------------------------


def _tolerance(c: Comparison) -> str:
    return "bit-exact" if c.bit_exact else f"rtol {c.rtol:g}, atol {c.atol:g}"


def summary_lines(c: Comparison) -> list[str]:
    """The verdict: the largest difference of each metric and where, and the first step
    beyond the tolerance."""
    lines = []
    for metric in (c.loss, c.grad_norm):
        if metric.rows:
            beyond = f"first beyond tolerance at step {metric.first_beyond}"
            if metric.equal:
                beyond = "within tolerance at every step"
            lines.append(
                f"{metric.name}: largest difference {metric.max_abs_diff:.3e} at step {metric.max_diff_step}, {beyond}"
            )
    if c.equal:
        lines.append(f"equal within tolerance ({_tolerance(c)}) at all {len(c.steps)} steps")
    else:
        which = [m.name for m in (c.loss, c.grad_norm) if m.first_beyond == c.first_beyond]
        lines.append(f"first step beyond tolerance ({_tolerance(c)}): {c.first_beyond} ({' and '.join(which)})")
    return lines


def format_table(c: Comparison) -> str:
    """The comparison as text: one row per step (loss and grad norm of A and B, B - A and the
    relative difference; '*' marks a step beyond the tolerance), then the summary lines."""
    header = (
        f"{'step':>5}  {'loss A':>12} {'loss B':>12} {'diff':>10} {'rel':>9}  "
        f"{'gnorm A':>12} {'gnorm B':>12} {'diff':>10} {'rel':>9}"
    )
    lines = [header]
    for loss, norm in zip(c.loss.rows, c.grad_norm.rows, strict=True):
        mark = " *" if loss.beyond or norm.beyond else ""
        lines.append(
            f"{loss.step:>5}  {loss.a:>12.8f} {loss.b:>12.8f} {loss.diff:>+10.2e} {loss.rel:>9.2e}  "
            f"{norm.a:>12.8f} {norm.b:>12.8f} {norm.diff:>+10.2e} {norm.rel:>9.2e}{mark}"
        )
    return "\n".join(lines + summary_lines(c))
