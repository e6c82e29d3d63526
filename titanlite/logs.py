"""Where a run's log lines go: stdout, on the ranks chosen by LOG_RANK.

This is Python logging for the process, not a metric series; the metrics package writes
numbers to its own backends (console line, TensorBoard, JSONL, W&B) through it."""

import logging
import os
import sys

logger = logging.getLogger("titanlite")


class _StdoutHandler(logging.StreamHandler):
    """Writes each record to whatever sys.stdout is at that moment, so a handler made
    for one run never writes into a stream that was swapped or closed since (a later
    run in the same process, tests capturing output)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("[titanlite] %(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; ours is looked up
        pass


def setup_logging(rank: int) -> None:
    """Log on the ranks named in LOG_RANK (comma-separated, default 0), warnings elsewhere."""
    shown = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip()}
    logging.basicConfig(handlers=[_StdoutHandler()], force=True)
    logger.setLevel(logging.INFO if rank in shown else logging.WARNING)
