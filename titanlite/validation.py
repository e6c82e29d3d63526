"""Held-out loss: the mean next-token loss and perplexity of the model on data it never trains on.

Every evaluation reads the same windows from the start of the held-out token stream, so the
numbers of different steps (and of different parallel layouts) are directly comparable.

The held-out stream is the training loader's stream (``titanlite.data.loader``): documents as
``[bos] + ids + [eos]``, concatenated and cut into windows of ``seq_len + 1`` tokens. That stream
repeats forever, so the validator decides up front how many whole windows one evaluation covers
(at most one pass over the held-out documents) and turns that into a step count that every rank
shares: FSDP all-gathers inside ``forward``, so a rank that stopped early would hang the others.

    validator = build_validator(job_config.validation, tokenizer=..., training_seq_len=...,
                                training_local_batch_size=..., loss_fn=..., device=...)
    metrics = validator.validate(model)   # {"loss", "perplexity", "tokens", "steps"}
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from titanlite.data import PackedLoader, build_documents

logger = logging.getLogger(__name__)

DocumentSource = Callable[[], Iterator[str]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The held-out split name given to python_stdlib and Hugging Face datasets (text has no splits).
VALIDATION_SPLIT = "validation"


def build_validation_documents(validation_config) -> DocumentSource:
    """The held-out documents named by a ``Validation`` config section.

    python_stdlib reads its built-in "validation" split (disjoint from the training split),
    huggingface reads the "validation" split of ``dataset_path`` and text reads the files at
    ``dataset_path``. Errors are one-line ValueErrors naming the ``validation.`` key.
    """
    try:
        return build_documents(validation_config.dataset, validation_config.dataset_path, split=VALIDATION_SPLIT)
    except ValueError as error:
        # The data package names "dataset" / "dataset_path"; say which section they belong to.
        message = str(error)
        prefix = "validation." if message.startswith("dataset") else "validation dataset: "
        raise ValueError(prefix + message) from None


def count_windows(documents: DocumentSource, tokenizer, seq_len: int, limit: int | None = None) -> int:
    """Whole windows of ``seq_len + 1`` tokens in one pass over ``documents``, at most ``limit``.

    Counts with the loader's framing (optional BOS, the ids, EOS) and stops reading as soon as
    ``limit`` windows are certain, so a fixed step count never reads more than it evaluates.
    """
    tokens_per_window = seq_len + 1
    framing = (0 if tokenizer.bos_id is None else 1) + 1  # [bos] ... [eos]
    limit_tokens = None if limit is None else limit * tokens_per_window
    total = 0
    for document in documents():
        total += len(tokenizer.encode(document)) + framing
        if limit_tokens is not None and total >= limit_tokens:
            break
    windows = total // tokens_per_window  # a final partial window would wrap into the next pass
    return windows if limit is None else min(windows, limit)


class Validator:
    """Computes the global held-out loss of a model, sharded (FSDP) or not.

    Args:
        documents: zero-argument callable yielding the held-out documents from the start.
        tokenizer: the training tokenizer (needs an EOS id, like the training loader).
        seq_len, local_batch_size: window length and windows per rank per forward.
        steps: forward passes per evaluation; -1 means one whole pass over the held-out set.
            A larger number than one pass holds is capped at one pass (with a warning).
        loss_fn: ``loss_fn(logits, labels)`` -> the loss summed (not averaged) over tokens.
        compute_context: entered around each forward (autocast, or None for none).
        device: where inputs go; the model must already be there.
        dp_rank, dp_degree: this rank's place in the data-parallel group.
        process_group: group to all-reduce the totals over (None: the default group).
        ranks_per_dp_rank: ranks in the group that read the same windows (the tensor-parallel
            degree), whose totals the all-reduce therefore counts that many times.
    """

    def __init__(
        self,
        documents: DocumentSource,
        tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        steps: int,
        loss_fn: LossFn,
        compute_context: contextlib.AbstractContextManager | None = None,
        device: torch.device | str = "cpu",
        dp_rank: int = 0,
        dp_degree: int = 1,
        process_group: dist.ProcessGroup | None = None,
        ranks_per_dp_rank: int = 1,
    ):
        if isinstance(steps, bool) or not isinstance(steps, int) or not (steps == -1 or steps >= 1):
            raise ValueError(f"validation.steps: expected -1 or a positive int, got {steps!r}")
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.loss_fn = loss_fn
        self.compute_context = compute_context
        self.device = torch.device(device)
        self.process_group = process_group
        self.ranks_per_dp_rank = ranks_per_dp_rank
        # Building a loader now checks seq_len, batch size, rank and tokenizer with the loader's own errors.
        self._new_loader()
        self.windows, self.steps = self._plan(steps)
        self._steps_agreed = False

    # --- planning ---------------------------------------------------------------------------

    def _plan(self, requested_steps: int) -> tuple[int, int]:
        """(windows evaluated, forward passes per rank) for ``requested_steps``."""
        windows_per_step = self.local_batch_size * self.dp_degree
        limit = None if requested_steps == -1 else requested_steps * windows_per_step
        windows = count_windows(self.documents, self.tokenizer, self.seq_len, limit)
        if windows == 0:
            raise ValueError(
                f"validation: the held-out documents hold less than one window of seq_len + 1 = "
                f"{self.seq_len + 1} tokens"
            )
        steps = math.ceil(windows / windows_per_step)
        if limit is not None and windows < limit:
            logger.warning(
                "validation.steps %d needs %d windows but the held-out set has %d: evaluating them once (%d steps)",
                requested_steps,
                limit,
                windows,
                steps,
            )
        return windows, steps

    def _new_loader(self) -> PackedLoader:
        return PackedLoader(
            self.documents, self.tokenizer, self.seq_len, self.local_batch_size, self.dp_rank, self.dp_degree
        )

    def _rows_in_set(self, step: int) -> int:
        """How many of this rank's rows at ``step`` are held-out windows (the rest wrapped into a
        second pass and only keep the forward count equal across ranks)."""
        first_window = (step * self.dp_degree + self.dp_rank) * self.local_batch_size
        return max(0, min(self.local_batch_size, self.windows - first_window))

    def _check_ranks_agree(self) -> None:
        """Every rank must run the same number of forwards; a mismatch (a rank reading other
        documents) would hang FSDP's collectives, so fail loudly instead, once."""
        if self._steps_agreed or not dist.is_initialized():
            return
        bounds = torch.tensor([self.steps, -self.steps], device=self.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.process_group)
        most, fewest = int(bounds[0]), -int(bounds[1])
        if most != fewest:
            raise RuntimeError(
                f"validation: ranks disagree on the step count ({fewest} to {most}); "
                "the held-out documents differ between ranks"
            )
        self._steps_agreed = True

    # --- evaluation -------------------------------------------------------------------------

    def validate(self, model: torch.nn.Module) -> dict:
        """The global mean loss per token over every rank's held-out tokens, and its perplexity.

        Runs ``self.steps`` forwards on every rank under ``torch.no_grad()`` in eval mode and
        puts the model back in the mode it was in. Returns ``{"loss", "perplexity", "tokens", "steps"}``.
        """
        self._check_ranks_agree()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                totals = self._local_totals(model)
        finally:
            model.train(was_training)
        if dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.process_group)
        loss_sum, tokens = (total / self.ranks_per_dp_rank for total in totals.tolist())
        loss = loss_sum / tokens
        return {"loss": loss, "perplexity": _perplexity(loss), "tokens": int(tokens), "steps": self.steps}

    def _local_totals(self, model: torch.nn.Module) -> torch.Tensor:
        """[summed loss, target tokens] over this rank's windows, float64 on the device.

        Accumulated on the device so that no step waits for it; float64 so that thousands of
        float32 batch sums add up without visible rounding.
        """
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        loader = self._new_loader()  # from the start: the same windows at every evaluation
        for step in range(self.steps):
            inputs, labels = (t.to(self.device) for t in loader.next_batch())
            with self.compute_context or contextlib.nullcontext():
                logits = model(inputs)
            rows = self._rows_in_set(step)
            if rows > 0:
                totals[0] += self.loss_fn(logits[:rows], labels[:rows]).double()
                totals[1] += rows * self.seq_len
            del logits
        return totals


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:  # a diverged model
        return math.inf


def build_validator(
    validation_config, *, tokenizer, training_seq_len: int, training_local_batch_size: int, **options
) -> Validator:
    """A Validator for a ``Validation`` config section; -1 sizes fall back to the training
    ones, and `options` (loss_fn, compute_context, device, dp_rank, ...) go to Validator.

    The model's RoPE tables are built for ``training_seq_len`` tokens, so a longer
    ``validation.seq_len`` is refused here rather than failing inside the first forward.
    """
    seq_len = training_seq_len if validation_config.seq_len == -1 else validation_config.seq_len
    if seq_len > training_seq_len:
        raise ValueError(
            f"validation.seq_len ({seq_len}) must not exceed training.seq_len ({training_seq_len}), "
            "the length the model's position tables are built for"
        )
    local_batch_size = (
        training_local_batch_size if validation_config.local_batch_size == -1 else validation_config.local_batch_size
    )
    return Validator(
        build_validation_documents(validation_config),
        tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        steps=validation_config.steps,
        **options,
    )
