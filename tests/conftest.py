"""Fixtures several test modules share. Each is built once per session because it costs a
training run or a transformers model; tests read them and copy before changing anything.

The plain helpers behind them (tiny_args, free_port, full_weights, ...) are in
tests/helpers.py, where rank processes can import them too.
"""

import logging
import signal
from pathlib import Path

import pytest

from tests.helpers import TinyRun, save_hf_llama, train_tiny


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
