"""Save and load time of one checkpoint in object storage (S3) against a local folder.

    python benchmarks/object_storage.py                         # about 1 GiB, best of 3: 5 minutes on 2 cores
    python benchmarks/object_storage.py --gib 4 --folder /some/disk
    python benchmarks/object_storage.py --gib 0.01 --repeats 1  # a smoke run

The checkpoint is the state of a Llama-shaped model trained with AdamW, in float32: 12
blocks (attention's 4 square matrices, the feed-forward's 3, 2 norm vectors), an embedding
and an output matrix of 8 x dim rows, a final norm; the optimizer's two moments and step
count for every weight; a train_state. dim is chosen so that the whole is about --gib GiB:
445 tensors, at 1 GiB matrices of 2 to 17 MiB, vectors and scalars. The tensors are random,
so nothing compresses.

The same CheckpointManager code a run uses saves and loads it, in one process (no process
group), once per destination and repeat:

  save   CheckpointManager.save(1, sync=True): DCP's writer, then the commit. Locally:
         FileSystemWriter with fsync, then the rename of the partial folder to step-1. In
         S3: the fsspec writer (s3fs, no fsync) writes step-1/ in place, then .committed
  load   a fresh manager's load() into zeroed tensors of the same shapes: finding the
         newest committed step, the checks of its files, DCP's read. Every loaded tensor
         is then compared bit for bit with the saved one (a difference stops the script)

A third row moves the same bytes without DCP: every tensor written in turn to one object
through an s3fs file, then read back in the same order (each read follows the last, so
s3fs's read-ahead serves it); the server's own speed, about, for this client.

Each repeat writes to a folder (or key prefix) of its own, removed afterwards, untimed; the
best of --repeats is reported. The local folder is a temporary one under --folder (default:
the system's temporary folder); its load reads what the save just wrote, from the page cache.
The S3 rows also give the requests the server answered, by method, in the first repeat, and
the bytes the client fetched (a reader that jumps back in a file fetches bytes again).

The S3 server is moto's (ThreadedMotoServer), started by this script in this process on
127.0.0.1, bucket in memory (moto keeps an object over 5 MiB in a temporary file, unsynced).
It is no real bucket: no network and no durability, and it shares the client's cores and
Python interpreter (its request handling holds the GIL the client needs). It is slow for a
server: it hashes and copies every upload, and reads the whole object to answer each ranged
GET, so a load's time grows with the object's size times the GETs the reader makes. Its
figures bound neither a real bucket's speed nor the client's from above: they show what
titanlite's client path (DCP's fsspec writer and reader, s3fs) asks of a server, and how
close it comes to the stream row on the same server.

checkpoint.uploads_per_node is not measured: it bounds how many ranks of a node upload at
once, and with one process there is one upload, whatever its value.

The last lines are this run's ratios:
`save time S3 / local = X.XX` and `load time S3 / local = X.XX`.
"""

import argparse
import collections
import datetime
import gc
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from titanlite.checkpoint import CheckpointManager
from titanlite.config import Checkpoint
from titanlite.storage import location

N_LAYERS = 12
BUCKET = "titanlite-benchmark"
STEP = 1
PARTS = ["model", "optimizer", "train_state"]


class TensorState:
    """A Stateful holding a (nested) dict of tensors. DCP loads into the tensors that
    state_dict() returned, so load_state_dict only takes back the dict that holds them."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def model_shapes(gib: float) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped model's weight shapes. With AdamW's two moments its float32 state is 12
    bytes a weight, and it has about (12 x blocks + 16) dim^2 weights: dim from --gib."""
    dim = max(8, round((gib * 2**30 / 12 / (N_LAYERS * 12 + 16)) ** 0.5 / 8) * 8)
    hidden, vocab = round(8 * dim / 3 / 8) * 8, 8 * dim
    shapes = {"tok_embeddings.weight": (vocab, dim)}
    for layer in range(N_LAYERS):
        block = f"layers.{layer}"
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"{block}.attention.{name}.weight"] = (dim, dim)
        shapes[f"{block}.feed_forward.w1.weight"] = (hidden, dim)
        shapes[f"{block}.feed_forward.w2.weight"] = (dim, hidden)
        shapes[f"{block}.feed_forward.w3.weight"] = (hidden, dim)
        shapes[f"{block}.attention_norm.weight"] = (dim,)
        shapes[f"{block}.ffn_norm.weight"] = (dim,)
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (vocab, dim)
    return shapes


def build_states(shapes: dict[str, tuple[int, ...]], fill) -> dict[str, TensorState]:
    """model, optimizer and train_state, every tensor made by fill(shape). The train_state
    makes the checkpoint one that a run resumes from (steps.is_resumable)."""
    model = {name: fill(shape) for name, shape in shapes.items()}
    moments = {
        name: {"step": fill(()), "exp_avg": fill(shape), "exp_avg_sq": fill(shape)} for name, shape in shapes.items()
    }
    return {
        "model": TensorState(model),
        "optimizer": TensorState({"state": moments}),
        "train_state": TensorState({"step": fill(())}),
    }


def tensors(value, prefix: str = ""):
    """(dotted name, tensor) for every tensor in nested dicts."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    else:
        for key, item in value.items():
            yield from tensors(item, f"{prefix}.{key}" if prefix else key)


def flat(states: dict[str, TensorState]) -> dict[str, torch.Tensor]:
    return dict(tensors({name: state.state_dict() for name, state in states.items()}))


def check_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str) -> None:
    if expected.keys() != got.keys():
        raise SystemExit(f"object_storage benchmark: {where}: other tensors came back than were saved")
    for name, tensor in expected.items():
        # Bit for bit: the same 32-bit patterns (torch.equal would take -0.0 for 0.0).
        if not torch.equal(tensor.view(torch.int32), got[name].view(torch.int32)):
            raise SystemExit(f"object_storage benchmark: {where}: {name} differs from what was saved")


def save_and_load(saved: dict[str, TensorState], shapes, folder: str, dump_folder: str, mark) -> tuple[float, float]:
    """Seconds of a synchronous save of `saved` to `folder` (a path or a URL) and of a fresh
    manager's load of it; the loaded tensors are checked against the saved ones. mark() is
    called after each of the two, untimed."""
    config = Checkpoint(enable=True, folder=folder)
    manager = CheckpointManager(saved, config, dump_folder)
    gc.collect()
    start = time.perf_counter()
    manager.save(STEP, sync=True)
    save_seconds = time.perf_counter() - start
    mark()
    manager.close()
    # Zeroed, not empty: their pages are touched before the clock starts, as a run's are.
    loaded = build_states(shapes, lambda shape: torch.zeros(shape, dtype=torch.float32))
    manager = CheckpointManager(loaded, config, dump_folder)
    gc.collect()
    start = time.perf_counter()
    parts = manager.load()
    load_seconds = time.perf_counter() - start
    mark()
    manager.close()
    if sorted(parts) != sorted(PARTS):
        raise SystemExit(f"object_storage benchmark: {folder}: loaded the parts {parts}, not {PARTS}")
    check_equal(flat(saved), flat(loaded), folder)
    return save_seconds, load_seconds


def stream_write_and_read(saved: dict[str, TensorState], url: str, mark) -> tuple[float, float]:
    """Seconds to write every tensor's bytes in turn to one object through an s3fs file and
    to read them back in the same order into zeroed tensors, checked; mark() as above."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    sources = flat(saved)
    targets = {name: torch.zeros_like(tensor) for name, tensor in sources.items()}
    gc.collect()
    start = time.perf_counter()
    with fs.open(path, "wb") as file:
        for tensor in sources.values():
            file.write(memoryview(tensor.numpy()).cast("B"))
    write_seconds = time.perf_counter() - start
    mark()
    start = time.perf_counter()
    with fs.open(path, "rb") as file:
        for tensor in targets.values():
            file.readinto(memoryview(tensor.numpy()).cast("B"))
    read_seconds = time.perf_counter() - start
    mark()
    check_equal(sources, targets, url)
    fs.rm(path)
    return write_seconds, read_seconds


class RequestCounts(logging.Handler):
    """Counts the server's requests by method, from the line werkzeug logs for each one (its
    first argument is the request line, "GET /bucket/key HTTP/1.1", in colour escapes for some
    statuses). The line is logged as the response starts, so a request the client saw
    answered has been counted."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.counts = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO and record.args:
            method = re.search(r"(GET|PUT|POST|HEAD|DELETE) /", str(record.args[0]))
            self.counts[method.group(1) if method else "other"] += 1

    def take(self) -> str:
        """The requests counted since the last call, most frequent first."""
        text = " ".join(f"{method} {count}" for method, count in self.counts.most_common())
        self.counts.clear()
        return text


class BytesFetched:
    """Bytes the client's s3fs files fetched (each ranged GET's length), counted by wrapping
    S3File._fetch_range: a reader that jumps back in a file fetches some bytes again, and on
    a real bucket each fetched byte is paid for and waited for."""

    def __init__(self):
        import s3fs.core

        self.total = 0
        fetch = s3fs.core.S3File._fetch_range

        def counting(file, start: int, end: int):
            data = fetch(file, start, end)
            self.total += len(data)  # a range past the end of the object returns less
            return data

        s3fs.core.S3File._fetch_range = counting

    def take(self) -> int:
        """The bytes fetched since the last call."""
        taken, self.total = self.total, 0
        return taken


def start_s3(requests: RequestCounts) -> tuple[object, str]:
    """moto's S3 server on a free port of 127.0.0.1, and the bucket's URL. The AWS_* variables
    are set before anything makes a client: botocore (under s3fs and boto3) reads them then."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs a line for every request on stderr (verbose=False does not stop it). With
    # a handler of ours it adds no handler of its own; its errors still reach stderr.
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    errors = logging.StreamHandler()
    errors.setLevel(logging.WARNING)
    werkzeug.addHandler(errors)
    werkzeug.addHandler(requests)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="benchmark",
        AWS_SECRET_ACCESS_KEY="benchmark",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server, f"s3://{BUCKET}"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def best_of(repeats: int, run) -> tuple[float, float]:
    """The smallest of each of the two timings that run(repeat) returns, over the repeats."""
    timings = [run(repeat) for repeat in range(repeats)]
    return min(t[0] for t in timings), min(t[1] for t in timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (about)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads of each row; the best is taken")
    parser.add_argument("--folder", default=None, help="where the local checkpoints go (in a temporary folder)")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        parser.error("--gib must be positive and --repeats at least 1")
    shapes = model_shapes(args.gib)
    generator = torch.Generator().manual_seed(0)
    saved = build_states(shapes, lambda shape: torch.randn(shape, generator=generator))
    size = sum(tensor.nbytes for tensor in flat(saved).values())
    requests = RequestCounts()
    server, bucket_url = start_s3(requests)
    fetched = BytesFetched()
    times, counts = {}, {}

    def counted(row: str, repeat: int):
        """mark() for a row: the first repeat's requests of each of the two steps."""
        requests.take()  # what came before (bucket creation, the previous removal)
        fetched.take()

        def mark():
            if repeat == 0:
                counts.setdefault(row, []).append(f"{requests.take()}; {fetched.take() / 1e9:.3f} GB fetched")

        return mark

    try:
        with tempfile.TemporaryDirectory(prefix="titanlite-object-storage-", dir=args.folder) as dump_folder:

            def local(repeat: int) -> tuple[float, float]:
                folder = Path(dump_folder) / f"local-{repeat}"
                timings = save_and_load(saved, shapes, str(folder), dump_folder, lambda: None)
                shutil.rmtree(folder)  # untimed: the disk holds one checkpoint at a time
                return timings

            def s3(repeat: int) -> tuple[float, float]:
                url = f"{bucket_url}/run-{repeat}"
                timings = save_and_load(saved, shapes, url, dump_folder, counted("S3", repeat))
                location(url).remove(recursive=True)  # untimed: frees the server's memory
                return timings

            def stream(repeat: int) -> tuple[float, float]:
                return stream_write_and_read(saved, f"{bucket_url}/stream", counted("S3 stream", repeat))

            times["local"] = best_of(args.repeats, local)
            times["S3"] = best_of(args.repeats, s3)
            times["S3 stream"] = best_of(args.repeats, stream)
    finally:
        server.stop()

    import moto

    print(
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {datetime.date.today().isoformat()}\n"
        f"checkpoint: {size / 1e9:.3f} GB ({size / 2**30:.3f} GiB) of float32 in {len(flat(saved))} tensors "
        f"(dim {shapes['norm.weight'][0]}, {N_LAYERS} blocks, AdamW moments); one process; best of {args.repeats}\n"
        f"local: a temporary folder in {args.folder or tempfile.gettempdir()}, fsync'd on save; "
        "the load reads from the page cache\n"
        f"S3: moto {moto.__version__}'s server in this process on 127.0.0.1, objects in memory or unsynced temporary "
        "files. Not a real bucket: no network, no durability; it shares these cores and the GIL with the client, and "
        "copies the whole object for each ranged GET. Its figures are titanlite's client path against this server, "
        "no bound on a real bucket's bandwidth; the stream row is the same bytes without DCP on the same server\n"
    )
    print("| row | save s | save GB/s | load s | load GB/s | the save's requests; bytes | the load's requests; bytes |")
    print("|---|---|---|---|---|---|---|")
    names = {"local": "local", "S3": "S3 (moto)", "S3 stream": "S3 (moto), one s3fs stream, no DCP"}
    for row, (save_seconds, load_seconds) in times.items():
        save_requests, load_requests = counts.get(row, ["", ""])
        print(
            f"| {names[row]} | {save_seconds:.2f} | {size / 1e9 / save_seconds:.3f} | {load_seconds:.2f} | "
            f"{size / 1e9 / load_seconds:.3f} | {save_requests} | {load_requests} |"
        )
    print()
    print(f"save time S3 / local = {times['S3'][0] / times['local'][0]:.2f}")
    print(f"load time S3 / local = {times['S3'][1] / times['local'][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
