"""The GPU scripts' CPU dry runs execute every line the CUDA runs execute.

tests/gpu_dry_runs.py runs the dry runs of benchmarks/gpu_check.py, gpu_mfu.py,
gpu_memory.py, gpu_float8.py and checkpoint_stall.py (and their refusals) under coverage,
with their spawned rank processes measured too; every line of those scripts that did not run must end with the CUDA-only
marker (gpu_check.CUDA_ONLY). A GPU is hidden from the run, so the same lines run on a
machine that has one."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("gpu_check.py", "gpu_mfu.py", "gpu_memory.py", "gpu_float8.py", "checkpoint_stall.py")
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
        f"include = {','.join(str(REPO / 'benchmarks' / script) for script in SCRIPTS)}\n"
        "[report]\n"
        "exclude_also = if __name__ == .__main__.:\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    coverage = [sys.executable, "-m", "coverage"]
    run = subprocess.run(
        [*coverage, "run", f"--rcfile={rcfile}", str(REPO / "tests" / "gpu_dry_runs.py")],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    for step in (["combine"], ["json", "-o", str(tmp_path / "report.json")]):
        done = subprocess.run([*coverage, *step, f"--rcfile={rcfile}"], cwd=tmp_path, env=env, capture_output=True)
        assert done.returncode == 0, f"coverage {step[0]}: {done.stdout.decode()}{done.stderr.decode()}"
    return json.loads((tmp_path / "report.json").read_text())["files"]


def test_dry_runs_execute_every_line_not_marked_cuda_only(tmp_path):
    files = run_under_coverage(tmp_path)
    unexecuted, mislabelled = [], []
    for script in SCRIPTS:
        path = REPO / "benchmarks" / script
        report = next(report for name, report in files.items() if Path(name).resolve() == path)
        source = path.read_text().splitlines()
        assert report["executed_lines"], f"coverage saw nothing of {script}"
        unexecuted += [
            f"benchmarks/{script}:{number}: {source[number - 1].strip()}"
            for number in report["missing_lines"]
            if not source[number - 1].rstrip().endswith(CUDA_ONLY)
        ]
        ran = report["executed_lines"]
        mislabelled += [f"benchmarks/{script}:{number}" for number in ran if source[number - 1].endswith(CUDA_ONLY)]
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
