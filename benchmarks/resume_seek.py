"""How long a resume takes to find its place in the data, against how far training got.

    python benchmarks/resume_seek.py                  # about a minute
    python benchmarks/resume_seek.py --tokens 5000000 # quicker, noisier

The loader's checkpointed state is a count of windows, so a resumed run finds its place
by reading and tokenizing the token stream from its start up to that count (every rank
does so at the same time). This script loads such a state into a loader (one rank,
windows of 2048 tokens) and times its first batch, which pays that fast-forward over
`--tokens` tokens of the default dataset (python_stdlib), with two tokenizers:

  byte   titanlite's byte tokenizer (the debug model's)
  bpe    a byte-level BPE tokenizer of 8,192 ids trained here, in this run, on the first
         300 documents with the `tokenizers` library, as a stand-in for a real subword
         tokenizer (nothing is downloaded)

For each it prints the tokens per second of the fast-forward and the hours a resume would
spend on it after 1e11 tokens of training (a week on a mid-sized cluster). The last line is

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
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<s>", "</s>"],
                                                              show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    return HFTokenizer(str(folder / "tokenizer.json"))


def fast_forward_seconds(documents, tokenizer, tokens: int) -> float:
    """Seconds from loading a checkpointed loader state `tokens` into the stream to the
    first batch after it, on one rank: what a resume pays before its first step."""
    loader = PackedLoader(documents, tokenizer, SEQ_LEN, local_batch_size=1, dp_rank=0, dp_degree=1)
    loader.load_state_dict({"windows_consumed": tokens // (SEQ_LEN + 1), "seq_len": SEQ_LEN})
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
        print(f"{os.cpu_count()} cores, {datetime.date.today().isoformat()}; fast-forward over {args.tokens:,} tokens "
              "of python_stdlib (the stream repeats when it runs out)\n")
        print("| tokenizer | seconds | M tokens/s | hours to resume after 1e11 tokens |")
        print("|---|---|---|---|")
        lines = []
        for name, tokenizer in tokenizers.items():
            seconds = fast_forward_seconds(documents, tokenizer, args.tokens)
            rate = args.tokens / seconds
            hours = TRAINED_TOKENS / rate / 3600
            print(f"| {name} | {seconds:.1f} | {rate / 1e6:.2f} | {hours:,.1f} |")
            lines.append(f"{name} fast-forward: {rate / 1e6:.2f} M tokens/s, {hours:,.1f} h to resume after 1e11 tokens")
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
