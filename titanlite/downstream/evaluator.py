"""Scoring multiple-choice tasks during training, on every data-parallel rank.

Items are dealt round-robin over the data-parallel ranks (item i to rank i % dp); every rank
runs the same number of forwards (FSDP gathers weights inside each), padding its last batch
with rows that count for nothing. Per task, each rank sums, over its items: correct answers,
correct answers after length normalisation, the correct choice's negative log-likelihood (nats)
and its UTF-8 bytes; one all-reduce adds the ranks' sums, so every item counts once.

    acc       share of items whose correct choice has the highest log-likelihood
    acc_norm  the same with each log-likelihood divided by its choice's length in characters
    bpb       the correct choices' summed negative log-likelihood over their summed bytes, in bits

An evaluation changes nothing of training: no gradient, the model in eval mode (the MoE load
counters count training tokens only) and put back, no random number drawn, no data read.
"""

import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.downstream.tasks import IGNORE_INDEX, Task, choice_row, padded_batch

logger = logging.getLogger("titanlite")
_SUMS = ("acc", "acc_norm", "nll", "bytes", "items")


def continuation_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of the log-probabilities of the labelled tokens (IGNORE_INDEX left out):
    each in float32, summed in float64 (a long choice's sum keeps its last digits). Logits
    sharded over the vocabulary (loss parallel) are gathered first: the rows are short."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    scored = labels != IGNORE_INDEX
    picked = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked.double() * scored).sum(dim=-1)


def _scored(pipeline, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """Per-row scores through a pipeline: each micro-batch's rows as the last stage computes
    them (in micro-batch order), None on the ranks of the other stages."""
    rows: list[torch.Tensor] = []

    def score(output: torch.Tensor, micro_labels: torch.Tensor) -> torch.Tensor:
        rows.append(continuation_logprobs(output, micro_labels))
        return rows[-1].sum()  # what the schedule keeps as the micro-batch's loss

    pipeline.forward_loss(inputs, labels, score)
    return torch.cat(rows) if pipeline.has_last else None


class DownstreamEvaluator:
    def __init__(
        self,
        tasks: list[Task],
        tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        device: torch.device,
        dp_rank: int = 0,
        dp_degree: int = 1,
        ranks_per_dp_rank: int = 1,
        width_multiple: int = 1,
        fixed_width: int | None = None,
        flops_per_token=None,
        columns=None,
        cp_group=None,
        compute_context=None,
    ):
        """``ranks_per_dp_rank``: ranks that hold the same items (tensor parallelism), whose
        equal sums the all-reduce adds more than once. ``width_multiple``: what a batch's length
        must divide by (tensor parallelism's sequence-parallel regions split it evenly).
        ``fixed_width``: every batch's length (a pipeline's stages have buffers of one shape).
        ``flops_per_token(length)``: a token's training FLOPs in a sequence of that length; a
        third of it, the forward, counts the evaluation's FLOPs (eval/tflop).
        ``columns``, ``cp_group``: under context parallelism, what this rank keeps of a batch
        (its chunks of each row) and the group whose ranks hold the rest of the same rows."""
        self.tasks, self.seq_len, self.batch = tasks, seq_len, local_batch_size
        self.device, self.dp_rank, self.dp_degree = device, dp_rank, dp_degree
        self.ranks_per_dp_rank, self.compute_context = ranks_per_dp_rank, compute_context
        self.width_multiple, self.fixed_width = width_multiple, fixed_width
        self.columns, self.cp_group = columns, cp_group
        # Every rank's rows, grouped by rank once (item i goes to rank i % dp_degree): every rank
        # sizes its batches by the rank with the most rows, and counts all ranks' FLOPs.
        self.rows = {task.name: self._rows(task, tokenizer) for task in tasks}
        # The same batches at every evaluation: their FLOPs (every rank's, padding included) once.
        self.tflop = None
        if flops_per_token is not None:
            self.tflop = (
                sum(
                    len(chunk) * width * flops_per_token(width) / 3
                    for task in tasks
                    for rank in range(dp_degree)
                    for chunk, width in self._chunks(task, rank)
                )
                / 1e12
            )

    def _rows(self, task: Task, tokenizer) -> list[list[tuple[int, list[int], list[int]]]]:
        """Per data-parallel rank, (item index, inputs, labels) of every choice of its items, in
        item order; a context cut from the left is said once per task."""
        rows, truncated = [[] for _ in range(self.dp_degree)], 0
        for index, item in enumerate(task.items):
            for choice in item.choices:
                inputs, labels, cut = choice_row(tokenizer, item.context, choice, self.seq_len)
                rows[index % self.dp_degree].append((index, inputs, labels))
                truncated += cut
        if truncated and self.dp_rank == 0:
            logger.warning(
                "eval task %s: %d choice row(s) longer than seq_len + 1 = %d tokens, cut from the left",
                task.name,
                truncated,
                self.seq_len + 1,
            )
        return rows

    def _chunks(self, task: Task, rank: int):
        """Data-parallel rank ``rank``'s rows in batches of the local batch size, with each
        batch's length; as many batches on every rank, the padding rows with index -1. A batch
        is as long as its longest row (the rows are short; the forwards need not share a shape
        across ranks)."""
        mine, most = self.rows[task.name][rank], max(map(len, self.rows[task.name]))
        for start in range(0, math.ceil(most / self.batch) * self.batch, self.batch):
            chunk = mine[start : start + self.batch]
            chunk += [(-1, [0], [IGNORE_INDEX])] * (self.batch - len(chunk))
            width = math.ceil(max(len(row[1]) for row in chunk) / self.width_multiple) * self.width_multiple
            yield chunk, self.fixed_width or width

    def _batches(self, task: Task):
        """This rank's batches as (inputs, labels, item indices)."""
        for chunk, width in self._chunks(task, self.dp_rank):
            inputs, labels = padded_batch([(row[1], row[2]) for row in chunk], width, self.device)
            yield inputs, labels, [row[0] for row in chunk]

    def choice_logprobs(self, model, task: Task) -> dict[int, list[float]]:
        """Item index -> the log-likelihood of each of its choices, for this rank's items."""
        pipeline = getattr(model, "pipeline", None)  # a pipeline stage's part of the model runs through it
        row_scores, row_items = [], []
        for inputs, labels, indices in self._batches(task):
            if self.columns is not None:  # context parallelism: this rank's chunks of every row
                inputs, labels = self.columns(inputs), self.columns(labels)
            with self.compute_context or contextlib.nullcontext():
                batch_scores = (
                    continuation_logprobs(model(inputs), labels)
                    if pipeline is None
                    else _scored(pipeline, inputs, labels)
                )
            if batch_scores is not None:  # None: a pipeline stage before the last, which scores
                row_scores.append(batch_scores)
                row_items += indices
        scores: dict[int, list[float]] = {}
        if not row_scores:
            return scores
        row_scores = torch.cat(row_scores)
        if self.cp_group is not None:  # each cp rank summed its own positions of the same rows
            dist.all_reduce(row_scores, op=dist.ReduceOp.SUM, group=self.cp_group)
        for index, logprob in zip(row_items, row_scores.tolist(), strict=True):
            if index >= 0:
                scores.setdefault(index, []).append(logprob)
        return scores

    def _task_sums(self, model, task: Task) -> torch.Tensor:
        """[correct, correct normalised, nll of the correct choices, their bytes, items] of this
        rank's items, float64."""
        sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        for index, logprobs in self.choice_logprobs(model, task).items():
            item = task.items[index]
            lengths = [max(len(choice), 1) for choice in item.choices]
            normalised = [logprob / length for logprob, length in zip(logprobs, lengths, strict=True)]
            sums += torch.tensor(
                [
                    float(max(range(len(logprobs)), key=logprobs.__getitem__) == item.label),
                    float(max(range(len(normalised)), key=normalised.__getitem__) == item.label),
                    -logprobs[item.label],
                    len(item.choices[item.label].encode("utf-8")),
                    1.0,
                ],
                dtype=torch.float64,
            )
        return sums

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """{"eval/<task>/acc", ".../acc_norm", ".../bpb", "eval/tflop", "eval/seconds"} over every
        rank's items."""
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                sums = torch.stack([self._task_sums(model, task) for task in self.tasks]).to(self.device)
        finally:
            model.train(was_training)
        if dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        sums = (sums / self.ranks_per_dp_rank).tolist()
        metrics = {}
        for task, (acc, acc_norm, nll, nbytes, items) in zip(self.tasks, sums, strict=True):
            metrics[f"eval/{task.name}/acc"] = acc / items
            metrics[f"eval/{task.name}/acc_norm"] = acc_norm / items
            metrics[f"eval/{task.name}/bpb"] = nll / max(nbytes, 1.0) / math.log(2)
        if self.tflop is not None:
            metrics["eval/tflop"] = self.tflop
        metrics["eval/seconds"] = time.perf_counter() - start
        return metrics
