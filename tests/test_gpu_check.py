"""The GPU scripts' CPU dry runs execute every line the CUDA runs execute.

tests/gpu_dry_runs.py runs the dry runs of benchmarks/gpu_check.py, gpu_mfu.py,
gpu_memory.py, gpu_float8.py and checkpoint_stall.py (and their refusals) under coverage,
with their spawned rank processes measured too; every line of those scripts, and of
titanlite/models/attention.py (block_causal's kernels, FlexAttention on CUDA), that did not run
must end with the CUDA-only marker (gpu_check.CUDA_ONLY). A GPU is hidden from the run, so the
same lines run on a machine that has one. A failed dry run ends its message with one line
saying why."""

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("gpu_check.py", "gpu_mfu.py", "gpu_memory.py", "gpu_float8.py", "checkpoint_stall.py")
COVERED = (*(f"benchmarks/{script}" for script in SCRIPTS), "titanlite/models/attention.py")
DRY_RUN_TIMEOUT = 480  # seconds; about 60 on the CPU VM alone
CUDA_ONLY = "# cuda-only"  # gpu_check.CUDA_ONLY, kept apart so the coverage run stays the first import


def run_under_coverage(tmp_path: Path) -> dict:
    """The dry runs under coverage; coverage's JSON report of the three scripts."""
    rcfile = tmp_path / "coveragerc"
    rcfile.write_text(
        "[run]\n"
        f"data_file = {tmp_path / 'coverage'}\n"
        "parallel = True\n"
        # Follows the ranks each script starts (torch.multiprocessing; forked from the fork
        # server here, tests/gpu_dry_runs.py says why).
        "concurrency = multiprocessing,thread\n"
        f"include = {','.join(str(REPO / path) for path in COVERED)}\n"
        "[report]\n"
        "exclude_also = if __name__ == .__main__.:\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    coverage = [sys.executable, "-m", "coverage"]
    failure = run_saying_why(
        [*coverage, "run", f"--rcfile={rcfile}", str(REPO / "tests" / "gpu_dry_runs.py")], tmp_path, env
    )
    assert failure is None, failure
    for step in (["combine"], ["json", "-o", str(tmp_path / "report.json")]):
        done = subprocess.run([*coverage, *step, f"--rcfile={rcfile}"], cwd=tmp_path, env=env, capture_output=True)
        assert done.returncode == 0, f"coverage {step[0]}: {done.stdout.decode()}{done.stderr.decode()}"
    return json.loads((tmp_path / "report.json").read_text())["files"]


def run_saying_why(command: list[str], cwd: Path, env: dict) -> str | None:
    """Run ``command``; None if it exited 0, else the tail of its output and, last, one line
    saying why it failed: its exit status (the dry run's own last line names the part that
    failed and its error), the signal that ended it, or the timeout it ran past. The dry run
    once failed under load with an empty last line (torch.multiprocessing's message for a
    failed child ends with the child's traceback and an empty line)."""
    try:
        run = subprocess.run(
            command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT
        )
    except subprocess.TimeoutExpired as timeout:
        output = "".join(
            part.decode() if isinstance(part, bytes) else part or "" for part in (timeout.stdout, timeout.stderr)
        )
        return (
            f"{output[-6000:].rstrip()}\nthe dry run did not finish within {DRY_RUN_TIMEOUT} s (a machine under load?)"
        )
    if run.returncode == 0:
        return None
    if run.returncode < 0:
        name = signal.Signals(-run.returncode).name
        why = f"the dry run was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    else:
        said = [line for line in run.stderr.splitlines() if line.strip()]
        why = f"the dry run exited with status {run.returncode}: {said[-1] if said else 'it printed nothing'}"
    return f"{(run.stdout + run.stderr)[-6000:].rstrip()}\n{why}"


def test_a_failed_run_ends_with_the_reason(tmp_path):
    """Killed, exited with an error, or past the timeout: the last line says which, and why."""
    env = dict(os.environ)
    killed = run_saying_why(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], tmp_path, env
    )
    assert killed.splitlines()[-1] == "the dry run was killed by SIGKILL (out of memory?)", killed
    raised = run_saying_why([sys.executable, "-c", "print('x'); raise SystemExit('the reason\\n')"], tmp_path, env)
    assert raised.splitlines()[-1] == "the dry run exited with status 1: the reason", raised
    assert run_saying_why([sys.executable, "-c", "pass"], tmp_path, env) is None


def test_the_dry_run_names_the_part_that_failed_and_its_error(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    import gpu_dry_runs

    def fails():
        raise AssertionError(
            "gpu_check ['--cpu-dry-run'] returned 1:\n| row |\n3 of 4 checks passed; failed: x (why)\n"
        )

    try:
        gpu_dry_runs.run_parts({"a": lambda: None, "gpu_check": fails})
    except SystemExit as stop:
        assert stop.code == 1
    else:
        raise AssertionError("run_parts went on past a failure")
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "gpu_dry_runs failed in gpu_check: AssertionError: 3 of 4 checks passed; failed: x (why)", last


def test_dry_runs_execute_every_line_not_marked_cuda_only(tmp_path):
    files = run_under_coverage(tmp_path)
    unexecuted, mislabelled = [], []
    for covered in COVERED:
        path = REPO / covered
        report = next(report for name, report in files.items() if Path(name).resolve() == path)
        source = path.read_text().splitlines()
        assert report["executed_lines"], f"coverage saw nothing of {covered}"
        unexecuted += [
            f"{covered}:{number}: {source[number - 1].strip()}"
            for number in report["missing_lines"]
            if not source[number - 1].rstrip().endswith(CUDA_ONLY)
        ]
        ran = report["executed_lines"]
        mislabelled += [f"{covered}:{number}" for number in ran if source[number - 1].endswith(CUDA_ONLY)]
    assert not unexecuted, "lines the CPU dry runs never executed:\n" + "\n".join(unexecuted)
    assert not mislabelled, f"lines marked {CUDA_ONLY!r} that ran on the CPU: {mislabelled}"


def test_host_sync_count_takes_the_sync_warnings_alone(monkeypatch):
    """Enabling the sync debug mode prints a one-time notice that is no sync: the first run
    on an H200 counted it as one."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    syncs = []
    with gpu_check.counting_host_syncs(torch.device("cpu"), syncs):
        notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing ops"
        warnings.warn(notice, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
    assert syncs == ["called a synchronizing CUDA operation"]
