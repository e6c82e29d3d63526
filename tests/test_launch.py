"""End-to-end tests of ./run_train.sh: a short real run of the default debug config, and a
config mistake that must stop in the single-process preflight, before torchrun starts."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# The debug config logs every 5th step. By step 5, the end of its warmup, its loss falls from
# about 8.0 at step 1 to 5.4 (3.4 at step 10), a margin no noise closes; each further step of
# 2 ranks costs more than a second of the suite's 2 cores.
DEBUG_RUN_STEPS = 5


def test_debug_run_trains_and_the_loss_falls():
    result = _run_train("--training.steps", str(DEBUG_RUN_STEPS), timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    losses = {int(step): float(loss) for step, loss in STEP_LINE.findall(result.stdout)}
    last = DEBUG_RUN_STEPS
    assert 1 in losses and last in losses, f"steps 1 and {last} not both logged:\n{result.stdout[-4000:]}"
    assert losses[last] < losses[1], f"loss did not fall: step 1 {losses[1]}, step {last} {losses[last]}"


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


# --- the stop signal's grace and the allocator setting, as the launchers pass them ----------

SLURM_SCRIPT = REPO_ROOT / "multinode_trainer.slurm"
ALLOC_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _fake_commands(tmp_path: Path, **scripts: str) -> tuple[Path, Path]:
    """A folder of fake commands (name -> bash body) to put first on PATH, and the folder
    they record into (RECORD in their environment). `python` is this interpreter, started
    by its own path: a link to it elsewhere would lose a virtual environment, which Python
    finds from the folder its executable's path names (pyvenv.cfg beside it)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    scripts = {"python": f'exec {shlex.quote(sys.executable)} "$@"\n', **scripts}
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return bin_dir, record


def test_the_fake_python_runs_in_the_callers_virtual_environment(tmp_path, monkeypatch):
    """Tests run from a virtual environment (the README's setup) find torch only there: the
    fake `python` the launcher scripts call must be that environment, not the Python it was
    made from."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    venv_python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "only_in_this_venv.py").write_text("")  # as torch is in the user's venv only
    monkeypatch.setattr(sys, "executable", str(venv_python))  # as if the tests ran from the venv

    bin_dir, _ = _fake_commands(tmp_path)

    result = subprocess.run([str(bin_dir / "python"), "-c", "import only_in_this_venv"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().split("\0") if "=" in line)


RECORD_ARGV_AND_ENV = 'printf "%s\\n" "$@" > "$RECORD/$(basename "$0").argv"; env -0 > "$RECORD/$(basename "$0").env"\n'


def _torchrun_launch_config(argv: list[str], monkeypatch):
    """What torch's own torchrun makes of these arguments (its parser, then its LaunchConfig)."""
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else config_from_args sets it in this process
    config, _, trainer_args = config_from_args(parse_args(argv))
    return config, trainer_args


@pytest.mark.parametrize("from_command_line", [False, True], ids=["config file", "command line"])
def test_run_train_gives_torchrun_the_stop_save_time_and_the_allocator_setting(
    tmp_path, monkeypatch, from_command_line
):
    """checkpoint.stop_save_seconds reaches torchrun as --shutdown-timeout, which torch's
    torchrun turns into its LaunchConfig's shutdown_timeout (its wait before SIGKILL), from the
    TOML file or, overriding it, the command line. PYTORCH_ALLOC_CONF is set for the ranks
    unless the user set an allocator variable of their own."""
    bin_dir, record = _fake_commands(tmp_path, torchrun=RECORD_ARGV_AND_ENV)
    (tmp_path / "job.toml").write_text("[checkpoint]\nstop_save_seconds = 77\n")
    args = ["--checkpoint.stop_save_seconds", "123"] if from_command_line else []
    users_setting = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"} if from_command_line else {}
    env = {key: value for key, value in _launcher_env().items() if key not in ALLOC_VARIABLES}
    result = subprocess.run(
        [str(RUN_TRAIN), *args],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **env,
            **users_setting,
            "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
            "RECORD": str(record),
            "CONFIG_FILE": "job.toml",
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr

    argv = (record / "torchrun.argv").read_text().splitlines()
    config, trainer_args = _torchrun_launch_config(argv, monkeypatch)
    assert config.shutdown_timeout == (123 if from_command_line else 77)
    assert trainer_args == ["-u", "-m", "titanlite.train", "--job.config_file", "job.toml", *args]
    ranks_env = _env_file(record / "torchrun.env")
    if from_command_line:
        assert "PYTORCH_ALLOC_CONF" not in ranks_env
        assert ranks_env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"
    else:
        assert ranks_env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


# A torchrun worker that, like a rank saving its checkpoint, takes SAVE_SECONDS to end after
# a SIGTERM; it says when its trap is set, and leaves a mark once it has finished.
SLOW_TO_STOP_WORKER = (
    'trap \'sleep "$SAVE_SECONDS"; touch "$MARKS/saved"; exit 0\' TERM; touch "$MARKS/ready"; '
    "while true; do sleep 0.1; done"
)


@pytest.mark.parametrize("shutdown_timeout, saved", [(30, True), (1, False)])
def test_torchrun_waits_its_shutdown_timeout_for_a_worker_saving_after_sigterm(tmp_path, shutdown_timeout, saved):
    """torch's own elastic agent on this machine: after a SIGTERM it gives a worker that
    needs 3 s to stop a --shutdown-timeout of 30 s, and SIGKILLs it after one of 1 s."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PET_", "TORCHELASTIC_"))}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            "--shutdown-timeout",
            str(shutdown_timeout),
            "--no-python",
            "bash",
            "-c",
            SLOW_TO_STOP_WORKER,
        ],
        env={**env, "MARKS": str(marks), "SAVE_SECONDS": "3"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (marks / "ready").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (marks / "saved").exists() == saved, output
    assert ("Unable to shutdown process" in output) != saved, output  # torchrun's line before its SIGKILL


# Fake Slurm commands. scontrol answers the two questions the script asks; the job ends
# FAKE_TIME_LEFT seconds after the first `show job` (or has no time limit), and that end is
# recorded. srun records how it was started, then, like torchrun's ranks saving, takes
# 2 s to stop after a SIGTERM, counting every SIGTERM it gets, and exits 3.
FAKE_SCONTROL = """
case "$1 $2" in
    "show hostnames") echo node7 ;;
    "show job")
        if [[ -z "${FAKE_TIME_LEFT:-}" ]]; then
            echo "JobId=$3 StartTime=2026-11-25T01:00:00 EndTime=Unknown Deadline=N/A"; exit
        fi
        [[ -e "$RECORD/end" ]] || echo $(( $(date +%s) + FAKE_TIME_LEFT )) > "$RECORD/end"
        end=$(date -d "@$(cat "$RECORD/end")" +%Y-%m-%dT%H:%M:%S)
        echo "JobId=$3 StartTime=2026-11-25T01:00:00 EndTime=$end Deadline=N/A" ;;
esac
"""
FAKE_SRUN = (
    RECORD_ARGV_AND_ENV
    + """
trap 'date +%s.%N >> "$RECORD/srun-sigterms"' TERM
touch "$RECORD/srun-started"
until [[ -e "$RECORD/srun-sigterms" ]]; do sleep 0.1; done
for _ in $(seq 20); do sleep 0.1; done
exit 3
"""
)


def _start_slurm_script(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen, Path]:
    bin_dir, record = _fake_commands(tmp_path, scontrol=FAKE_SCONTROL, srun=FAKE_SRUN)
    base = {key: value for key, value in _launcher_env().items() if key not in ALLOC_VARIABLES}
    process = subprocess.Popen(
        ["bash", str(SLURM_SCRIPT), *args],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={
            **base,
            "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}",
            "RECORD": str(record),
            "CONFIG_FILE": "train_configs/debug_model.toml",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node[7-8]",
            "SLURM_NNODES": "1",
            **env,
        },
    )
    return process, record


def _finish(process: subprocess.Popen) -> str:
    try:
        return process.communicate(timeout=300)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_slurm_script_stops_the_run_stop_save_seconds_before_the_time_limit(tmp_path, monkeypatch):
    """The job ends 127 s after the script first asks; with checkpoint.stop_save_seconds 123
    srun gets one SIGTERM 123 s before that end (4 s in), torchrun is told to wait 123 s for
    the ranks, and the script ends with srun's status."""
    process, record = _start_slurm_script(tmp_path, "--checkpoint.stop_save_seconds", "123", FAKE_TIME_LEFT="127")
    output = _finish(process)
    assert process.returncode == 3, output
    sigterms = [float(line) for line in (record / "srun-sigterms").read_text().split()]
    assert len(sigterms) == 1, output
    lead = int((record / "end").read_text()) - sigterms[0]
    assert 118 < lead <= 124, f"SIGTERM {lead:.1f} s before the end\n{output}"
    assert output.count("titanlite: stopping: SIGTERM to the ranks") == 1, output

    argv = (record / "srun.argv").read_text().splitlines()
    assert argv[0] == "torchrun"
    config, trainer_args = _torchrun_launch_config(argv[1:], monkeypatch)
    assert config.shutdown_timeout == 123
    assert (config.min_nodes, config.nproc_per_node, config.run_id) == (1, 8, "4242")
    assert trainer_args[-2:] == ["--checkpoint.stop_save_seconds", "123"]
    assert _env_file(record / "srun.env")["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_slurm_script_passes_one_sigterm_on_however_many_it_gets(tmp_path):
    """scancel --batch --signal=TERM, twice: srun (so torchrun) gets one SIGTERM, since a
    second one would end torchrun's wait for the saving ranks early. No time limit here."""
    process, record = _start_slurm_script(tmp_path, PYTORCH_ALLOC_CONF="")
    deadline = time.monotonic() + 120
    while not (record / "srun-started").exists():
        assert process.poll() is None and time.monotonic() < deadline, _finish(process)
        time.sleep(0.1)
    for _ in range(2):
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.5)
    output = _finish(process)
    assert process.returncode == 3, output
    assert len((record / "srun-sigterms").read_text().split()) == 1, output
    assert "--shutdown-timeout\n300\n" in (record / "srun.argv").read_text()  # the key's default
    assert _env_file(record / "srun.env")["PYTORCH_ALLOC_CONF"] == ""  # the user's (empty) setting is kept


# --- fault tolerance: the launchers start the lighthouse and one job per replica group -------

RECORD_EACH_CALL = 'printf "%s\\n" "$@" > "$RECORD/$(basename "$0").$$.argv"\n'


def _calls(record: Path, command: str) -> list[list[str]]:
    return [path.read_text().splitlines() for path in sorted(record.glob(f"{command}.*.argv"))]


def _replica_id(argv: list[str]) -> int:
    return int(argv[argv.index("--fault_tolerance.replica_id") + 1])


def test_run_train_starts_a_lighthouse_and_one_torchrun_per_replica_group(tmp_path):
    """FT_GROUPS=2 with NGPU=2: torchft's real lighthouse (on a port the kernel picks), the
    preflight asking it, then two torchruns of one rank, replica groups 0 and 1; the
    lighthouse is gone when the script ends."""
    bin_dir, record = _fake_commands(tmp_path, torchrun=RECORD_EACH_CALL)
    env = _launcher_env()
    env.pop("TORCHFT_LIGHTHOUSE", None)
    result = subprocess.run(
        [str(RUN_TRAIN), "--training.steps", "3"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "RECORD": str(record), "NGPU": "2"}
        | {"FT_GROUPS": "2", "FT_LIGHTHOUSE_PORT": "0", "TMPDIR": str(tmp_path)},  # the lighthouse's log
    )
    assert result.returncode == 0, result.stdout + result.stderr
    address = re.search(r"torchft lighthouse at (http://localhost:(\d+))", result.stdout)
    assert address and int(address.group(2)) > 0, result.stdout
    calls = _calls(record, "torchrun")
    assert sorted(_replica_id(argv) for argv in calls) == [0, 1]
    for argv in calls:
        assert "--nproc_per_node=1" in argv and argv[argv.index("--fault_tolerance.group_size") + 1] == "2"
        assert "--fault_tolerance.enable" in argv and argv[argv.index("--training.steps") + 1] == "3"
    import socket

    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(address.group(2))), timeout=5):
        pass  # the lighthouse was stopped with the script


def test_slurm_script_starts_one_srun_per_replica_group_on_its_own_nodes(tmp_path):
    """FT_GROUPS=2 on 4 nodes, with a lighthouse already named by TORCHFT_LIGHTHOUSE (here a
    socket this test listens on): two sruns, each of 2 nodes with its own rendezvous, run id
    and replica_id."""
    import socket

    scontrol = 'case "$1 $2" in "show hostnames") printf "n1\\nn2\\nn3\\nn4\\n" ;; esac\n'
    bin_dir, record = _fake_commands(tmp_path, scontrol=scontrol, srun=RECORD_EACH_CALL)
    base = _launcher_env()
    with socket.socket() as lighthouse:
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        result = subprocess.run(
            ["bash", str(SLURM_SCRIPT)],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
            env={**base, "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}", "RECORD": str(record)}
            | {"CONFIG_FILE": "train_configs/debug_model.toml", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-4]"}
            | {"SLURM_NNODES": "4", "FT_GROUPS": "2"}
            | {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse.getsockname()[1]}"},
        )
    assert result.returncode == 0, result.stdout + result.stderr
    calls = sorted(_calls(record, "srun"), key=_replica_id)
    assert len(calls) == 2, calls
    for group, argv in enumerate(calls):
        nodes = f"n{2 * group + 1},n{2 * group + 2}"
        assert argv[:5] == ["--nodes", "2", "--nodelist", nodes, "torchrun"], argv
        assert argv[argv.index("--rdzv_endpoint") + 1] == f"n{2 * group + 1}:29500"
        assert argv[argv.index("--rdzv_id") + 1] == f"77-{group}"
        assert argv[argv.index("--fault_tolerance.group_size") + 1] == "2"
