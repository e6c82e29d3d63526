"""Packing documents into fixed-length windows and splitting the global batch over data-parallel ranks.

The token stream is every document as ``[bos] + ids + [eos]``, concatenated, repeated forever
(epoch after epoch, with no gap or padding between epochs). The stream is cut into consecutive
windows of ``seq_len + 1`` tokens; window k is tokens ``[k * (seq_len + 1), (k + 1) * (seq_len + 1))``.

The loader's only state is how many windows the whole data-parallel group has consumed. Because
that number does not depend on how the group is laid out, a run can be resumed with another
dp degree or micro-batch size and still see exactly the same windows in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .sources import build_documents
from .tokenizer import ByteTokenizer, HFTokenizer

Tokenizer = ByteTokenizer | HFTokenizer
DocumentSource = Callable[[], Iterator[str]]


class _TokenStream:
    """A forward-only cursor over the infinite token stream, restartable from token 0."""

    def __init__(self, documents: DocumentSource, tokenizer: Tokenizer):
        self._documents = documents
        self._tokenizer = tokenizer
        self._document_prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        self._document_suffix = [tokenizer.eos_id]
        self.restart()

    def restart(self) -> None:
        self._tokenized_documents = self._tokenize_forever()
        self._buffer: list[int] = []  # tokens read from documents but not yet consumed ...
        self._buffer_start = 0  # ... starting at this index (avoids shifting the list on every take)
        self.position = 0  # tokens consumed since the start of the stream

    def seek(self, target_position: int) -> None:
        """Move the cursor to ``target_position``; going backwards re-reads from the start."""
        if target_position < self.position:
            self.restart()
        self._skip(target_position - self.position)

    def take(self, count: int) -> list[int]:
        """The next ``count`` tokens."""
        self._compact_buffer()
        while len(self._buffer) < count:
            self._buffer.extend(next(self._tokenized_documents))
        taken = self._buffer[:count]
        self._buffer_start = count
        self.position += count
        return taken

    def _skip(self, count: int) -> None:
        # Count tokens only: whole documents that fall inside the skipped range are never buffered.
        buffered = len(self._buffer) - self._buffer_start
        if count <= buffered:
            self._buffer_start += count
            self.position += count
            return
        remaining = count - buffered
        self.position += buffered
        document_tokens = next(self._tokenized_documents)
        while len(document_tokens) <= remaining:
            remaining -= len(document_tokens)
            self.position += len(document_tokens)
            document_tokens = next(self._tokenized_documents)
        self._buffer = document_tokens
        self._buffer_start = remaining
        self.position += remaining

    def _compact_buffer(self) -> None:
        if self._buffer_start:
            del self._buffer[: self._buffer_start]
            self._buffer_start = 0

    def _tokenize_forever(self) -> Iterator[list[int]]:
        while True:
            yielded_any = False
            for document in self._documents():
                yielded_any = True
                yield self._document_prefix + self._tokenizer.encode(document) + self._document_suffix
            if not yielded_any:
                # Without this check an empty source would loop here forever.
                raise ValueError("documents: the document source yielded no documents for an epoch")


class PackedLoader:
    """Yields this rank's ``(inputs, labels)`` micro-batch of packed windows; resumable (Stateful).

    Call ``next_batch()`` (or iterate) once per micro-batch on every data-parallel rank: each call
    hands rank r the windows ``[pos + r*b, pos + (r+1)*b)`` and moves ``pos`` by ``b * dp_degree``.
    """

    def __init__(
        self,
        documents: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
    ):
        _require_positive_int("seq_len", seq_len)
        _require_positive_int("local_batch_size", local_batch_size)
        _require_positive_int("dp_degree", dp_degree)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank: expected an int in [0, {dp_degree}), got {dp_rank!r}")
        if tokenizer.eos_id is None:
            # Without a separator, packed documents would run into each other undetectably.
            tokenizer_name = getattr(tokenizer, "path", type(tokenizer).__name__)
            raise ValueError(f"tokenizer {tokenizer_name}: has no EOS token, which packing needs between documents")
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.tokenizer = tokenizer
        self.windows_consumed = 0  # by the whole data-parallel group, so independent of the layout
        self._stream = _TokenStream(documents, tokenizer)

    @property
    def tokens_per_window(self) -> int:
        # One extra token so that labels (inputs shifted by one) fit in the same window.
        return self.seq_len + 1

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch: int64 ``inputs`` and ``labels`` of shape [local_batch_size, seq_len]."""
        first_window = self.windows_consumed + self.dp_rank * self.local_batch_size
        self._stream.seek(first_window * self.tokens_per_window)
        tokens = self._stream.take(self.local_batch_size * self.tokens_per_window)
        windows = torch.tensor(tokens, dtype=torch.int64).view(self.local_batch_size, self.tokens_per_window)
        self.windows_consumed += self.local_batch_size * self.dp_degree
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        # Only layout-independent values, so a checkpoint can be loaded at another dp degree.
        return {"windows_consumed": self.windows_consumed, "seq_len": self.seq_len}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the saved position; the stream is re-read lazily on the next ``next_batch()``."""
        saved_seq_len = _read_state_int(state_dict, "seq_len")
        if saved_seq_len != self.seq_len:
            raise ValueError(
                f"dataloader state 'seq_len': checkpoint was saved with seq_len {saved_seq_len}, "
                f"this run uses {self.seq_len}; the window positions would not match"
            )
        windows_consumed = _read_state_int(state_dict, "windows_consumed")
        if windows_consumed < 0:
            raise ValueError(f"dataloader state 'windows_consumed': expected >= 0, got {windows_consumed}")
        self.windows_consumed = windows_consumed


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _read_state_int(state_dict: dict, key: str) -> int:
    if key not in state_dict:
        raise ValueError(f"dataloader state: missing key {key!r} (have {sorted(state_dict)})")
    value = state_dict[key]
    # A checkpoint may hand back a 0-d tensor instead of a Python int.
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"dataloader state {key!r}: expected an int, got {value!r}")
    return value


def build_loader(
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    split: str = "train",
) -> PackedLoader:
    """The documents of ``dataset`` packed into windows for one data-parallel rank."""
    documents = build_documents(dataset, dataset_path, split)
    return PackedLoader(documents, tokenizer, seq_len, local_batch_size, dp_rank, dp_degree)
