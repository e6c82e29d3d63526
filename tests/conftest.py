"""Fixtures several test modules share. Each is built once per session because it costs a
training run or a transformers model; tests read them and copy before changing anything.

The plain helpers behind them (tiny_args, free_port, full_weights, ...) are in
tests/helpers.py, where rank processes can import them too.
"""

import logging
import multiprocessing
import signal
from pathlib import Path

import pytest

from tests.gc_frozen import freeze_what_is_loaded
from tests.helpers import TinyRun, save_hf_llama, train_tiny
from titanlite.parallel.parallelize import keep_compiled_code_per_cpu_isa

# Tests compile outside the trainer too (FlexAttention, the compile-cache test): every process
# of the suite, the fork servers included, takes inductor's cache folder of this run's vector
# ISA from here, as the trainer gives its own (torch 2.13 would serve one ISA's code to another).
keep_compiled_code_per_cpu_isa()

# Rank processes (tests/rank_jobs.py) and script runs (tests/forked_scripts.py) fork from
# multiprocessing's fork server, which imports these once per test process instead of once
# per child, does the compiler's start-up once (tests/compile_warmup.py) and, last, freezes the
# garbage collector's view of it all (tests/gc_frozen.py). The server never runs a parallel
# kernel, so no OpenMP thread pool is forked half-alive.
multiprocessing.set_forkserver_preload(
    ["titanlite.train", "tests.rank_jobs", "tests.forked_scripts", "tests.compile_warmup", "tests.gc_frozen"]
)

# The modules that take longest (a quarter of a minute or more of a worker each, measured as the
# comment says), run first: run_tests.sh's `--dist loadfile --no-loadscope-reorder` hands
# modules to its workers in collection order (without that flag pytest-xdist orders them by their
# number of tests and this list does nothing), so a long module collected last would run alone at
# the end while the other worker idles (test_gpu_check did: 30 s, one core idle for 25 s of it).
# Longest first keeps both busy to the end. The figures are of a whole suite's run: read their order.
# Not simply sorted by the newest figures: sorted so at 4cb4474, the two heaviest rank-launching
# modules (expert-parallel training, parity) ran side by side and the suite took 594-600 s
# against 500 s in this order, which pairs each with a module that mostly starts processes.
LONGEST_FIRST = (  # the suite at 1553717 (./run_tests.sh -v --durations=0): seconds per module
    "test_expert_parallel_training.py",  # 114
    "test_benchmarks_smoke.py",  # 96
    "test_qwen3_moe.py",  # 82
    "test_parity.py",  # 82
    "test_launch.py",  # 62
    "test_pipeline_parity.py",  # 59
    "test_kill_resume.py",  # 55
    "test_estimate_cli.py",  # 51
    "test_estimate_memory.py",  # 49
    "test_checkpoint_resume.py",  # 47
    "test_checkpoint_files.py",  # 37
    "test_loss_compare.py",  # 36
    "test_tp_checkpoint.py",  # 36
    "test_fault_tolerance.py",  # 35
    "test_gpu_check.py",  # 30
    "test_pipeline_checkpoint.py",  # 20
    "test_data_prepared.py",  # 18
    "test_reference_losses.py",  # 17
    "test_estimate_gpu_peaks.py",  # 17
    "test_stuck_rank.py",  # 16
    "test_hf_seed.py",  # 14
    "test_estimate_moe.py",  # 14
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder the collected tests: LONGEST_FIRST's modules first, in its order, then the rest
    as collected (a stable sort, so each module's own order is kept)."""
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything the test modules imported stays for the whole session: the garbage
    collector need not walk it again (about 400,000 objects, 0.2 s a full collection, which the
    memory estimator's simulations run once each). The fork servers do the same on import."""
    freeze_what_is_loaded()


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory) -> Path:
    """A transformers Llama of the tiny shape (seed 1) in many small safetensors shards."""
    pytest.importorskip("transformers")
    return save_hf_llama(tmp_path_factory.mktemp("hf") / "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_ema_run(tmp_path_factory) -> TinyRun:
    """The tiny model trained a few steps with EMA (decay 0.5); its last step is a full checkpoint."""
    return train_tiny(tmp_path_factory.mktemp("tiny_ema_run"), ["--ema.enable", "--ema.decay", "0.5"])


@pytest.fixture
def quiet_process_state():
    """Undo what an in-process run changes for the whole process: logging handlers bound to
    this test's captured streams, and the SIGTERM/SIGINT handlers of a checkpointing run."""
    loggers = [logging.getLogger(), logging.getLogger("titanlite")]
    saved = [(list(logger.handlers), logger.level, logger.propagate) for logger in loggers]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for logger, (logger_handlers, level, propagate) in zip(loggers, saved, strict=True):
        logger.handlers[:] = logger_handlers
        logger.setLevel(level)
        logger.propagate = propagate
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
