"""Tokenize a dataset once into a prepared folder (see ``prepared.py`` for the format).

    python -m titanlite.data.prepare --dataset text --dataset_path corpus/ \\
        --hf_assets_path assets/tokenizer --output data/web --workers 16

Any source the trainer reads works (``--dataset`` takes training.dataset's names). The main
process reads documents in order and hands chunks of them to ``--workers`` processes that
encode a whole chunk per call; results are written back in submission order, so the output is
the same bytes whatever the worker count. Everything is written to ``OUTPUT.partial`` and
renamed to ``OUTPUT`` once the manifest is on disk. Any error or Ctrl-C (and, in the command,
SIGTERM) removes ``OUTPUT.partial`` again; only a prepare killed outright leaves it, nothing
in it loads, and running the command again starts that folder afresh.

The workers are started by a fork server, as ``spawn`` would, so a script that calls
``prepare(..., workers=2)`` needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import argparse
import array
import collections
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import sysconfig
import time
from concurrent.futures.process import BrokenProcessPool

from titanlite.files import fsync_path

from .prepared import DEFAULT_SHARD_TOKENS, FORMAT_VERSION, MANIFEST, PreparedWriter
from .sources import (
    C4_TEST_DEFAULT_PATH,
    C4_TEST_SUFFIXES,
    DATASETS,
    build_documents,
    list_text_files,
    stdlib_split_files,
)
from .tokenizer import build_tokenizer

logger = logging.getLogger("titanlite")

_PARTIAL_SUFFIX = ".partial"
_PARTIAL_MARK = ".titanlite-prepare"  # only folders holding this are ever deleted by a rerun
_CHUNK_CHARACTERS = 1 << 20  # text per task: big enough to hide the hand-off, small enough to spread
_TASKS_PER_WORKER = 4  # tasks in flight per worker: bounds memory however large the source


# --------------------------------------------------------------------------- the workers


_worker_tokenizer = None
_worker_typecode = "I"


def _start_worker(hf_assets_path: str | None, typecode: str) -> None:
    global _worker_tokenizer, _worker_typecode
    # Ctrl-C reaches the whole process group; the main process alone answers it, stopping the
    # pool, whose workers then finish their chunk and leave. A worker that raised
    # KeyboardInterrupt would print a traceback of its own, and one that died while sending its
    # result would leave the pool waiting for the rest of that result forever. (SIGTERM keeps
    # its default: it is how the pool stops the workers it gives up on.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One core per worker: the tokenizers library would otherwise start a thread per core in each.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = build_tokenizer(hf_assets_path)
    _worker_typecode = typecode


def encode_chunk(texts: list[str]) -> tuple[bytes, list[int]]:
    """In a worker: ``frame_documents`` with the worker's tokenizer."""
    return frame_documents(_worker_tokenizer, _worker_typecode, texts)


def frame_documents(tokenizer, typecode: str, texts: list[str]) -> tuple[bytes, list[int]]:
    """The framed tokens of ``texts`` (as native-order array bytes) and each document's length."""
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    tokens = array.array(typecode)
    lengths = []
    for ids in tokenizer.encode_batch(texts):
        tokens.extend(prefix)
        tokens.extend(ids)
        tokens.append(tokenizer.eos_id)
        lengths.append(len(prefix) + len(ids) + 1)
    return tokens.tobytes(), lengths


def _chunks(documents):
    """(documents, their characters): lists of documents of about _CHUNK_CHARACTERS each."""
    chunk, characters = [], 0
    for text in documents:
        chunk.append(text)
        characters += len(text)
        if characters >= _CHUNK_CHARACTERS:
            yield chunk, characters
            chunk, characters = [], 0
    if chunk:
        yield chunk, characters


# --------------------------------------------------------------------------- preparing


def _source_files(dataset: str, dataset_path: str | None, split: str) -> list[tuple[str, str]] | None:
    """(name relative to the source, full path) of every file a file-based source reads; None for
    sources that are not files (the Hub)."""
    if dataset == "python_stdlib":
        root = sysconfig.get_paths()["stdlib"]
        return [(name, os.path.join(root, name)) for name in stdlib_split_files(split)]
    if dataset == "c4_test":
        folder = dataset_path or C4_TEST_DEFAULT_PATH
        return [(os.path.relpath(name, folder), name) for name in list_text_files(folder, C4_TEST_SUFFIXES)]
    if dataset == "text" and dataset_path:
        if os.path.isfile(dataset_path):
            return [(os.path.basename(dataset_path), dataset_path)]
        return [(os.path.relpath(name, dataset_path), name) for name in list_text_files(dataset_path)]
    return None


def source_description(dataset: str, dataset_path: str | None, split: str) -> dict:
    """What the manifest records as the source: where it was (absolute) and, for files, their
    count, bytes and a hash of their names and sizes, so that a rerun notices changed files."""
    path = dataset_path
    if path is not None and os.path.exists(path):
        path = os.path.abspath(path)
    description = {"dataset": dataset, "dataset_path": path, "split": split}
    files = _source_files(dataset, dataset_path, split)
    if files is not None:
        listing = [(name.replace(os.sep, "/"), os.path.getsize(full)) for name, full in files]
        description["files"] = len(listing)
        description["bytes"] = sum(size for _, size in listing)
        description["listing_sha256"] = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    return description


def _progress_bar(total: int | None, enabled: bool):
    if not enabled:
        return None
    from huggingface_hub.utils import tqdm  # the tqdm that huggingface_hub already brings

    # disable=None: no bar when stderr is not a terminal (CI logs, batch jobs).
    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=None, dynamic_ncols=True)


def _check_output(output: str, source: dict, tokenizer) -> dict | None:
    """The existing manifest when ``output`` already holds this very preparation; an error
    when it holds anything else; None when the way is clear."""
    manifest_path = os.path.join(output, MANIFEST)
    if os.path.isfile(manifest_path):
        with open(manifest_path, encoding="utf-8") as manifest_file:
            manifest = json.load(manifest_file)
        same = (
            manifest.get("version") == FORMAT_VERSION
            and manifest.get("source") == source
            and manifest.get("tokenizer", {}).get("fingerprint") == tokenizer.fingerprint
        )
        if same:
            return manifest
        saved = manifest.get("source", {})
        what = (
            "another tokenizer"
            if saved == source
            else (
                "the same source, whose files have changed since"
                if saved.get("dataset_path") == source["dataset_path"]
                else f"another source ({saved.get('dataset')} {saved.get('dataset_path') or ''})".replace(" )", ")")
            )
        )
        raise ValueError(
            f"--output {output}: already holds data prepared from {what}; choose another folder or delete it"
        )
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ValueError(f"--output {output}: exists and is not a prepared folder; choose another path")
    above = os.path.dirname(os.path.abspath(output))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"--output {output}: {above} is a file, so no folder can be made below it")
    return None


def _fresh_partial_folder(output: str) -> str:
    partial = output.rstrip("/") + _PARTIAL_SUFFIX
    if os.path.exists(partial):
        if not os.path.isfile(os.path.join(partial, _PARTIAL_MARK)):
            raise ValueError(f"--output {output}: {partial} exists and was not left by a prepare; move it away")
        shutil.rmtree(partial)  # an interrupted earlier run: start it again from the beginning
    # Made with its mark under another name and renamed: a .partial folder always has the mark,
    # so a prepare killed at any moment never leaves one that a rerun must refuse to delete.
    staging = f"{partial}.{os.getpid()}"
    os.makedirs(staging)
    try:
        with open(os.path.join(staging, _PARTIAL_MARK), "w") as mark:
            mark.write("an unfinished titanlite prepare; running it again deletes this folder\n")
        os.replace(staging, partial)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return partial


def _encoded_chunks(documents, tokenizer, typecode: str, hf_assets_path: str | None, workers: int):
    """(characters, framed token bytes, document lengths) of each chunk, in the source's order.

    One worker encodes here. More are processes started by a fork server, never forked from
    this process: a trainer (or a test run) has other threads, and a child forked while one of
    them holds a lock waits for it forever."""
    if workers == 1:
        for chunk, characters in _chunks(documents):
            yield (characters, *frame_documents(tokenizer, typecode, chunk))
        return
    # The server imports this module once, torch included; each worker is then a cheap fork of
    # it. Run as ``python -m``, each worker also runs this file as __mp_main__, so the server
    # imports the package instead (torch, the tokenizers), leaving a quick run of this file
    # alone (the package does not import this module, which would make runpy warn). A worker
    # that dies (killed, out of memory) breaks the pool with an error instead of a wait forever.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__package__ if __name__ == "__main__" else __name__])
    with concurrent.futures.ProcessPoolExecutor(workers, context, _start_worker, (hf_assets_path, typecode)) as pool:
        in_flight: collections.deque = collections.deque()  # (characters, future), in order
        try:
            for chunk, characters in _chunks(documents):
                in_flight.append((characters, pool.submit(encode_chunk, chunk)))
                if len(in_flight) >= workers * _TASKS_PER_WORKER:
                    characters, future = in_flight.popleft()
                    yield (characters, *future.result())
            while in_flight:
                characters, future = in_flight.popleft()
                yield (characters, *future.result())
        except BaseException:  # an error, an interrupt, or the caller closing this generator
            pool.shutdown(cancel_futures=True)  # the queued chunks are not worth waiting for
            raise


@contextlib.contextmanager
def _naming_on_error(folder: str):
    """Names ``folder`` in an OSError that names no file: a failed write (a full disk) does not."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = folder
        raise


def _write_folder(partial, documents, tokenizer, source, hf_assets_path, workers, shard_tokens, progress) -> dict:
    """Encode ``documents`` into the shards and manifest of ``partial``; returns the manifest."""
    writer = PreparedWriter(partial, tokenizer.vocab_size, shard_tokens)
    typecode = {"uint16": "H", "uint32": "I"}[writer.dtype]
    bar = _progress_bar(source.get("bytes"), progress)
    started = time.perf_counter()
    chunks = _encoded_chunks(documents, tokenizer, typecode, hf_assets_path, workers)
    with contextlib.closing(chunks):  # on an error here, the workers stop now rather than when collected
        for characters, token_bytes, lengths in chunks:
            tokens = array.array(typecode)
            tokens.frombytes(token_bytes)
            with _naming_on_error(partial):
                writer.add(tokens, lengths)
            if bar is not None:
                bar.update(characters)
                elapsed = time.perf_counter() - started
                bar.set_postfix_str(f"{writer.token_count / elapsed / 1e6:.2f} M tokens/s", refresh=False)
    if bar is not None:
        bar.close()
    if writer.document_count == 0:
        where = f"--dataset {source['dataset']} {source['dataset_path'] or ''}".rstrip()
        raise ValueError(f"{where}: the source has no documents")
    with _naming_on_error(partial):
        return writer.finish(tokenizer, source)


def prepare(
    dataset: str,
    dataset_path: str | None,
    output: str,
    hf_assets_path: str | None = None,
    split: str = "train",
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> dict:
    """Tokenize ``dataset`` into the prepared folder ``output``; returns its manifest.

    Running it again on a complete folder of the same source and tokenizer returns at once.
    Mistakes are one-line ValueErrors naming the argument at fault, found before anything is
    written where possible; an OSError (a full disk) names the file it concerns. Whatever ends
    the work early, ``OUTPUT.partial`` is removed.
    """
    workers = (os.cpu_count() or 1) if workers is None else workers
    for flag, value in (("--workers", workers), ("--shard_tokens", shard_tokens)):
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
    tokenizer = build_tokenizer(hf_assets_path)
    if tokenizer.eos_id is None:
        raise ValueError(f"--hf_assets_path {hf_assets_path}: the tokenizer has no EOS token, which packing needs")
    source = source_description(dataset, dataset_path, split)
    existing = _check_output(output, source, tokenizer)
    if existing is not None:
        return existing
    documents = build_documents(dataset, dataset_path, split)()
    partial = _fresh_partial_folder(output)
    try:
        manifest = _write_folder(partial, documents, tokenizer, source, hf_assets_path, workers, shard_tokens, progress)
        with _naming_on_error(partial):
            os.remove(os.path.join(partial, _PARTIAL_MARK))
            if os.path.isdir(output):
                os.rmdir(output)  # empty, as _check_output made sure
            os.replace(partial, output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # once renamed there is nothing left to remove
        raise
    fsync_path(os.path.dirname(os.path.abspath(output)))
    return manifest


# --------------------------------------------------------------------------- the built-in corpus


def cached_stdlib(split: str, tokenizer, hf_assets_path: str | None, cache_folder: str) -> str:
    """The built-in corpus prepared with the run's tokenizer, in ``cache_folder``; prepared on
    first use. Concurrent callers (the ranks of one node) wait for the first one's work."""
    root = sysconfig.get_paths()["stdlib"]
    files = [(name, os.path.getsize(os.path.join(root, name))) for name in stdlib_split_files(split)]
    key = hashlib.sha256(
        json.dumps([FORMAT_VERSION, split, root, sys.version_info[:3], files, tokenizer.fingerprint]).encode()
    ).hexdigest()[:16]
    cache_folder = os.path.expanduser(cache_folder)
    folder = os.path.join(cache_folder, f"python_stdlib-{split}-{key}")
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return folder
    os.makedirs(cache_folder, exist_ok=True)
    with open(folder + ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not os.path.isfile(os.path.join(folder, MANIFEST)):
            started = time.perf_counter()
            logger.info("preparing the built-in corpus (python_stdlib %s) once, into %s", split, folder)
            # One worker, in this process: a training process starts no worker processes, and
            # the corpus takes seconds (the Hugging Face tokenizer batches across cores itself).
            manifest = prepare("python_stdlib", None, folder, hf_assets_path, split, workers=1, progress=False)
            logger.info("prepared %d tokens in %.1f s", manifest["tokens"], time.perf_counter() - started)
    return folder


# --------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.data.prepare",
        description="Tokenize a dataset once into a prepared folder that training reads through memory maps.",
    )
    parser.add_argument(
        "--dataset",
        choices=[name for name in DATASETS],
        default="text",
        help="the source, named as training.dataset names it (default: text)",
    )
    parser.add_argument("--dataset_path", help="file or folder (text, c4_test), dataset name or folder (huggingface)")
    parser.add_argument("--split", default="train", help="split of python_stdlib, huggingface and c4 (default: train)")
    parser.add_argument(
        "--hf_assets_path",
        help="the run's model.hf_assets_path (tokenizer.json or its folder); unset: the byte tokenizer",
    )
    parser.add_argument("--output", required=True, help="the prepared folder to create")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every core)")
    parser.add_argument(
        "--shard_tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS})",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    already_there = os.path.isfile(os.path.join(args.output, MANIFEST))
    # SIGTERM (kill PID) ends the command as Ctrl-C does, its partial folder removed.
    previous_handler = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        manifest = prepare(
            args.dataset,
            args.dataset_path,
            args.output,
            args.hf_assets_path,
            args.split,
            args.workers,
            args.shard_tokens,
        )
    except ValueError as error:
        print(f"titanlite.data.prepare: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"titanlite.data.prepare: interrupted; {args.output} was not created", file=sys.stderr)
        return 130
    except BrokenProcessPool:
        print(
            f"titanlite.data.prepare: a worker process died (killed, or out of memory?); {args.output} "
            "was not created; run the command again, with fewer --workers if memory is short",
            file=sys.stderr,
        )
        return 1
    except OSError as error:  # a full disk, a folder it may not write: the environment, not the arguments
        where = " -> ".join(str(name) for name in (error.filename, error.filename2) if name is not None)
        what = f"{where}: {error.strerror}" if where and error.strerror else str(error)
        print(f"titanlite.data.prepare: {what}; {args.output} was not created", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    if already_there:
        print(
            f"{args.output}: already prepared from this source with this tokenizer "
            f"({manifest['tokens']:,} tokens in {manifest['documents']:,} documents); nothing to do"
        )
        return 0
    seconds = time.perf_counter() - started
    print(
        f"{args.output}: {manifest['tokens']:,} tokens in {manifest['documents']:,} documents, "
        f"{manifest['dtype']}, {len(manifest['files'])} files ({seconds:.1f} s, "
        f"{manifest['tokens'] / max(seconds, 1e-9) / 1e6:.2f} M tokens/s)"
    )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
