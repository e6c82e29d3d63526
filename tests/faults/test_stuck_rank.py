"""A rank that hangs after the first step: the others give up within
comm.train_timeout_seconds with one clear line, instead of waiting forever."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Both ranks run the real entry point; rank 1 stops answering during step 3.
LAUNCHER = """
import os, sys, time
from tests.multiprocess import register_tiny_flavor
from titanlite import train
from titanlite.parallel import exit_process
register_tiny_flavor()
step = train.Trainer.train_step
def maybe_hang(self):
    if os.environ["RANK"] == "1" and self.step == 2:
        time.sleep(600)
    return step(self)
train.Trainer.train_step = maybe_hang
exit_process(train.main(sys.argv[1:]))
"""
ARGS = [
    "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.steps", "6", "--training.mixed_precision_param", "float32",
    "--activation_checkpoint.mode", "none", "--comm.train_timeout_seconds", "5",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_stuck_rank_fails_the_others_within_the_train_timeout(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen([sys.executable, "-c", LAUNCHER, *ARGS, "--job.dump_folder", str(tmp_path)], cwd=REPO,
                         env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    try:
        start = time.monotonic()
        _, stderr = ranks[0].communicate(timeout=240)
        waited = time.monotonic() - start
        assert ranks[0].returncode == 1, stderr
        errors = [line for line in stderr.splitlines() if line.startswith("titanlite:")]
        assert len(errors) == 1, stderr
        assert errors[0].startswith("titanlite: rank 0: a collective failed after step 2 (did another rank die or hang?")
        assert ranks[1].poll() is None  # the stuck rank is still stuck: rank 0 did not wait for it
        print(f"rank 0 gave up {waited:.1f} s after start")
    finally:
        for process in ranks:
            process.kill()
            process.wait()
