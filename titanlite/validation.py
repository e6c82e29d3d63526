"""Held-out loss: the mean next-token loss and perplexity of the model on data it never trains on.

Every evaluation reads the same windows from the start of the held-out token stream, so the
numbers of different steps (and of different parallel layouts) are directly comparable.

The held-out windows come from a window source of the data package, read in order, unshuffled:

* ``validation.dataset = "prepared"``: a folder made by ``python -m titanlite.data.prepare``,
  read through memory maps. Each data-parallel rank reads only its own windows, and nothing is
  tokenized while training runs.
* ``python_stdlib``: the built-in corpus's validation split, prepared into data.cache_folder
  on first use and then read the same way.
* any other dataset: a raw stream, tokenized on every rank at every evaluation (small data).

Both are the stream of documents as ``[bos] + ids + [eos]``, concatenated and cut into windows
of ``seq_len + 1`` tokens, so a prepared folder and the raw source it was prepared from give
the same windows and the same loss. The stream repeats forever, so the validator decides up
front how many whole windows one evaluation covers (at most one pass over the held-out
documents) and turns that into a step count that every rank shares: FSDP all-gathers inside
``forward``, so a rank that stopped early would hang the others.

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

from titanlite.config.training import Data
from titanlite.data import DataLoader, PreparedWindows, StreamWindows, open_windows, parse_mixture

logger = logging.getLogger(__name__)

DocumentSource = Callable[[], Iterator[str]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
HeldOutWindows = PreparedWindows | StreamWindows

# A label that cross-entropy leaves out (torch's default ignore_index).
IGNORE_INDEX = -100

# The held-out split name given to python_stdlib and Hugging Face datasets (text has no splits).
VALIDATION_SPLIT = "validation"


def _with_validation_key(error: ValueError) -> ValueError:
    """The data package names "dataset" / "dataset_path" without a section: say it is validation's."""
    message = str(error)
    if message.startswith("dataset"):
        return ValueError("validation." + message)
    if message.startswith(("validation", "data.")):  # already names its key
        return ValueError(message)
    return ValueError("validation dataset: " + message)


def validation_seq_len(validation_config, training_seq_len: int) -> int:
    """``validation.seq_len``, -1 meaning the training one. The model's RoPE tables are built for
    ``training_seq_len`` tokens, so a longer one is refused here rather than inside the first forward."""
    seq_len = training_seq_len if validation_config.seq_len == -1 else validation_config.seq_len
    if seq_len > training_seq_len:
        raise ValueError(
            f"validation.seq_len ({seq_len}) must not exceed training.seq_len ({training_seq_len}), "
            "the length the model's position tables are built for"
        )
    return seq_len


def open_held_out(
    validation_config, tokenizer, training_seq_len: int, *, hf_assets_path: str | None, cache_folder: str
) -> HeldOutWindows:
    """The held-out window source of a ``Validation`` section, in stream order (never shuffled).

    A prepared folder is checked as training checks its own (manifest, file sizes, the
    tokenizer's fingerprint); python_stdlib's validation split is prepared into
    ``cache_folder`` on first use. Errors are one-line ValueErrors naming the key.
    """
    seq_len = validation_seq_len(validation_config, training_seq_len)
    dataset, path = validation_config.dataset, validation_config.dataset_path
    try:
        if dataset == "prepared" and path and len(parse_mixture(path, "validation.dataset_path")) > 1:
            # One pass over a mixture is not defined: its folders repeat at different rates.
            raise ValueError(f"validation.dataset_path {path!r}: expected one prepared folder, not a mixture")
        return open_windows(
            dataset,
            path,
            tokenizer,
            seq_len,
            hf_assets_path=hf_assets_path,
            shuffle=False,
            seed=0,
            cache_folder=cache_folder,
            split=VALIDATION_SPLIT,
            section="validation",
        )
    except ValueError as error:
        raise _with_validation_key(error) from None


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


def windows_in_one_pass(held_out: HeldOutWindows, limit: int | None = None) -> int:
    """Whole windows in one pass over the held-out stream, at most ``limit``: read from a
    prepared folder's manifest, counted by tokenizing a raw source."""
    if isinstance(held_out, PreparedWindows):
        (windows,) = held_out.windows_per_epoch  # one folder: its tail past the last whole window is never read
        return windows if limit is None else min(windows, limit)
    return count_windows(held_out.documents, held_out.tokenizer, held_out.seq_len, limit)


class Validator:
    """Computes the global held-out loss of a model, sharded (FSDP) or not.

    Args:
        held_out: the held-out window source (``open_held_out``), read from its start at every
            evaluation; its ``seq_len`` is the validation window length.
        local_batch_size: windows per rank per forward.
        steps: forward passes per evaluation; -1 means one whole pass over the held-out set.
            A larger number than one pass holds is capped at one pass (with a warning).
        loss_fn: ``loss_fn(logits, labels)`` -> the loss summed (not averaged) over tokens.
        compute_context: entered around each forward (autocast, or None for none).
        device: where inputs go; the model must already be there.
        dp_rank, dp_degree: this rank's place in the data-parallel group. Step s of rank r
            reads windows ``[(s * dp_degree + r) * b, ... + b)`` (b: local_batch_size), the
            training loader's split, so the blocks of b windows are the same at every degree.
        process_group: group to all-reduce the totals over (None: the default group).
        ranks_per_dp_rank: ranks in the group that hold the loss of the same windows (the
            tensor-parallel degree), whose totals the all-reduce therefore counts that many times.
        columns: what this rank keeps of each row (context parallelism: its chunks of every
            sequence, whose losses and tokens the all-reduce adds up), or None for all of it.
        forward_loss: for a model that is not called as a whole (the stages of a pipeline):
            ``forward_loss(model, inputs, labels)`` -> the loss summed over the batch, the
            labels of rows outside the held-out set being IGNORE_INDEX, or None on a rank that
            computes no loss (whose tokens then do not count). Used instead of
            ``loss_fn(model(inputs), labels)``.
    """

    def __init__(
        self,
        held_out: HeldOutWindows,
        *,
        local_batch_size: int,
        steps: int,
        loss_fn: LossFn,
        compute_context: contextlib.AbstractContextManager | None = None,
        device: torch.device | str = "cpu",
        dp_rank: int = 0,
        dp_degree: int = 1,
        process_group: dist.ProcessGroup | None = None,
        ranks_per_dp_rank: int = 1,
        forward_loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
        columns: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if isinstance(steps, bool) or not isinstance(steps, int) or not (steps == -1 or steps >= 1):
            raise ValueError(f"validation.steps: expected -1 or a positive int, got {steps!r}")
        self.held_out = held_out
        self.seq_len = held_out.seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.loss_fn = loss_fn
        self.compute_context = compute_context
        self.device = torch.device(device)
        self.process_group = process_group
        self.ranks_per_dp_rank = ranks_per_dp_rank
        self.forward_loss = forward_loss
        self.columns = columns
        # Building a loader now checks batch size and rank with the loader's own errors.
        self._new_loader()
        self.windows, self.steps = self._plan(steps)
        self._steps_agreed = False

    # --- planning ---------------------------------------------------------------------------

    def _plan(self, requested_steps: int) -> tuple[int, int]:
        """(windows evaluated, forward passes per rank) for ``requested_steps``."""
        windows_per_step = self.local_batch_size * self.dp_degree
        limit = None if requested_steps == -1 else requested_steps * windows_per_step
        windows = windows_in_one_pass(self.held_out, limit)
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

    def _new_loader(self) -> DataLoader:
        """A loader at the first held-out window, reading on the calling thread: each rank reads
        only its own windows of a prepared folder (a raw stream is tokenized up to them)."""
        return DataLoader(self.held_out, self.local_batch_size, self.dp_rank, self.dp_degree, columns=self.columns)

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
            rows = self._rows_in_set(step)
            loss = self._summed_loss(model, inputs, labels, rows)
            if loss is not None:
                totals[0] += loss.double()
                totals[1] += rows * labels.shape[1]  # this rank's tokens of each row
        return totals

    def _summed_loss(self, model: torch.nn.Module, inputs, labels, rows: int) -> torch.Tensor | None:
        """The loss summed over the first ``rows`` rows of the batch (the held-out ones), or
        None where this rank computes none."""
        if self.forward_loss is not None:
            if rows < len(labels):  # the whole batch goes through (its shape is fixed), these rows uncounted
                labels = labels.clone()
                labels[rows:] = IGNORE_INDEX
            with self.compute_context or contextlib.nullcontext():
                return self.forward_loss(model, inputs, labels)
        with self.compute_context or contextlib.nullcontext():
            logits = model(inputs)
        return self.loss_fn(logits[:rows], labels[:rows]) if rows > 0 else None


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:  # a diverged model
        return math.inf


def build_validator(
    validation_config,
    *,
    tokenizer,
    training_seq_len: int,
    training_local_batch_size: int,
    hf_assets_path: str | None = None,
    cache_folder: str = Data.cache_folder,
    **options,
) -> Validator:
    """A Validator for a ``Validation`` config section; -1 sizes fall back to the training
    ones, ``open_held_out`` opens the data, and `options` (loss_fn, compute_context, device,
    dp_rank, ...) go to Validator."""
    held_out = open_held_out(
        validation_config, tokenizer, training_seq_len, hf_assets_path=hf_assets_path, cache_folder=cache_folder
    )
    local_batch_size = (
        training_local_batch_size if validation_config.local_batch_size == -1 else validation_config.local_batch_size
    )
    return Validator(held_out, local_batch_size=local_batch_size, steps=validation_config.steps, **options)
