#!/usr/bin/env bash
# Run the test suite; arguments go to pytest (default: every test under tests/).
#   ./run_tests.sh
#   ./run_tests.sh tests/test_config.py -k toml -x
#   TEST_WORKERS=0 ./run_tests.sh ...   # one process (pytest-xdist off), e.g. for pdb
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON="${PYTHON:-python3}"

# The test extras are installed when anything pyproject.toml asks for is missing or older
# (tests/requirements_met.py names it). Run from /, so that the checkout itself does not count as
# installed. pyproject.toml pins torch to a version, not a build: pip keeps a CPU or CUDA build of it.
root="$PWD"
if ! unmet="$(cd / && "$PYTHON" "$root/tests/requirements_met.py" "$root/pyproject.toml" 2>/dev/null)"; then
    echo "run_tests.sh: installing titanlite with its test extras (pip install -e \".[test]\"): ${unmet:-tests/requirements_met.py could not run}"
    "$PYTHON" -m pip install -e ".[test]"
fi

# Bytecode for the checkout, written once: the suite starts a few hundred Python processes,
# and where PYTHONDONTWRITEBYTECODE is set (as on the CI machine) none of them caches what it
# compiles, so each compiled titanlite and the tests again (0.05 to 0.13 s of CPU a process in a
# fresh clone). The files are checked against their sources' times at import, so an edit
# never runs stale bytecode; __pycache__ is ignored by git.
"$PYTHON" -m compileall -q titanlite tests scripts benchmarks >/dev/null

# Two pytest workers by default: the multi-rank tests spend much of their time starting
# processes and waiting at rendezvous, so one worker leaves a core of a 2-core machine idle
# (measured in docs/performance.md). --dist loadfile keeps a module's tests in one worker, so a
# module's one launch of ranks (run_jobs_on_ranks) and its fixtures run once.
#
# One intra-op thread per process: the two workers and their rank processes keep the cores
# busy, so a second thread adds no speed, and its waits at OpenMP's barriers spin on a core
# another process needs (8% of the suite's CPU, measured in docs/performance.md).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# ATEN_CPU_CAPABILITY=avx2 runs the suite as an AVX2-only host would (CI does, for the modules
# that compare numbers). ATen and inductor follow the variable, but oneDNN and MKL pick their
# code by the CPU itself, and on an AMX host torch 2.13 then mixes the two: ATen's AVX2 flash
# attention is told by oneDNN that it can pack bf16 for AMX and fails ("pack_vnni2 is only
# supported when avx512 is supported"), a pair no real AVX2 host has (docs/performance.md).
# So the other two libraries are capped to AVX2 as well, unless set.
if [[ "${ATEN_CPU_CAPABILITY:-}" == avx2 ]]; then
    export ONEDNN_MAX_CPU_ISA="${ONEDNN_MAX_CPU_ISA:-AVX2}" MKL_CBWR="${MKL_CBWR:-AVX2}"
fi

# Only the plugins the suite uses: pytest loads every installed package's plugin by default
# (hypothesis, anyio, pytest-benchmark where a machine has them), 1.2 s of CPU in each of the
# 3 pytest processes here, and a plugin the suite does not know could change how it runs.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

# No DNS: the suite needs no network, but c10d asks the resolver for a name for both ends of
# every socket it opens (only to log them). Where the resolver drops a query now and then (on
# the CI machine 2 in 100 reverse lookups of ::ffff:127.0.0.1 wait out its 5 s timeout), each
# drop holds a process-group start for 5 s, and the suite starts several hundred. With no
# attempts every lookup fails at once; c10d then logs one warning a process, "The hostname of
# the client socket cannot be retrieved", and uses numeric addresses (docs/performance.md).
# Set after the install above, which may need the package index.
export RES_OPTIONS="${RES_OPTIONS:-attempts:0}"
# --no-loadscope-reorder: the workers take modules in collection order (tests/conftest.py puts
# the longest first); by default pytest-xdist queues them by their number of tests instead, and
# a 30 s module of 3 tests ran last, alone, with the other core idle (docs/performance.md).
exec "$PYTHON" -m pytest -p xdist.plugin -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
