"""Where the trainer's numbers go: the console, TensorBoard, a JSONL file and W&B.

Every backend takes the same call, ``log({tag: value}, step)``, with the tags of
titanlite.metrics.tags (torchtitan's names and grouping, so its dashboards carry over).
"""

import json
import logging
import os
import sys
from datetime import datetime

from titanlite.config import Metrics
from titanlite.metrics import tags

logger = logging.getLogger("titanlite")

WANDB_MISSING = "metrics.enable_wandb is set but the wandb package is not installed (pip install wandb)"


class MetricLogger:
    """The interface every backend implements; this base class itself logs nothing."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


# --- console ------------------------------------------------------------------------------

_RESET = "\033[0m"
_COLORS = {
    "red": "\033[31m",
    "green": "\033[32m",
    "yellow": "\033[33m",
    "blue": "\033[34m",
    "magenta": "\033[35m",
    "cyan": "\033[36m",
    "white": "\033[37m",
    "bright_black": "\033[90m",
}


def _small(value: float, unit: str = "") -> str:
    """Two decimals, or three significant digits for values that two decimals would
    show as 0.00 (a CPU run's TFLOPs are thousandths)."""
    text = f"{value:,.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3g}"
    return text + unit


def _memory_text(metrics: dict[str, float]) -> str | None:
    """Device memory as reserved GiB and % of capacity (what decides an OOM), else the
    process RSS on CPU; None when the step carries no memory numbers."""
    if tags.MAX_RESERVED_GIB in metrics:
        text = f"{metrics[tags.MAX_RESERVED_GIB]:.2f}GiB"
        if tags.MAX_RESERVED_PCT in metrics:
            text += f"({metrics[tags.MAX_RESERVED_PCT]:.1f}%)"
        return text
    if tags.RSS_GIB in metrics:
        text = f"{metrics[tags.RSS_GIB]:.2f}GiB"
        if tags.PEAK_RSS_GIB in metrics:
            text += f"(peak {metrics[tags.PEAK_RSS_GIB]:.2f})"
        return text
    return None


def _moe_load_text(load: float, metrics: dict[str, float]) -> str:
    """The largest expert load with its scale, the worst a load can be: "4.00 of max 4.00"."""
    worst = metrics.get(tags.MOE_WORST_LOAD)
    return f"{load:.2f}" if worst is None else f"{load:.2f} of max {worst:.2f}"


def _four_places(value: float, metrics: dict[str, float]) -> str:
    return f"{value:.4f}"


# (tag, label, color, formatter of the value and the step's metrics) in the order the
# console line shows them.
_CONSOLE_FIELDS = (
    (tags.LOSS, "loss", "green", _four_places),
    (tags.Z_LOSS, "output_z_loss", "green", lambda v, _: f"{v:.3g}"),
    (tags.GRAD_NORM, "grad_norm", "yellow", _four_places),
    (tags.LR, "lr", "white", lambda v, _: f"{v:.2e}"),
    (tags.TPS, "tps", "blue", lambda v, _: f"{v:,.0f}"),
    (tags.TFLOPS, "tflops", "cyan", lambda v, _: _small(v)),
    (tags.MFU, "mfu", "magenta", lambda v, _: f"{v:.2f}%"),
    (tags.MOE_MAX_LOAD, "moe_load", "yellow", _moe_load_text),
    (tags.MOE_AUX_LOSS, "aux_loss", "green", _four_places),
    (tags.MOE_LOAD_BALANCE_LOSS, "lb_loss", "green", _four_places),
    (tags.MOE_SEQ_BALANCE_LOSS, "seq_loss", "green", _four_places),
    (tags.MOE_Z_LOSS, "z_loss", "green", _four_places),
    (tags.SPIKE_Z_SCORE, "z_score", "yellow", lambda v, _: f"{v:.1f}"),
    (tags.SPIKE_SKIPPED, "spikes", "yellow", lambda v, _: f"{v:.0f}"),
    (tags.FT_GROUPS, "groups", "white", lambda v, _: f"{v:.0f}"),
    (tags.FT_HEALS, "heals", "white", lambda v, _: f"{v:.0f}"),
    (tags.FT_SKIPPED, "skipped", "white", lambda v, _: f"{v:,.0f}"),
    (tags.VAL_LOSS, "val_loss", "green", _four_places),
    (tags.VAL_PERPLEXITY, "val_ppl", "green", lambda v, _: _small(v)),
)


class ConsoleLogger(MetricLogger):
    """One line per logged step through the "titanlite" logger, for example

        step: 10  loss: 5.1234  grad_norm: 0.8123  lr: 8.00e-04  tps: 12,345  tflops: 1.23
        mfu: 41.20%  memory: 12.30GiB(15.5%)  step_time: 0.512s

    (on one line). Fields a step does not carry (MFU on CPU, say) are left out. Which
    ranks actually print is decided by the logger's level (see setup_logging in titanlite/logs.py).
    """

    def __init__(self, color: bool = True):
        self.color = color

    def _paint(self, text: str, color: str) -> str:
        return f"{_COLORS[color]}{text}{_RESET}" if self.color else text

    def format(self, metrics: dict[str, float], step: int) -> str:
        parts = [self._paint(f"step: {step:2d}", "red")]
        for tag, label, color, formatter in _CONSOLE_FIELDS:
            if tag in metrics:
                parts.append(self._paint(f"{label}: {formatter(metrics[tag], metrics)}", color))
        memory = _memory_text(metrics)
        if memory is not None:
            parts.append(self._paint(f"memory: {memory}", "bright_black"))
        if tags.STEP_TIME in metrics:
            parts.append(self._paint(f"step_time: {metrics[tags.STEP_TIME]:.3f}s", "bright_black"))
        for tag in sorted(tag for tag in metrics if tag.startswith(tags.EVAL_PREFIX) and tag != tags.EVAL_SECONDS):
            parts.append(self._paint(f"{tag.removeprefix(tags.EVAL_PREFIX)}: {metrics[tag]:.4f}", "green"))
        if tags.EVAL_SECONDS in metrics:
            parts.append(self._paint(f"eval_time: {metrics[tags.EVAL_SECONDS]:.1f}s", "bright_black"))
        return "  ".join(parts)

    def log(self, metrics: dict[str, float], step: int) -> None:
        logger.info("%s", self.format(metrics, step))


# --- files and services -------------------------------------------------------------------


class TensorBoardLogger(MetricLogger):
    """One scalar series per tag in a TensorBoard event file under `folder`."""

    def __init__(self, folder: str):
        # Imported here so that importing titanlite.metrics stays cheap when TensorBoard is off.
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.writer = SummaryWriter(log_dir=folder)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class JsonlLogger(MetricLogger):
    """Appends one JSON object per call, ``{"step": step, **metrics}``, to `path`.

    Each line is flushed as it is written, so a crash loses nothing already logged, and
    appending (not truncating) keeps the earlier lines of a resumed run. Non-finite
    values are written as NaN/Infinity, which Python's json module reads back.
    """

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def _import_wandb():
    """The wandb module, or a one-line ValueError when it is not installed."""
    try:
        import wandb
    except ImportError:
        raise ValueError(WANDB_MISSING) from None
    return wandb


class WandbLogger(MetricLogger):
    """Weights & Biases; project, entity and mode come from the usual WANDB_* variables
    (WANDB_PROJECT defaults to "titanlite")."""

    def __init__(self, folder: str, run_name: str, config: dict | None = None):
        self.wandb = _import_wandb()
        os.makedirs(folder, exist_ok=True)
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "titanlite"), name=run_name, dir=folder, config=config
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class FanOutLogger(MetricLogger):
    """Sends every call to each of several loggers."""

    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = list(loggers)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for each in self.loggers:
            each.log(metrics, step)

    def close(self) -> None:
        # Close every backend even if one fails, so no file is left unflushed; then report.
        errors = []
        for each in self.loggers:
            try:
                each.close()
            except Exception as error:  # re-raised below, after the others closed
                errors.append(error)
        if errors:
            raise errors[0]


# --- building them from the config --------------------------------------------------------


def default_run_name() -> str:
    """A run name from the current time, e.g. 20250131-142501. Ranks start at slightly
    different moments, so compute it once (on rank 0) and share it with the others."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def metric_folders(config: Metrics, dump_folder: str, rank: int, run_name: str) -> dict[str, str] | None:
    """The TensorBoard and JSONL folders of this rank, or None when this rank writes no
    files (every rank but 0, unless save_for_all_ranks)."""
    if rank != 0 and not config.save_for_all_ranks:
        return None
    per_rank = [f"rank_{rank}"] if config.save_for_all_ranks else []
    return {
        "tensorboard": os.path.join(dump_folder, config.save_tb_folder, run_name, *per_rank),
        "jsonl": os.path.join(dump_folder, "metrics", run_name, *per_rank),
    }


def build_loggers(
    config: Metrics, dump_folder: str, rank: int, run_name: str, run_config: dict | None = None
) -> MetricLogger:
    """Every backend the [metrics] section enables for this rank, behind one logger.

    Console on rank 0. TensorBoard in dump_folder/save_tb_folder/run_name and JSONL in
    dump_folder/metrics/run_name/metrics.jsonl on rank 0, or in rank_N sub-folders on
    every rank with save_for_all_ranks; W&B follows the same rule. `run_name` must be the
    same on every rank. `run_config` (e.g. the job config as a dict) is shown by W&B.
    """
    if config.enable_wandb:
        # Checked on every rank, before any file is created, so that all ranks stop
        # together with the same message instead of rank 0 alone.
        _import_wandb()
    loggers: list[MetricLogger] = []
    if rank == 0:
        # Colors only on a terminal: in a log file ANSI codes are noise that breaks grep.
        loggers.append(ConsoleLogger(color=not config.disable_color_printing and sys.stdout.isatty()))
    folders = metric_folders(config, dump_folder, rank, run_name)
    if folders is not None:
        if config.enable_tensorboard:
            loggers.append(TensorBoardLogger(folders["tensorboard"]))
        if config.enable_jsonl:
            loggers.append(JsonlLogger(os.path.join(folders["jsonl"], "metrics.jsonl")))
        if config.enable_wandb:
            name = run_name if not config.save_for_all_ranks else f"{run_name}-rank_{rank}"
            loggers.append(WandbLogger(folders["jsonl"], name, run_config))
    return FanOutLogger(loggers)
