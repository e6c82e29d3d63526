"""The [eval] section of a run: its tasks, read and checked before anything is written, and
the evaluator the trainer calls."""

import math

from titanlite.config import ConfigError
from titanlite.config.eval import Eval
from titanlite.downstream.evaluator import DownstreamEvaluator
from titanlite.downstream.tasks import Task, read_task, with_fewshot


def eval_tasks(config: Eval, dims) -> list[Task] | None:
    """The tasks (None when eval is off); a missing or malformed task file, or a batch size a
    pipeline cannot take, is a ConfigError. ``dims``: the run's ParallelDims."""
    if not config.enable:
        return None
    if dims.pp > 1 and config.local_batch_size != -1:
        raise ConfigError(
            f"eval.local_batch_size ({config.local_batch_size}) must be -1 with pipeline parallelism: the stages take "
            "the training micro-batches' shapes only"
        )
    try:
        return [with_fewshot(read_task(name, config.limit), config.num_fewshot) for name in config.tasks]
    except ValueError as error:
        raise ConfigError(str(error)) from None


def build_evaluator(
    config: Eval,
    dims,
    tokenizer,
    *,
    seq_len: int,
    training_batch: int,
    dp_rank: int,
    device,
    compute_context,
    flops_per_token=None,
    columns=None,
    cp_group=None,
) -> DownstreamEvaluator | None:
    """The run's evaluator, or None when eval is off. ``columns`` and ``cp_group``: under
    context parallelism, what this rank keeps of each row and the group that holds the rest."""
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
        ranks_per_dp_rank=dims.tp * dims.cp,
        # Sequence-parallel regions split a row over tp, context parallelism into 2 cp chunks.
        width_multiple=math.lcm(dims.tp, 2 * dims.cp),
        fixed_width=seq_len if dims.pp > 1 else None,
        flops_per_token=flops_per_token,
        columns=columns,
        cp_group=cp_group,
        compute_context=compute_context,
    )
