"""From what the training loop measured to the numbers that are logged.

The loop tells the processor how long data loading took and how many tokens each step
consumed on this device; at a logging step it hands over the loss, grad norm and lr,
and the processor adds throughput, TFLOPs, MFU, step and data-loading time and peak
memory for the window since the previous log, then sends everything to the loggers.
"""

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from titanlite.metrics import tags
from titanlite.metrics.flops import mfu, tflops
from titanlite.metrics.loggers import MetricLogger
from titanlite.metrics.memory import MemoryMonitor


@dataclass
class StepRecord:
    """What one logged step measured (the same numbers the console line shows)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_second: float


class MetricsProcessor:
    def __init__(self, logger: MetricLogger, monitor: MemoryMonitor, flops_per_token: int, peak_flops: float | None):
        self.logger, self.monitor = logger, monitor
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        # Callables giving more {tag: value} at each log step (called on every rank, so they
        # may take part in a collective), e.g. the MoE layers' expert load.
        self.sources: list[Callable[[], dict[str, float]]] = []
        self._start_window()

    def add_source(self, source: Callable[[], dict[str, float]]) -> None:
        """Log ``source()``'s numbers with every step's."""
        self.sources.append(source)

    def _start_window(self) -> None:
        self.window_start = time.perf_counter()
        self.window_steps, self.window_tokens, self.data_seconds = 0, 0, 0.0

    @contextmanager
    def data_loading(self) -> Iterator[None]:
        """Time a wait for the next batch."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.data_seconds += time.perf_counter() - start

    def step_done(self, device_tokens: float) -> None:
        """One optimizer step consumed `device_tokens` tokens on this device."""
        self.window_steps += 1
        self.window_tokens += device_tokens

    def log_step(self, step: int, loss: float, max_loss: float, grad_norm: float, lr: float, tokens_seen: int) -> dict:
        """Log the window that ends at `step` (call after the numbers were read from the
        device, so the window's time includes waiting for it) and start the next one."""
        elapsed = time.perf_counter() - self.window_start
        steps = max(self.window_steps, 1)
        tokens_per_second = self.window_tokens / elapsed
        metrics = {
            tags.LOSS: loss,
            tags.MAX_LOSS: max_loss,
            tags.GRAD_NORM: grad_norm,
            tags.LR: lr,
            tags.TOKENS_SEEN: tokens_seen,
            tags.TPS: tokens_per_second,
            tags.TFLOPS: tflops(tokens_per_second, self.flops_per_token),
            tags.STEP_TIME: elapsed / steps,
            tags.DATA_TIME: self.data_seconds / steps,
            tags.DATA_PCT: 100.0 * self.data_seconds / elapsed,
        }
        if self.peak_flops:
            metrics[tags.MFU] = mfu(tokens_per_second, self.flops_per_token, self.peak_flops)
        metrics.update(self.monitor.stats())
        for source in self.sources:
            metrics.update(source())
        self.logger.log(metrics, step)
        self.monitor.reset_peak()
        self._start_window()
        return metrics

    def leave_out(self, seconds: float) -> None:
        """Keep time spent outside training (validation) out of the window's rates."""
        self.window_start += seconds

    def log_validation(self, step: int, loss: float) -> dict:
        metrics = {tags.VAL_LOSS: loss, tags.VAL_PERPLEXITY: math.exp(min(loss, 700.0))}  # exp overflows past ~709
        self.logger.log(metrics, step)
        return metrics

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """The downstream tasks' metrics (eval/<task>/acc, ..., eval/seconds) of one evaluation."""
        self.logger.log(metrics, step)

    def close(self) -> None:
        self.logger.close()
