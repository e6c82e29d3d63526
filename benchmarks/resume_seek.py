"""How long a raw stream takes to find its place in the data when a resume has no document
cursor, against how far training got.

    python benchmarks/resume_seek.py                  # about a minute
    python benchmarks/resume_seek.py --tokens 5000000 # quicker, noisier

A raw stream (a dataset tokenized as it is read, not prepared) finds window k by tokenizing
the stream up to it. The loader's checkpointed state carries a document cursor (epoch,
document, stream position), so a resume normally skips the earlier documents without
tokenizing them. Without a usable cursor every rank tokenizes the stream from its start up
to the saved position: the cursor is dropped when a checkpoint of other or undescribed data
is loaded with data.allow_changed_data, and a state whose cursor is at the start has none.
This script measures that cost: it takes a real `state_dict()` from a fresh loader (so its
data description matches and the load is accepted), sets its `windows_consumed` to
`--tokens` tokens and leaves its cursor at the start, loads it into a new loader (one rank,
windows of 2048 tokens) and times the first batch, which pays the fast-forward over
`--tokens` tokens of the default dataset (python_stdlib), with two tokenizers:

  byte   titanlite's byte tokenizer (the debug model's)
  bpe    a byte-level BPE tokenizer of 8,192 ids trained here, in this run, on the first
         300 documents with the `tokenizers` library, as a stand-in for a real subword
         tokenizer (nothing is downloaded)

This is the raw stream's cost without a saved document cursor. Prepared data
(`python -m titanlite.data.prepare`, training.dataset = "prepared") seeks in O(1): any
window is found by arithmetic; benchmarks/data_loader.py measures that seek at 1e11 tokens.

For each tokenizer it prints the tokens per second of the fast-forward and the hours a
resume would spend on it after 1e11 tokens of training (a week on a mid-sized cluster).
The last line is

    bpe fast-forward: X.XX M tokens/s, N h to resume after 1e11 tokens
"""

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

from titanlite.data.loader import PackedLoader
from titanlite.data.sources import build_documents
from titanlite.data.tokenizer import ByteTokenizer, HFTokenizer

TRAINED_TOKENS = 1e11
SEQ_LEN = 2047  # windows of 2048 tokens


def train_bpe(documents, folder: Path) -> HFTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    first = documents()
    sample = [next(first) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(
        sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return HFTokenizer(str(folder / "tokenizer.json"))


def fast_forward_seconds(documents, tokenizer, tokens: int) -> float:
    """Seconds from loading a checkpointed loader state `tokens` into the stream to the
    first batch after it, on one rank: what a resume without a document cursor pays before
    its first step."""
    state = PackedLoader(documents, tokenizer, SEQ_LEN, local_batch_size=1, dp_rank=0, dp_degree=1).state_dict()
    state["windows_consumed"] = tokens // (SEQ_LEN + 1)  # the cursor stays at the start: no skipping
    loader = PackedLoader(documents, tokenizer, SEQ_LEN, local_batch_size=1, dp_rank=0, dp_degree=1)
    loader.load_state_dict(state)
    start = time.perf_counter()
    loader.next_batch()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000_000, help="tokens to fast-forward over")
    args = parser.parse_args()
    documents = build_documents("python_stdlib", None)
    with tempfile.TemporaryDirectory(prefix="titanlite-resume-seek-") as folder:
        tokenizers = {"byte": ByteTokenizer(), "bpe": train_bpe(documents, Path(folder))}
        print(
            f"{os.cpu_count()} cores, {datetime.date.today().isoformat()}; fast-forward over {args.tokens:,} tokens "
            "of python_stdlib (the stream repeats when it runs out)\n"
        )
        print("| tokenizer | seconds | M tokens/s | hours to resume after 1e11 tokens |")
        print("|---|---|---|---|")
        lines = []
        for name, tokenizer in tokenizers.items():
            seconds = fast_forward_seconds(documents, tokenizer, args.tokens)
            rate = args.tokens / seconds
            hours = TRAINED_TOKENS / rate / 3600
            print(f"| {name} | {seconds:.1f} | {rate / 1e6:.2f} | {hours:,.1f} |")
            lines.append(
                f"{name} fast-forward: {rate / 1e6:.2f} M tokens/s, {hours:,.1f} h to resume after 1e11 tokens"
            )
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
