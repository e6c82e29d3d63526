"""Time lost to one failure: torchft's replica groups against a restart from the last checkpoint.

    python benchmarks/fault_tolerance.py              # about a minute on 2 CPU cores
    python benchmarks/fault_tolerance.py --quick      # the tiny model: every line, briefly

Two data-parallel replicas of the debug model (one CPU process each) train, saving a
checkpoint every --interval steps. One dies (SIGKILL) right after it logs step --fail-at,
half-way between two checkpoints by default. Two runs, each timed by watching the logs (the
step lines, as they appear) and stopped once the failure is behind it:

  torchft   2 replica groups. Group 1 is SIGKILLed and started again at once. Group 0 trains
            on alone (skipping group 1's share of those steps) until group 1 heals from it.
            Time lost = the survivor's next step's wait beyond a normal step (the lighthouse
            drops the dead group after its heartbeat timeout, --heartbeat-ms, torchft's
            default 5 s) + the skipped samples at full speed (each step alone trains half the
            samples: the failure's cost in work, which the run never makes up).
  restart   the same 2 ranks as one job (dp_replicate 2) without fault tolerance, started as
            torchrun would start them: one rank lost ends the job, whose ranks are all
            SIGKILLed and started again at once, resuming from
            the newest checkpoint. Time lost = from the kill until the new job logs step
            --fail-at again: its start-up, the checkpoint's load and the steps since the
            checkpoint trained again.

--restart-delay waits that long before starting the failed group (or job) again, as a
scheduler's requeue would; the surviving group trains alone meanwhile. The last line is

    time lost to one failure: torchft X.X s, checkpoint restart Y.Y s, ratio X/Y = R.RR

Both costs are measured here on one machine, where a process starts in seconds and the
checkpoint is small. On a cluster a restart also waits for the scheduler, for every rank's
start-up and for a far larger checkpoint, and redoes up to an interval of steps; torchft's
cost stays the heartbeat timeout plus the absent group's share of the steps it is away.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed import TCPStore

REPO = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on: http://[^:\s]+:(\d+)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval (steps)")
    parser.add_argument("--fail-at", type=int, default=15, help="the step after which a replica dies")
    parser.add_argument("--heartbeat-ms", type=int, default=5000, help="the lighthouse's heartbeat timeout")
    parser.add_argument(
        "--restart-delay", type=float, default=0.0, help="seconds before the failed group (or job) is started again"
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model, failure after step 6")
    args = parser.parse_args(argv)
    if args.quick:
        args.interval, args.fail_at, args.heartbeat_ms = 4, 6, 1000
    model = ["--model.flavor", "tiny", "--training.seq_len", "32"] if args.quick else []
    common = [
        *("--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *model),
        *("--training.steps", "100000", "--training.local_batch_size", "2"),  # stopped by this script
        *("--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", str(args.interval)),
        *("--metrics.log_freq", "1", "--comm.train_timeout_seconds", "60"),
    ]
    with tempfile.TemporaryDirectory(prefix="titanlite-ft-bench-") as folder:
        folder = Path(folder)
        lighthouse, address = start_lighthouse(folder, args.heartbeat_ms)
        try:
            ft = ft_run(folder / "ft", common, address, args.fail_at, args.restart_delay)
        finally:
            lighthouse.kill()
            lighthouse.wait()
        restart = restart_run(folder / "restart", common, args.fail_at, args.restart_delay)
    print("| run | seconds | what |")
    print("|---|---:|---|")
    print(f"| torchft | {ft['normal_step']:.2f} | a normal step (median before the failure) |")
    print(f"| torchft | {ft['wait']:.2f} | the survivor's slowest step after the kill, of which the wait is lost |")
    print(f"| torchft | {ft['skipped_seconds']:.2f} | {ft['skipped']} skipped samples at full speed |")
    print(f"| torchft | {ft['heal_after']:.2f} | from the kill until the restarted group healed (not lost) |")
    print(f"| restart | {restart['lost']:.2f} | from the kill until step {args.fail_at} again |")
    print(
        f"time lost to one failure: torchft {ft['lost']:.1f} s, checkpoint restart {restart['lost']:.1f} s, "
        f"ratio {ft['lost']:.1f}/{restart['lost']:.1f} = {ft['lost'] / max(restart['lost'], 1e-9):.2f}"
    )
    return 0


def start_lighthouse(folder: Path, heartbeat_ms: int) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse on a port the kernel picks; (process, address)."""
    log = folder / "lighthouse.log"
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", "[::]:0"]
    command += ["--join_timeout_ms", "500", "--heartbeat_timeout_ms", str(heartbeat_ms)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not LISTENING.search(log.read_text()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the lighthouse did not start: {log.read_text()}")
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{LISTENING.search(log.read_text()).group(1)}"


def launch(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """A training process in a session of its own."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with log.open("a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "titanlite.train", *args],
            cwd=REPO,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def launch_job(args: list[str], log: Path, ranks: int) -> list[subprocess.Popen]:
    """`ranks` training processes of one job, as torchrun would start them. They meet at a
    store hosted here on a port the kernel picks (every rank a client, as under torchrun's
    agent); a new store for every job, so a restart never sees the old job's keys."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _stores.append(store)
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return [
        launch(args, log if rank == 0 else log.with_suffix(f".rank{rank}"), {**rendezvous, **rank_env(rank, ranks)})
        for rank in range(ranks)
    ]


def rank_env(rank: int, ranks: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}


_stores: list = []  # the jobs' stores, alive until the script ends


def wait_for_step(log: Path, step: int, process: subprocess.Popen) -> float:
    """When `log` shows step `step` (polled every 10 ms)."""
    while not re.search(rf"step: +{step} ", log.read_text()):
        if process.poll() is not None:
            raise SystemExit(f"{log} ended before step {step}:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)
    return time.monotonic()


def kill(process: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (its session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def ft_run(folder: Path, common: list[str], lighthouse: str, fail_at: int, delay: float) -> dict:
    folder.mkdir()
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    ft = ["--job.dump_folder", str(folder), "--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    logs = [folder / f"group{g}.log" for g in range(2)]
    groups = [launch([*common, *ft, "--fault_tolerance.replica_id", str(g)], logs[g], env) for g in range(2)]
    try:
        wait_for_step(logs[1], fail_at, groups[1])
        kill(groups[1])
        killed = time.monotonic()
        survivor_step = max(int(step) for step in re.findall(r"step: +(\d+) ", logs[0].read_text()))
        time.sleep(delay)
        groups[1] = launch([*common, *ft, "--fault_tolerance.replica_id", "1"], logs[1], env)
        while not (healed := re.search(r"healed from a live group at step (\d+)", logs[1].read_text())):
            if groups[1].poll() is not None:
                raise SystemExit(f"the restarted group ended without healing:\n{logs[1].read_text()[-3000:]}")
            time.sleep(0.01)
        heal_after = time.monotonic() - killed
        heal_step = int(healed.group(1))
        wait_for_step(logs[0], heal_step + 2, groups[0])  # both groups train together again
    finally:
        for group in groups:
            kill(group)
    records = survivor_records(folder)
    normal = statistics.median(records[step]["time_metrics/end_to_end(s)"] for step in range(2, fail_at))
    skipped = int(records[heal_step + 2]["fault_tolerance/skipped_samples"])
    # The step in flight at the kill, or the next, waits for the lighthouse to drop the group.
    wait = max(records[step]["time_metrics/end_to_end(s)"] for step in range(survivor_step, survivor_step + 3))
    skipped_seconds = skipped * normal / 4  # a step of both groups trains 4 samples
    return {
        "normal_step": normal,
        "wait": wait,
        "skipped": skipped,
        "skipped_seconds": skipped_seconds,
        "heal_after": heal_after,
        "lost": max(wait - normal, 0.0) + skipped_seconds,
    }


def restart_run(folder: Path, common: list[str], fail_at: int, delay: float) -> dict:
    folder.mkdir()
    args = [*common, "--job.dump_folder", str(folder), "--parallelism.data_parallel_replicate_degree", "2"]
    logs = [folder / "job.log", folder / "restarted.log"]
    job = launch_job(args, logs[0], ranks=2)
    try:
        wait_for_step(logs[0], fail_at, job[0])
        for rank in job:  # one rank lost ends the job: every rank goes
            kill(rank)
        killed = time.monotonic()
        time.sleep(delay)
        job = launch_job(args, logs[1], ranks=2)
        back = wait_for_step(logs[1], fail_at, job[0])
    finally:
        for rank in job:
            kill(rank)
    if "loaded checkpoint" not in logs[1].read_text():
        raise SystemExit(f"the restarted job did not resume from a checkpoint:\n{logs[1].read_text()[-3000:]}")
    return {"lost": back - killed}


def survivor_records(dump_folder: Path) -> dict[int, dict]:
    """step -> the surviving group's logged metrics."""
    records = {}
    for path in (dump_folder / "metrics").glob("*_group0/metrics.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["step"]] = record
    return records


if __name__ == "__main__":
    sys.exit(main())
