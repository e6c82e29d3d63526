"""What prepared data costs a training rank: loader tokens/s against the dp degree, the resume
seek, and the throughput of preparing the data.

    python benchmarks/data_loader.py                  # about 3 minutes on 2 cores
    python benchmarks/data_loader.py --quick          # a smoke run of the whole script (~15 s)
    python benchmarks/data_loader.py --prepare-only   # part 3 alone (about 2 minutes on 2 cores)

Everything lives in a temporary folder that is removed at the end; nothing is downloaded.

1. Loader tokens/s per dp degree. The python_stdlib train split is prepared with the byte
   tokenizer (about 31 M tokens, written in shards of 4 M tokens so that reads cross shard
   files as on a large dataset) and read as `PreparedWindows` with the shuffle on and
   seq_len 2047 (windows of 2048 tokens). For each dp degree in 1, 8, 64, 512, 4096 a
   `DataLoader(windows, local_batch_size=8, dp_rank=0, dp_degree=dp, prefetch=0)` is built
   and its `next_batch()` calls are timed after a warm-up; tokens/s = batches x 8 x 2047 /
   seconds. The loader is plain arithmetic on the window index, so no process group is
   needed: rank 0 of a 4096-way group reads the windows it would read in a real run (at
   dp 4096 each step jumps 32,768 windows, two epochs of this data, so every batch also
   builds a new epoch permutation). The degrees take turns in `--rounds` rounds, each round
   starting with another degree, and each degree's figure is the median over the rounds, so
   other work on a shared machine does not land on one degree. "tokens/s per rank" is
   rank 0's figure at dp 1. Key ratio: dp4096 / dp1 (target >= 0.9).
2. Resume seek at 1e11 tokens. A real loader's `state_dict()` (so the data description
   matches) with `windows_consumed` set to 1e11 // 2048; per repeat the prepared folders
   are opened afresh (untimed, reported on a row of its own: memory maps and epoch
   permutations start cold, as in a resumed process), then a new `DataLoader` is built,
   the state loaded and the first batch read, all timed; the median of `--seek-repeats`.
   Measured on the folder above alone and on a mixture of it (weight 3) with the
   validation split prepared the same way (weight 1), shuffled; the key line is the
   mixture's. The pages read come from the page cache (the data was just written), so a
   cold disk would add its read latency for 8 windows of 4 KiB each.
3. Prepare throughput with an 8k BPE. A byte-level BPE of 8,192 ids (special tokens <unk>,
   <s>, </s>, so BOS and EOS are found) is trained with the `tokenizers` library on the first
   300 documents; the train documents (the first 150 with --quick) are written to a JSON
   lines file. The baseline encodes them with `HFTokenizer.encode`, one document at a time,
   in this process; then the same loop runs in os.cpu_count() forked processes at once,
   each on a share of the documents (nothing to read, ship or write: a reference for what
   the cores give this work at the time); then `prepare("text", ...)` with
   `workers=os.cpu_count()` tokenizes the file into a prepared folder, in a new Python
   process each turn that has imported titanlite (untimed) and times the call alone: the
   call starts its fork server and its workers, as every run of the command does. All
   three count the same framed tokens (ids plus BOS and EOS, checked equal) and take turns
   `--prepare-rounds` times (medians). prepare does more than the baseline: it also starts
   its processes, reads and parses the file, hands chunks to its workers (which call
   `encode_batch` per chunk) and writes the shards with their SHA-256 checksums, in a main
   process that shares the cores with the workers. TOKENIZERS_PARALLELISM is set to false
   for this script, so every encoder uses one core. Ratio prepare / baseline (target >= 1.6
   on 2 cores).

The last two lines are

    loader tokens/s dp4096/dp1 = X.XX (target >= 0.9)
    resume seek at 1e11 tokens = X.X ms (target <= 10)
"""

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one core per encoder

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from fractions import Fraction  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titanlite.data.loader import DataLoader, PreparedWindows  # noqa: E402
from titanlite.data.prepare import prepare  # noqa: E402
from titanlite.data.prepared import PreparedFolder  # noqa: E402
from titanlite.data.sources import build_documents  # noqa: E402
from titanlite.data.tokenizer import HFTokenizer  # noqa: E402

SEQ_LEN = 2047  # windows of 2048 tokens
SEEK_TOKENS = 10**11
SHARD_TOKENS = 1 << 22  # several shard files, as a large dataset has
DEGREES = (1, 8, 64, 512, 4096)
MIXTURE_WEIGHTS = (Fraction(3), Fraction(1))  # train split : validation split


def median_and_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


# --------------------------------------------------------------------------- 1. loader tokens/s


def loader_tokens_per_second(
    windows: PreparedWindows, batch: int, degrees: tuple[int, ...], batches: int, warmup: int, rounds: int
) -> dict[int, list[float]]:
    """Rank 0's tokens/s per dp degree, one figure per round; the degrees take turns."""
    rates: dict[int, list[float]] = {dp: [] for dp in degrees}
    for round_index in range(rounds):
        shift = round_index % len(degrees)
        for dp in degrees[shift:] + degrees[:shift]:
            loader = DataLoader(windows, local_batch_size=batch, dp_rank=0, dp_degree=dp, prefetch=0)
            for _ in range(warmup):
                loader.next_batch()
            start = time.perf_counter()
            for _ in range(batches):
                loader.next_batch()
            seconds = time.perf_counter() - start
            rates[dp].append(batches * batch * SEQ_LEN / seconds)
    return rates


# --------------------------------------------------------------------------- 2. resume seek


def open_windows(paths: list[Path], weights: tuple[Fraction, ...]) -> PreparedWindows:
    folders = [PreparedFolder(str(path)) for path in paths]
    return PreparedWindows(folders, list(weights), SEQ_LEN, shuffle=True, seed=0)


def seek_seconds(
    paths: list[Path], weights: tuple[Fraction, ...], batch: int, repeats: int
) -> tuple[list[float], list[float]]:
    """(seconds to open the folders, seconds from a new loader to its first batch at 1e11 tokens) per repeat."""
    reference = DataLoader(open_windows(paths, weights), local_batch_size=batch, dp_rank=0, dp_degree=1)
    state = reference.state_dict()  # the data description and cursor of this very data
    state["windows_consumed"] = SEEK_TOKENS // (SEQ_LEN + 1)
    opens, seeks = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        windows = open_windows(paths, weights)  # cold: nothing mapped, no permutation cached
        opened = time.perf_counter()
        loader = DataLoader(windows, local_batch_size=batch, dp_rank=0, dp_degree=1)
        loader.load_state_dict(state)
        inputs, _ = loader.next_batch()
        done = time.perf_counter()
        assert inputs.shape == (batch, SEQ_LEN) and loader.windows_consumed == state["windows_consumed"] + batch
        loader.close()  # no read-ahead thread left running into the timings (and forks) that follow
        opens.append(opened - start)
        seeks.append(done - opened)
    return opens, seeks


# --------------------------------------------------------------------------- 3. prepare throughput


def train_bpe(documents: list[str], folder: Path) -> Path:
    """A byte-level BPE of 8,192 ids trained on ``documents``; returns its folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def encode_loop_seconds(tokenizer: HFTokenizer, documents: list[str]) -> tuple[int, float]:
    """(framed tokens, seconds) of encoding ``documents`` one at a time in this process."""
    framing = int(tokenizer.bos_id is not None) + 1  # BOS and EOS around each document, as prepare writes
    start = time.perf_counter()
    tokens = 0
    for text in documents:
        tokens += len(tokenizer.encode(text)) + framing
    return tokens, time.perf_counter() - start


_shares: list[list[str]] = []  # set before the pool forks, so the processes inherit the documents
_share_tokenizer: HFTokenizer | None = None


def _open_share_tokenizer(path: str) -> None:
    global _share_tokenizer
    _share_tokenizer = HFTokenizer(path)


def _encode_share(index: int) -> int:
    return encode_loop_seconds(_share_tokenizer, _shares[index])[0]


def parallel_encode_seconds(tokenizer_path: Path, documents: list[str], processes: int) -> tuple[int, float]:
    """(framed tokens, seconds) of the encode loop run in ``processes`` forked processes at once,
    each on a contiguous share of about equal characters: what the cores give this work at the
    time, with nothing to read, ship or write. Timed from the pool's start to its end, as
    prepare is."""
    global _shares
    total, shares, share, characters = sum(map(len, documents)), [], [], 0
    for text in documents:
        share.append(text)
        characters += len(text)
        if characters >= total * (len(shares) + 1) / processes and len(shares) < processes - 1:
            shares.append(share)
            share = []
    shares.append(share)
    _shares = shares
    start = time.perf_counter()
    context = multiprocessing.get_context("fork")
    with context.Pool(processes, initializer=_open_share_tokenizer, initargs=(str(tokenizer_path),)) as pool:
        tokens = sum(pool.map(_encode_share, range(len(shares)), chunksize=1))
    return tokens, time.perf_counter() - start


# Run in a new process: this one already holds a fork server, which a real run must start.
_TIMED_PREPARE = """
import sys, time
from titanlite.data.prepare import prepare
source, output, tokenizer, workers = sys.argv[1:]
start = time.perf_counter()
manifest = prepare("text", source, output, hf_assets_path=tokenizer, workers=int(workers), progress=False)
print(manifest["tokens"], time.perf_counter() - start)
"""


def prepare_seconds(jsonl_path: Path, tokenizer_folder: Path, output: Path, workers: int) -> tuple[int, float]:
    """(framed tokens, seconds) of one ``prepare`` call in a fresh process, its imports untimed."""
    command = [sys.executable, "-c", _TIMED_PREPARE, str(jsonl_path), str(output), str(tokenizer_folder), str(workers)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    tokens, seconds = result.stdout.split()
    return int(tokens), float(seconds)


# --------------------------------------------------------------------------- the run


def loader_and_seek_rows(work: Path, args, batches: int, rounds: int, seek_repeats: int, warmup: int):
    """Parts 1 and 2: (table rows, tokens/s per rank, dp4096/dp1 ratio, mixture seek seconds)."""
    rows = []
    # The byte-tokenized data for the loader and the seek.
    train_path, validation_path = work / "stdlib-train", work / "stdlib-validation"
    seconds = time.perf_counter()
    train = prepare("python_stdlib", None, str(train_path), split="train", shard_tokens=SHARD_TOKENS, progress=False)
    prepare("python_stdlib", None, str(validation_path), split="validation", shard_tokens=SHARD_TOKENS, progress=False)
    seconds = time.perf_counter() - seconds
    windows = open_windows([train_path], (Fraction(1),))
    shards = sum(entry["name"].startswith("tokens-") for entry in train["files"])
    print(
        f"data: python_stdlib train, byte tokenizer, {train['tokens']:,} tokens in {shards} shard files, "
        f"{windows.windows_per_epoch[0]:,} windows of {SEQ_LEN + 1} per epoch, shuffled (both splits "
        f"prepared in {seconds:.1f} s); local batch {args.batch}"
    )

    # 1. Loader tokens/s per degree.
    rates = loader_tokens_per_second(windows, args.batch, DEGREES, batches, warmup, rounds)
    medians = {dp: statistics.median(values) for dp, values in rates.items()}
    for dp in DEGREES:
        middle, low, high = median_and_range(rates[dp])
        rows.append(
            (
                f"loader tokens/s, rank 0 of dp {dp}",
                f"{middle / 1e6:.1f} M",
                "",
                f"median of {rounds} rounds of {batches} batches ({low / 1e6:.1f}–{high / 1e6:.1f} M)",
            )
        )
    ratio = medians[DEGREES[-1]] / medians[DEGREES[0]]
    rows.append((f"loader tokens/s dp{DEGREES[-1]} / dp{DEGREES[0]}", f"{ratio:.2f}", ">= 0.9", "ratio of medians"))
    per_rank = medians[1]
    rows.append(
        (
            "tokens/s per rank (rank 0, dp 1)",
            f"{per_rank / 1e6:.1f} M",
            ">= 20 M",
            f"{per_rank / (SEQ_LEN + 1) / args.batch:,.0f} batches/s of {args.batch} x {SEQ_LEN + 1}",
        )
    )

    # 2. Resume seek.
    seek_results = {}
    for label, paths, weights in (
        ("one folder", [train_path], (Fraction(1),)),
        ("mixture 3:1 of two folders", [train_path, validation_path], MIXTURE_WEIGHTS),
    ):
        opens, seeks = seek_seconds(paths, weights, args.batch, seek_repeats)
        middle, low, high = median_and_range(seeks)
        seek_results[label] = middle
        target = "<= 10 ms" if label.startswith("mixture") else ""
        rows.append(
            (
                f"resume seek at 1e11 tokens, {label}",
                f"{middle * 1e3:.2f} ms",
                target,
                f"new loader + load_state_dict + first batch; median of {seek_repeats} "
                f"({low * 1e3:.2f}–{high * 1e3:.2f} ms)",
            )
        )
        rows.append(
            (
                f"opening the prepared folders, {label}",
                f"{statistics.median(opens) * 1e3:.2f} ms",
                "",
                "manifest read and hashed, shard sizes checked; not in the seek",
            )
        )

    return rows, per_rank, ratio, seek_results["mixture 3:1 of two folders"]


def prepare_rows(work: Path, prepare_rounds: int, document_limit: int | None):
    """Part 3: (table rows, prepare / baseline, parallel encode loop / baseline)."""
    rows = []
    # 3. Prepare throughput with an 8k BPE.
    documents = list(build_documents("python_stdlib", None, "train")())
    bpe_folder = train_bpe(documents[:300], work / "bpe")
    if document_limit is not None:
        documents = documents[:document_limit]
    jsonl_path = work / "documents.jsonl"
    with open(jsonl_path, "w", encoding="utf-8") as jsonl:
        for text in documents:
            jsonl.write(json.dumps({"text": text}) + "\n")
    tokenizer = HFTokenizer(str(bpe_folder / "tokenizer.json"))
    cores = os.cpu_count()
    baseline_rates, parallel_rates, prepare_rates = [], [], []
    for turn in range(prepare_rounds):
        tokens, seconds = encode_loop_seconds(tokenizer, documents)
        baseline_rates.append(tokens / seconds)
        parallel_tokens, seconds = parallel_encode_seconds(bpe_folder / "tokenizer.json", documents, cores)
        parallel_rates.append(parallel_tokens / seconds)
        prepared_tokens, seconds = prepare_seconds(jsonl_path, bpe_folder, work / f"bpe-prepared-{turn}", cores)
        prepare_rates.append(prepared_tokens / seconds)
        if not prepared_tokens == parallel_tokens == tokens:
            raise AssertionError(
                f"token counts differ: encode loop {tokens}, {cores} processes "
                f"{parallel_tokens}, prepare {prepared_tokens}"
            )
    baseline, low, high = median_and_range(baseline_rates)
    rows.append(
        (
            "BPE 8k: encode loop, 1 process (baseline)",
            f"{baseline / 1e6:.3f} M tokens/s",
            "",
            f"{len(documents)} documents, {tokens:,} tokens; median of {prepare_rounds} "
            f"({low / 1e6:.3f}–{high / 1e6:.3f})",
        )
    )
    parallel, low, high = median_and_range(parallel_rates)
    rows.append(
        (
            f"BPE 8k: encode loop in {cores} processes at once",
            f"{parallel / 1e6:.3f} M tokens/s",
            "",
            f"what {cores} cores give this work here; median of {prepare_rounds} ({low / 1e6:.3f}–{high / 1e6:.3f})",
        )
    )
    prepared, low, high = median_and_range(prepare_rates)
    rows.append(
        (
            f"BPE 8k: prepare, {cores} workers",
            f"{prepared / 1e6:.3f} M tokens/s",
            "",
            f"starts its processes, reads the file, writes shards + SHA-256; median of {prepare_rounds} "
            f"({low / 1e6:.3f}–{high / 1e6:.3f})",
        )
    )
    prepare_ratio = prepared / baseline
    rows.append(("BPE 8k: prepare / baseline", f"{prepare_ratio:.2f}", f">= 1.6 on {cores} cores", "ratio of medians"))
    rows.append(
        (
            f"BPE 8k: {cores} processes / baseline",
            f"{parallel / baseline:.2f}",
            "",
            "reference: the cores' scaling at the time",
        )
    )

    return rows, prepare_ratio, parallel / baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, rounds and documents (~15 s)")
    parser.add_argument("--batch", type=int, default=8, help="local batch size (default 8)")
    parser.add_argument("--batches", type=int, help="timed batches per degree per round (default 1000; quick 50)")
    parser.add_argument("--rounds", type=int, help="rounds over the degrees (default 7; quick 2)")
    parser.add_argument("--seek-repeats", type=int, help="resume seeks per data set (default 11; quick 3)")
    parser.add_argument("--prepare-only", action="store_true", help="part 3 alone: the prepare throughput")
    parser.add_argument("--prepare-rounds", type=int, help="baseline/prepare turns (default 3; quick 1)")
    parser.add_argument(
        "--documents", type=int, help="python_stdlib train documents to prepare with the BPE (default all; quick 150)"
    )
    args = parser.parse_args()
    batches = args.batches or (50 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 7)
    seek_repeats = args.seek_repeats or (3 if args.quick else 11)
    prepare_rounds = args.prepare_rounds or (1 if args.quick else 3)
    document_limit = args.documents or (150 if args.quick else None)
    warmup = 5

    load_before = os.getloadavg()
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"titanlite data loader, {now:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}; load average {load_before[0]:.2f} {load_before[1]:.2f} "
        f"{load_before[2]:.2f} before{' (--quick)' if args.quick else ''}"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titanlite-data-loader-") as temporary:
        work = Path(temporary)

        rows, per_rank, ratio, seek = [], None, None, None
        if not args.prepare_only:
            rows, per_rank, ratio, seek = loader_and_seek_rows(work, args, batches, rounds, seek_repeats, warmup)
        rows_3, prepare_ratio, parallel_ratio = prepare_rows(work, prepare_rounds, document_limit)
        rows += rows_3

    print()
    print("| figure | result | target | how |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    load_after = os.getloadavg()
    print(
        f"{time.perf_counter() - started:.0f} s; load average {load_after[0]:.2f} {load_after[1]:.2f} "
        f"{load_after[2]:.2f} after"
    )
    cores = os.cpu_count()
    if per_rank is not None:
        print(f"tokens/s per rank (rank 0, dp 1) = {per_rank / 1e6:.1f} M (target >= 20 M)")
    print(
        f"prepare with an 8k BPE, {cores} workers / 1-process encode loop = {prepare_ratio:.2f} (target >= 1.6; "
        f"the encode loop in {cores} processes at once gives {parallel_ratio:.2f})"
    )
    if ratio is not None:
        print(f"loader tokens/s dp{DEGREES[-1]}/dp{DEGREES[0]} = {ratio:.2f} (target >= 0.9)")
        print(f"resume seek at 1e11 tokens = {seek * 1e3:.1f} ms (target <= 10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
