"""What this machine's cores give CPU-bound Python work: a pure-Python integer loop run in
N processes at once against the same loop in one process.

    python benchmarks/cpu_scaling.py            # 3 repeats of 3e7 iterations per process, about 1 minute on 2 cores
    python benchmarks/cpu_scaling.py --quick    # a smoke run (~2 s)

The loop (``x = (x * 31 + i) & 0xFFFFFFFF``) touches no memory beyond a few integers and
shares nothing, so N processes running it at once would do N times the work of one on N
real cores. What a machine really gives (shared vCPUs, hyper-threads, a busy neighbour) is
the reference against which parallel work here reads: the prepare command's workers and
the data loader benchmark's "N processes / baseline" row. Per repeat the loop first runs in
this process, then in N processes of a pool started beforehand (the start is not timed),
from the first task handed out to the last result back. Scaling = N x (one-process seconds)
/ (N-process seconds); every repeat is printed, and the median is the key line.
"""

import argparse
import multiprocessing
import os
import statistics
import sys
import time


def integer_loop(iterations: int) -> int:
    x = 0
    for i in range(iterations):
        x = (x * 31 + i) & 0xFFFFFFFF
    return x


def one_process_seconds(iterations: int) -> float:
    start = time.perf_counter()
    integer_loop(iterations)
    return time.perf_counter() - start


def many_processes_seconds(pool, processes: int, iterations: int) -> float:
    start = time.perf_counter()
    pool.map(integer_loop, [iterations] * processes, chunksize=1)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1e6 iterations, 1 repeat (~2 s)")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="processes at once (default: cores)")
    parser.add_argument("--iterations", type=float, help="loop iterations per process (default 3e7; quick 1e6)")
    parser.add_argument("--repeats", type=int, help="one-process / N-process turns (default 3; quick 1)")
    args = parser.parse_args()
    iterations = int(args.iterations or (1e6 if args.quick else 3e7))
    repeats = args.repeats or (1 if args.quick else 3)
    processes = args.processes

    print(
        f"cpu scaling: {processes} processes, {iterations:.0e} iterations each, {repeats} repeats; "
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}; load average "
        + " ".join(f"{load:.2f}" for load in os.getloadavg())
        + " before"
    )
    # Spawned: the loop needs nothing from this process, and nothing of it is worth copying.
    context = multiprocessing.get_context("spawn")
    scalings = []
    with context.Pool(processes) as pool:
        pool.map(integer_loop, [1] * processes, chunksize=1)  # every worker started before any timing
        for repeat in range(repeats):
            alone = one_process_seconds(iterations)
            together = many_processes_seconds(pool, processes, iterations)
            scalings.append(processes * alone / together)
            print(f"repeat {repeat + 1}: 1 process {alone:.2f} s, {processes} at once {together:.2f} s")
    print("load average " + " ".join(f"{load:.2f}" for load in os.getloadavg()) + " after")
    print(
        f"{processes}-process scaling of a pure-Python integer loop = {statistics.median(scalings):.2f}x "
        f"(median of {repeats}: " + ", ".join(f"{scaling:.2f}x" for scaling in scalings) + f"; ideal {processes}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
