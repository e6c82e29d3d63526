"""End-to-end tests of ./run_train.sh: a short real run of the default debug config, and a
config mistake that must stop in the single-process preflight, before torchrun starts."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_TRAIN = REPO_ROOT / "run_train.sh"
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss: ([0-9.]+)")


def _launcher_env() -> dict[str, str]:
    """The caller's environment without the launcher's own settings, so the defaults are tested."""
    env = dict(os.environ)
    for name in ("NGPU", "LOG_RANK", "CONFIG_FILE"):
        env.pop(name, None)
    return env


def _run_train(*args: str, timeout: float, cwd: Path = REPO_ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RUN_TRAIN), *args],
        cwd=cwd,
        env={**_launcher_env(), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_debug_run_trains_and_the_loss_falls():
    result = _run_train("--training.steps", "20", timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    losses = {int(step): float(loss) for step, loss in STEP_LINE.findall(result.stdout)}
    assert 1 in losses and 20 in losses, f"steps 1 and 20 not both logged:\n{result.stdout[-4000:]}"
    assert losses[20] < losses[1], f"loss did not fall: step 1 {losses[1]}, step 20 {losses[20]}"


def test_config_mistake_stops_before_torchrun():
    result = _run_train("--training.stepz", "3", timeout=120)
    output = result.stdout + result.stderr

    assert result.returncode != 0
    error_lines = [line for line in output.splitlines() if "titanlite: config error" in line]
    assert len(error_lines) == 1, output
    assert "training.stepz" in error_lines[0]
    for torchrun_marker in ("ChildFailedError", "Traceback", "torch/distributed", "torch.distributed"):
        assert torchrun_marker not in output, output
    # The error is the whole output: no rank ever started.
    assert [line for line in output.splitlines() if line.strip()] == error_lines, output



def test_relative_paths_are_relative_to_where_the_run_starts(tmp_path):
    """As with torchtitan's script: CONFIG_FILE and the paths inside the config (here the
    dataset and the dump folder) are found from the caller's folder, not the checkout's."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.txt").write_text("relative paths start where the run starts. " * 200)
    (tmp_path / "job.toml").write_text(
        '[job]\ndump_folder = "./outputs"\n'
        '[training]\ndataset = "text"\ndataset_path = "corpus"\nseq_len = 32\nlocal_batch_size = 2\n'
        'mixed_precision_param = "float32"\n'
    )
    result = _run_train("--training.steps", "2", timeout=300, cwd=tmp_path, CONFIG_FILE="job.toml", NGPU="1")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert list((tmp_path / "outputs" / "metrics").glob("*/metrics.jsonl")), sorted(tmp_path.rglob("*"))


def test_a_rank_process_ends_with_its_status_after_the_exit_work():
    """train.py's ranks end through exit_process, which skips the interpreter's teardown (where
    a gloo worker thread can abort a finished run) but not what exiting normally does:
    running threads finish, the atexit handlers run and buffered output reaches its pipe."""
    script = (
        "import atexit, sys, threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from titanlite.parallel import exit_process\n"
        "atexit.register(lambda: print('atexit handler ran'))\n"
        "ThreadPoolExecutor(1).submit(time.sleep, 0)  # idle worker left running: must not hang the exit\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread finished', end=' '))).start()\n"
        "print('buffered', end=' ')\n"
        "sys.stderr.write('stderr buffered')\n"
        "exit_process(3)\n"
        "print('never reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert result.stdout == "buffered thread finished atexit handler ran\n"
    assert result.stderr == "stderr buffered"
