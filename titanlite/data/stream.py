"""Windows of a raw document source, tokenized as they are read: for small runs and quick looks.

The token stream is every document as ``[bos] + ids + [eos]``, concatenated, repeated forever
(epoch after epoch, with no gap between epochs); window k is tokens
``[k * (seq_len + 1), (k + 1) * (seq_len + 1))``. Reading a window means tokenizing everything
before it that this reader has not passed yet, so every data-parallel rank tokenizes the whole
stream: prepared data (``prepare.py``) is the path that scales.

A resume does not tokenize from the start: the loader saves a document cursor, (epoch, document
index, the stream position where that document starts), and a reader restored to it skips the
earlier documents without tokenizing them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

DocumentSource = Callable[[], Iterator[str]]
Cursor = tuple[int, int, int]  # (epoch, document index within the epoch, stream position of its first token)

START: Cursor = (0, 0, 0)


class TokenStream:
    """A forward-only reader of the infinite token stream that knows which document it is in."""

    def __init__(self, documents: DocumentSource, tokenizer):
        self._open_documents = documents
        self._tokenizer = tokenizer
        self._prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        self.restore(START)

    def restore(self, cursor: Cursor) -> None:
        """Continue at the start of the document ``cursor`` names."""
        epoch, document, position = cursor
        self._documents = self._framed_documents(epoch, document)
        self._document: list[int] = []  # the current document's tokens ...
        self._offset = 0  # ... of which this many are behind the reader
        self._cursor = cursor
        self.position = position  # the next token's index in the stream

    def seek(self, target: int) -> Cursor:
        """Move to stream token ``target``; returns the cursor of the document that holds it."""
        if target < self.position:
            self.restore(START)
        # Skip whole documents (tokenized, not copied) until the one holding target is current.
        while self.position + len(self._document) - self._offset <= target:
            self.position += len(self._document) - self._offset
            self._next_document()
        self._offset += target - self.position
        self.position = target
        return self._cursor

    def take(self, count: int) -> list[int]:
        """The next ``count`` tokens."""
        taken: list[int] = []
        while len(taken) < count:
            if self._offset == len(self._document):
                self._next_document()
            end = min(len(self._document), self._offset + count - len(taken))
            taken.extend(self._document[self._offset : end])
            self.position += end - self._offset
            self._offset = end
        return taken

    def _next_document(self) -> None:
        epoch, index, self._document = next(self._documents)
        self._cursor = (epoch, index, self.position)
        self._offset = 0

    def _framed_documents(self, epoch: int, first_document: int) -> Iterator[tuple[int, int, list[int]]]:
        while True:
            count = 0
            for index, text in enumerate(self._open_documents()):
                count += 1
                if index >= first_document:  # earlier ones are passed over, not tokenized
                    yield epoch, index, self._prefix + self._tokenizer.encode(text) + [self._tokenizer.eos_id]
            if count == 0:
                # Without this check an empty source would loop here forever.
                raise ValueError("documents: the document source yielded no documents for an epoch")
            epoch, first_document = epoch + 1, 0


class StreamWindows:
    """Windows of ``seq_len + 1`` tokens cut from a raw source's token stream."""

    def __init__(self, documents: DocumentSource, tokenizer, seq_len: int, description: dict | None = None):
        if tokenizer.eos_id is None:
            # Without a separator, packed documents would run into each other undetectably.
            tokenizer_name = getattr(tokenizer, "path", type(tokenizer).__name__)
            raise ValueError(f"tokenizer {tokenizer_name}: has no EOS token, which packing needs between documents")
        self.seq_len = seq_len
        self.tokens_per_window = seq_len + 1
        self.tokenizer = tokenizer
        self.documents = documents
        self.description = {
            "kind": "stream",
            "tokenizer": getattr(tokenizer, "fingerprint", None),
            **(description or {}),
        }
        self._stream = TokenStream(documents, tokenizer)

    def read(self, first: int, count: int, mark: int) -> tuple[torch.Tensor, Cursor]:
        """Windows ``[first, first + count)`` as int64 ``[count, seq_len + 1]``, and the cursor of
        the document holding window ``mark`` (at or before ``first``), which the reader passes."""
        cursor = self._stream.seek(mark * self.tokens_per_window)
        self._stream.seek(first * self.tokens_per_window)
        tokens = self._stream.take(count * self.tokens_per_window)
        return torch.tensor(tokens, dtype=torch.int64).view(count, self.tokens_per_window), cursor

    def restore(self, cursor: Cursor) -> None:
        self._stream.restore(cursor)
