"""The [eval] section of a run: its tasks, read and checked before anything is written, and
the evaluator the trainer calls."""

from titanlite.config import ConfigError
from titanlite.config.eval import Eval
from titanlite.downstream.evaluator import DownstreamEvaluator
from titanlite.downstream.tasks import Task, read_task, with_fewshot


def eval_tasks(config: Eval, dims) -> list[Task] | None:
    """The tasks (None when eval is off); a missing or malformed task file, or a layout the
    evaluation does not run on yet, is a ConfigError. ``dims``: the run's ParallelDims."""
    if not config.enable:
        return None
    if dims.tp > 1 or dims.pp > 1 or dims.cp > 1 or dims.ep > 1:
        raise ConfigError(
            "eval.enable: downstream evaluation runs on data-parallel layouts only for now (one process, FSDP, HSDP, "
            f"DDP); this run has tp {dims.tp}, pp {dims.pp}, cp {dims.cp}, ep {dims.ep}"
        )
    try:
        return [with_fewshot(read_task(name, config.limit), config.num_fewshot) for name in config.tasks]
    except ValueError as error:
        raise ConfigError(str(error)) from None


def build_evaluator(
    config: Eval, dims, tokenizer, *, seq_len: int, training_batch: int, dp_rank: int, device, compute_context
) -> DownstreamEvaluator | None:
    """The run's evaluator, or None when eval is off."""
    tasks = eval_tasks(config, dims)
    if tasks is None:
        return None
    return DownstreamEvaluator(
        tasks,
        tokenizer,
        seq_len=seq_len,
        local_batch_size=training_batch if config.local_batch_size == -1 else config.local_batch_size,
        device=device,
        dp_rank=dp_rank,
        dp_degree=dims.dp_degree,
        ranks_per_dp_rank=dims.tp,
        compute_context=compute_context,
    )
