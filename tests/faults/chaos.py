"""Kill-and-resume chaos trials: SIGKILL a 2-rank CPU training run at random moments and
check every restart (the harness is tests/faults/harness.py; docs/reliability.md). A test
driver, beside the harness it drives; run it from the repository root:

    python -m tests.faults.chaos --trials 20
    python -m tests.faults.chaos --trials 20 --seed 7 --keep  # keep every trial's folders
    python -m tests.faults.chaos --seed 7 --only 13            # re-run trial 13 of seed 7
    python -m tests.faults.chaos --trials 20 --storage s3      # checkpoints in object storage

Each trial draws a fault point (step, staging, write, rename, purge; with --storage s3,
commit instead of rename), the checkpoint async mode, the step and the rank that dies (or
all of them) from the seed and the trial number, prints one line, and the run ends with

    trials 20, resumed ok 20, corrupt 0, lost 0

The exit status is 0 only when every trial resumed ok. A trial that did not keeps its
folders (checkpoints, fault records, every rank's log) and prints where they are.
`python tests/faults/chaos.py ...` works as well.

With --storage s3 the checkpoints go to a bucket on moto's S3 server, started in this
process for the whole run (one prefix per trial); a kept trial's objects are copied into
its folder, since the server's go when the run ends.
"""

import argparse
import contextlib
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Run as a file (python tests/faults/chaos.py), Python puts tests/faults first on sys.path
# instead of the repository root, which the imports below start from.
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.harness import (  # noqa: E402 (after the path is set)
    STORAGES,
    RunConfig,
    object_store,
    random_trial,
    reference_losses,
    run_trial,
)


def trial_rng(seed: int, trial: int) -> random.Random:
    """Trial `trial` of `seed` draws the same fault however many trials run before it."""
    return random.Random(seed * 1_000_003 + trial)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="number of trials (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws (default 0)")
    parser.add_argument("--only", type=int, default=None, metavar="I", help="run only trial I (1-based) of the seed")
    parser.add_argument("--keep", action="store_true", help="keep every trial's folders, not only failed ones")
    parser.add_argument("--workdir", type=Path, default=None, help="where trials run (default: a new temporary folder)")
    parser.add_argument(
        "--storage",
        choices=STORAGES,
        default="local",
        help="where the checkpoints go: a local folder, or s3 (a bucket on moto's S3 server) (default local)",
    )
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="titanlite-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    numbers = [args.only] if args.only is not None else list(range(1, args.trials + 1))
    storage = "" if args.storage == "local" else f", checkpoints in {args.storage}"
    print(f"chaos: seed {args.seed}, {len(numbers)} trial(s){storage}, in {workdir}", flush=True)
    rerun = f"python -m tests.faults.chaos --seed {args.seed}" + ("" if args.storage == "local" else " --storage s3")
    start = time.monotonic()
    ok = corrupt = lost = 0
    with object_store() if args.storage == "s3" else contextlib.nullcontext() as store:
        for number in numbers:
            config, fault = random_trial(trial_rng(args.seed, number), RunConfig(storage=args.storage))
            reference = reference_losses(config, workdir)
            result = run_trial(config, fault, workdir, reference, keep=args.keep, store=store)
            ok += result.ok
            corrupt += result.status == "corrupt"
            lost += result.status == "lost"
            print(f"trial {number}: {result.summary()}", flush=True)
            if not result.ok:
                print(f"    kept in {workdir}; re-run with: {rerun} --only {number}", flush=True)
    print(f"chaos: {time.monotonic() - start:.0f} s")
    if ok == len(numbers) and args.workdir is None and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"trials {len(numbers)}, resumed ok {ok}, corrupt {corrupt}, lost {lost}")
    return 0 if ok == len(numbers) else 1


if __name__ == "__main__":
    sys.exit(main())
