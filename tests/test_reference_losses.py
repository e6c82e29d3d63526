"""The debug model's first 10 steps, on one process and on FSDP over 2, against the loss
files committed in tests/reference_losses/ (README.md there: how they were made, how to
regenerate them, and why the comparison is bit-exact).

Every run of the module is a job of one launch of 2 rank processes (the `runs` fixture):
the single-process reference on one rank while the other runs most of the perturbed ones (a
changed loss function, initialisation and data order, 3 steps each), then FSDP over both.
"""

import importlib.util
import json
import os
import shlex
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.rank_jobs import Job, run_jobs_on_ranks
from titanlite.config import parse_args
from titanlite.metrics.compare import LossSeries, compare, format_table, read_series
from titanlite.train import Trainer

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO_ROOT / "tests" / "reference_losses"
STEPS = 10


def _load_loss_compare():
    """scripts/loss_compare.py, which writes the files: the test trains with its arguments."""
    spec = importlib.util.spec_from_file_location("loss_compare", REPO_ROOT / "scripts" / "loss_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOSS_COMPARE = _load_loss_compare()


class Reference:
    """A committed loss file and the loss_compare.py command that wrote it: the debug config
    with `overrides` on `ranks` processes, one thread each, trained twice (sides A and B,
    which must agree bit for bit), side A's losses exported."""

    def __init__(self, name: str, ranks: int, overrides: list[str]):
        self.name = name
        self.path = REFERENCE_DIR / f"{name}.json"
        sides = shlex.join(overrides)
        self.script_args = (
            ["--steps", str(STEPS), "--no-seed-checkpoint", "--threads", "1", "--pin-kernels"]
            + ["--a-ranks", str(ranks), "--b-ranks", str(ranks), f"--a={sides}", f"--b={sides}", "--assert-equal"]
            + ["--export", str(self.path.relative_to(REPO_ROOT))]
        )
        self.script = LOSS_COMPARE.parse_command_line(self.script_args)

    def regenerate_command(self) -> str:
        """The command that rewrites the file (README.md: in a commit of its own, with the reason)."""
        return shlex.join(["python", "scripts/loss_compare.py", *self.script_args])

    def expected_source(self) -> dict:
        """What the file's source must say for this module's run to be the one that wrote it."""
        script = self.script
        return {
            "config": LOSS_COMPARE.config_name(script.config, REPO_ROOT),
            "overrides": shlex.split(script.common) + shlex.split(script.a),
            "ranks": script.a_ranks,
            "threads": script.threads,
            "seed_checkpoint": not script.no_seed_checkpoint,
            "pinned_kernels": LOSS_COMPARE.PINNED_KERNELS,
        }

    def trainer_arguments(self, out: str, steps: int = STEPS) -> list[str]:
        """The trainer's command line of the script's side A (the number of steps aside), its
        dump and TensorBoard folders under `out` as under the script's output folder."""
        script = LOSS_COMPARE.parse_command_line([*self.script_args, "--steps", str(steps)])
        side = shlex.split(script.common) + shlex.split(script.a)
        return LOSS_COMPARE.trainer_arguments(script, script.config, side) + LOSS_COMPARE.comparison_settings(
            Path(out), "a", None
        )


# The debug config's 8 x 128 tokens per rank cost ~16 s of CPU for 30 steps on one process and
# twice that on 2 ranks; a global batch of 4 sequences (of the config's 128 tokens) kept the 30
# steps near 21 s of CPU (docs/performance.md), and 10 steps a third of that. Both layouts train
# on the same global batches.
REFERENCES = {
    "1rank": Reference("debug_model_1rank", 1, ["--training.local_batch_size", "4"]),
    "fsdp2": Reference("debug_model_fsdp2", 2, ["--training.local_batch_size", "2"]),
}


def train(name: str, steps: int = STEPS) -> dict:
    """Train reference `name` in this rank process as loss_compare.py's side would be trained
    under torchrun (measured: the same floats); the per-step loss and grad norm (plain lists:
    results cross processes through torch.load(weights_only=True))."""
    reference = REFERENCES[name]
    torch.set_num_threads(reference.script.threads)  # what the script's OMP_NUM_THREADS sets
    with tempfile.TemporaryDirectory() as out:
        records = Trainer(parse_args(reference.trainer_arguments(out, steps))).train()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        # ATen reads ATEN_CPU_CAPABILITY at its first kernel: what this rank really ran
        "capability": torch.backends.cpu.get_cpu_capability(),
        "steps": [r.step for r in records],
        "loss": [r.loss for r in records],
        "grad_norm": [r.grad_norm for r in records],
    }


# --- perturbed runs: what the reference must catch ---------------------------------------

PERTURBED_STEPS = 3


def smoothed_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A changed loss function: cross-entropy with a little label smoothing."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", label_smoothing=0.01)


def _wider_trunc_normal(fill):
    def fill_wider(param, std, generator, cutoff=2.0):
        fill(param, std=std * 1.01, generator=generator, cutoff=cutoff)

    return fill_wider


def _shuffle_with_next_seed(permutation_class):
    def permutation(size, seed, source, epoch):
        return permutation_class(size, seed + 1, source, epoch)

    return permutation


def train_perturbed(change: str) -> dict:
    """The single-process reference run for PERTURBED_STEPS steps with `change` made to the
    code, as a commit could make it."""
    import titanlite.data.loader
    import titanlite.loss
    import titanlite.models.llama.model

    patches = {
        # the loss function the trainer trains with (titanlite.loss.training_loss)
        "loss function": mock.patch.object(titanlite.loss, "cross_entropy_sum", smoothed_cross_entropy_sum),
        # the initialisation of every linear layer: 1 % wider
        "initialisation": mock.patch.object(
            titanlite.models.llama.model,
            "fill_trunc_normal_",
            _wider_trunc_normal(titanlite.models.llama.model.fill_trunc_normal_),
        ),
        # the order the windows are read in: another shuffle
        "data order": mock.patch.object(
            titanlite.data.loader,
            "EpochPermutation",
            _shuffle_with_next_seed(titanlite.data.loader.EpochPermutation),
        ),
    }
    with patches[change]:
        return train("1rank", PERTURBED_STEPS)


PERTURBATIONS = ("loss function", "initialisation", "data order")

RUNS = {
    # One-rank jobs go to the less loaded rank, in this order (run_jobs_on_ranks): the
    # reference on rank 0, the perturbed runs beside it; then FSDP takes both ranks.
    "1rank": Job(1, train, ("1rank",)),
    **{change: Job(1, train_perturbed, (change,)) for change in PERTURBATIONS},
    "fsdp2": Job(2, train, ("fsdp2",)),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    # The ranks run on the kernels loss_compare.py --pin-kernels gives its ranks. They fork from
    # a server that has imported torch and titanlite but run no kernel, and take this
    # environment before their first one (tests/rank_jobs.py), so the pin takes: every
    # run reports the capability it ran with, and test_the_ranks_ran_the_pinned_kernels checks it.
    with mock.patch.dict(os.environ, LOSS_COMPARE.PINNED_KERNELS):
        return run_jobs_on_ranks(2, RUNS)


# --- the checks ------------------------------------------------------------------------


def recorded_for_other_run(reference: Reference, series: LossSeries) -> str | None:
    """One line when the file was not recorded by the run this module repeats (another
    config, overrides, launch size, thread count or step count), None when it was."""
    expected = {**reference.expected_source(), "steps": list(range(1, STEPS + 1))}
    recorded = {**series.source, "steps": series.steps}
    for key, value in expected.items():
        if recorded.get(key) != value:
            shown = recorded.get(key, "(not recorded)")
            if key == "steps":
                shown = series.describe_steps()
                value = f"{STEPS} steps (1..{STEPS})"
            return (
                f"{reference.path.name}: recorded with {key} = {shown!r}, this test runs {value!r}; "
                f"regenerate it: {reference.regenerate_command()}"
            )
    return None


def read_reference(reference: Reference) -> LossSeries:
    series = read_series(reference.path)
    problem = recorded_for_other_run(reference, series)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    return series


# The ranks run pinned kernels (loss_compare.py's PINNED_KERNELS: AVX2 in ATen, MKL and
# oneDNN), which give the same bits on every x86 host with AVX2 that MKL's pinned branch
# covers: its promise is for Intel CPUs, and this machine's Intel AVX-512 host reproduced the
# files bit for bit under the pin (README.md). On another torch, without the pin or on
# another vendor's CPU the sums may run in another order. Measured (README.md): unpinned
# AVX2 or plain kernels instead of AVX-512 moved the loss by <= 1.4e-7 and the grad norm by
# <= 1.1e-6 (relative) over 30 steps; Intel against AMD hosts (both AVX-512) by <= 1.3e-7 and
# 1.3e-7 over 10; another order of the sums (FSDP's reduce-scatter instead of one process's
# sums) by <= 1.2e-7 and <= 1.3e-6. This tolerance covers the largest of them about 8-fold;
# the perturbed runs below show that it still catches a changed loss, initialisation or data
# order at step 1.
OTHER_KERNELS_RTOL = 1e-5


def kernels() -> dict:
    """What decides the order of a run's sums, as scripts/loss_compare.py records it."""
    return {
        "torch": torch.__version__,
        "device": LOSS_COMPARE.device_name(pinned=True),
        "cpu_vendor": LOSS_COMPARE.cpu_vendor(),
    }


def tolerance(reference: LossSeries) -> float:
    """0 (bit-exact) on the torch, pinned kernels and CPU vendor the file was recorded with; else
    OTHER_KERNELS_RTOL."""
    recorded = {key: reference.source.get(key) for key in kernels()}
    return 0.0 if recorded == kernels() else OTHER_KERNELS_RTOL


def check(run: dict, reference: LossSeries, rtol: float):
    """The run against the reference's first steps (as many as the run has)."""
    first = slice(0, len(run["steps"]))
    expected = LossSeries(reference.steps[first], reference.loss[first], reference.grad_norm[first])
    return compare(expected, LossSeries(run["steps"], run["loss"], run["grad_norm"]), rtol=rtol)


def test_the_ranks_ran_the_pinned_kernels(runs):
    pinned = LOSS_COMPARE.PINNED_KERNELS["ATEN_CPU_CAPABILITY"].upper()
    ran = {run["capability"] for rank_runs in runs.values() for run in rank_runs}
    assert ran == {pinned}, f"the reference runs ran {ran}, not the pinned {pinned}: the pin did not take"


@pytest.mark.parametrize("name", REFERENCES)
def test_run_reproduces_the_reference(runs, name):
    reference = read_reference(REFERENCES[name])
    for rank_run in runs[name]:  # every rank reports the same global loss
        comparison = check(rank_run, reference, tolerance(reference))
        assert comparison.steps == list(range(1, STEPS + 1))
        assert comparison.equal, (
            f"{REFERENCES[name].path.name} no longer reproduces (A: the file, B: this run):\n"
            f"{format_table(comparison)}\nA deliberate numerics change regenerates the file in a commit "
            f"of its own, saying why: {REFERENCES[name].regenerate_command()}"
        )


@pytest.mark.parametrize("change", PERTURBATIONS)
@pytest.mark.parametrize("rtol", [0.0, OTHER_KERNELS_RTOL])
def test_reference_catches_a_change(runs, change, rtol):
    # Caught with either tolerance the reference test may use, at the first step.
    comparison = check(runs[change][0], read_reference(REFERENCES["1rank"]), rtol)
    assert comparison.steps == list(range(1, PERTURBED_STEPS + 1))
    assert comparison.first_beyond == 1, format_table(comparison)


def test_the_kernels_decide_the_tolerance():
    def recorded_with(**source) -> LossSeries:
        return LossSeries([1], [1.0], [1.0], source)

    assert tolerance(recorded_with(**kernels())) == 0.0
    assert tolerance(recorded_with(**{**kernels(), "device": "cpu (SOME_OTHER_ISA)"})) == OTHER_KERNELS_RTOL
    assert tolerance(recorded_with(**{**kernels(), "torch": "1.0.0"})) == OTHER_KERNELS_RTOL
    assert tolerance(recorded_with(**{**kernels(), "cpu_vendor": "SomeOtherVendor"})) == OTHER_KERNELS_RTOL
    assert tolerance(recorded_with()) == OTHER_KERNELS_RTOL


def test_the_layouts_agree(runs):
    # Guards the files against each other: one process and FSDP train on the same global
    # batches, so a regeneration from a broken layout shows here. Equal up to the order of the
    # sums only: the losses differ by up to 9.8e-8 and the grad norms by 2.5e-7 (relative, measured).
    single, fsdp = (read_reference(REFERENCES[name]) for name in ("1rank", "fsdp2"))
    comparison = compare(single, fsdp, rtol=1e-5)
    assert comparison.equal, format_table(comparison)


def test_a_file_from_another_run_fails_with_one_line(tmp_path):
    reference = REFERENCES["fsdp2"]
    document = json.loads(reference.path.read_text())
    document["source"]["overrides"] = ["--training.local_batch_size", "8"]
    other = tmp_path / reference.path.name
    other.write_text(json.dumps(document))
    problem = recorded_for_other_run(reference, read_series(other))
    assert problem.startswith(f"{reference.path.name}: recorded with overrides = ['--training.local_batch_size', '8']")
    assert "\n" not in problem
    assert problem.endswith(reference.regenerate_command())
