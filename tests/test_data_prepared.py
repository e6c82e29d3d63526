"""Prepared data: the format, the global order (shuffle, mixture), the data-parallel split,
read-ahead, exact resume at any layout, and the prepare command's guarantees.

Every expectation is computed the slow, obvious way (documents framed and concatenated in a
Python list) and compared with what the memory-mapped reader hands out.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import titanlite.data.prepare as prepare_module
from tests.helpers import write_word_tokenizer
from tests.prepared_data import exit_abruptly, make_documents, prepare_documents, write_jsonl
from titanlite.data import (
    ByteTokenizer,
    DataLoader,
    PackedLoader,
    PreparedFolder,
    build_tokenizer,
    open_windows,
    parse_mixture,
    stream_warning,
    verify_share,
)
from titanlite.data.build import open_prepared
from titanlite.data.order import EpochPermutation, Mixture
from titanlite.data.prepare import main as prepare_main
from titanlite.data.prepare import prepare

REPO_ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN = 15  # windows of 16 tokens
SHARD_TOKENS = 1000  # small, so that windows straddle shard files


def framed_stream(documents: list[str], tokenizer=None) -> list[int]:
    tokenizer = tokenizer or ByteTokenizer()
    stream = []
    for text in documents:
        stream += [tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id]
    return stream


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    """Two prepared folders, "web" and "code", with their documents."""
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for name, seed, count in (("web", 1, 300), ("code", 2, 120)):
        documents = make_documents(seed, count)
        out[name] = (prepare_documents(root / name, documents, SHARD_TOKENS), documents)
    return out


def windows_of(corpora, spec: str, shuffle: bool = True, seed: int = 0, seq_len: int = SEQ_LEN):
    resolved = ",".join(
        part.replace(name, str(corpora[name][0])) for part in spec.split(",") for name in (part.split(":")[0],)
    )
    return open_prepared(resolved, ByteTokenizer(), "the byte tokenizer", seq_len, shuffle, seed)


def loaders(windows_factory, dp_degree: int, local_batch_size: int, prefetch: int = 0) -> list[DataLoader]:
    return [
        DataLoader(windows_factory(), local_batch_size, rank, dp_degree, prefetch=prefetch) for rank in range(dp_degree)
    ]


def global_batches(rank_loaders: list[DataLoader], steps: int, accumulation: int = 1) -> list[list[list[int]]]:
    """Per optimizer step, the rows of every micro-batch of every rank, in window order."""
    batches = []
    for _ in range(steps):
        rows = []
        for _ in range(accumulation):
            rows += [row for loader in rank_loaders for row in loader.next_batch()[0].tolist()]
        batches.append(rows)
    return batches


# --------------------------------------------------------------------------- the format


def test_prepared_stream_is_the_framed_documents_and_their_starts(corpora):
    folder_path, documents = corpora["web"]
    folder = PreparedFolder(str(folder_path))
    stream = framed_stream(documents)
    assert (folder.tokens, folder.documents, folder.dtype) == (len(stream), len(documents), "uint16")
    assert folder.shard_tokens == SHARD_TOKENS and len(folder.file_names) > 4  # several shards of each kind
    everything = torch.empty(folder.tokens, dtype=torch.int64)
    folder.copy_tokens(0, everything)
    assert everything.tolist() == stream
    lengths = [len(framed_stream([text])) for text in documents]
    assert folder.document_starts(0, len(documents)) == [sum(lengths[:i]) for i in range(len(documents))]
    manifest = folder.manifest
    assert manifest["tokenizer"] == {
        "fingerprint": ByteTokenizer.fingerprint,
        "bos_id": 256,
        "eos_id": 257,
        "vocab_size": 258,
    }
    assert manifest["source"]["dataset"] == "text"
    assert verify_share(windows_of(corpora, "web"), 0, 1) is None


def test_prepare_writes_the_same_bytes_for_one_and_two_workers(tmp_path):
    documents = make_documents(5, 400)
    one = prepare_documents(tmp_path / "one", documents, shard_tokens=3000, workers=1)
    two = prepare_documents(tmp_path / "two", documents, shard_tokens=3000, workers=2)
    names = sorted(os.listdir(one))
    assert names == sorted(os.listdir(two)) and "manifest.json" in names and len(names) > 3
    for name in names:
        if name != "manifest.json":
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
    # The manifests differ only in where the source text was.
    manifests = [json.loads((folder / "manifest.json").read_text()) for folder in (one, two)]
    for manifest in manifests:
        manifest["source"].pop("dataset_path")
    assert manifests[0] == manifests[1]


def test_prepare_reads_torchtitans_c4_test_layout_and_hugging_face_datasets(tmp_path, monkeypatch):
    records = [{"text": text, "url": "https://example.com", "timestamp": "2019"} for text in make_documents(3, 30)]
    c4_test = tmp_path / "c4_test"
    c4_test.mkdir()
    (c4_test / "c4_sample.json").write_text("".join(json.dumps(record) + "\n" for record in records))
    prepare("c4_test", str(c4_test), str(tmp_path / "from_c4_test"), workers=1, progress=False)

    def load_dataset(path, name, split, streaming):  # a local dataset, as datasets would stream it
        assert (path, split, streaming) == (str(tmp_path / "hf_dataset"), "train", True)
        return iter(records)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    prepare("huggingface", str(tmp_path / "hf_dataset"), str(tmp_path / "from_hf"), workers=2, progress=False)
    expected = framed_stream([record["text"] for record in records])
    for name in ("from_c4_test", "from_hf"):
        folder = PreparedFolder(str(tmp_path / name))
        tokens = torch.empty(folder.tokens, dtype=torch.int64)
        folder.copy_tokens(0, tokens)
        assert tokens.tolist() == expected, name
    assert PreparedFolder(str(tmp_path / "from_hf")).manifest["source"]["dataset"] == "huggingface"


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    vocab_size = write_word_tokenizer(tmp_path / "tokenizer", 70_000, specials=("<s>", "</s>"))
    tokenizer = build_tokenizer(str(tmp_path / "tokenizer"))
    documents = ["word1 word65535 word65536", "word69999 word0"]
    folder = prepare_documents(tmp_path / "big", documents, hf_assets_path=str(tmp_path / "tokenizer"))
    prepared = PreparedFolder(str(folder))
    assert prepared.dtype == "uint32" and prepared.tokenizer_info["vocab_size"] == vocab_size
    tokens = torch.empty(prepared.tokens, dtype=torch.int64)
    prepared.copy_tokens(0, tokens)
    assert tokens.tolist() == framed_stream(documents, tokenizer)
    assert 69_999 in tokens.tolist()


# --------------------------------------------------------------------------- the order


@pytest.mark.parametrize("size", [1, 2, 3, 17, 64, 1000, 4097])
def test_every_epoch_permutation_is_a_bijection(size):
    permutation = EpochPermutation(size, seed=3, source=0, epoch=1)
    assert sorted(permutation(index) for index in range(size)) == list(range(size))


def test_shuffled_epochs_visit_every_window_once_in_a_seeded_order(corpora):
    windows = windows_of(corpora, "web")
    per_epoch = windows.windows_per_epoch[0]
    starts = [windows.locate(index)[1] for index in range(3 * per_epoch)]
    epochs = [starts[e * per_epoch : (e + 1) * per_epoch] for e in range(3)]
    every_window = [index * (SEQ_LEN + 1) for index in range(per_epoch)]
    for epoch in epochs:
        assert sorted(epoch) == every_window  # exactly once each
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != every_window  # a new order every epoch
    same_seed = windows_of(corpora, "web")
    assert [same_seed.locate(index)[1] for index in range(3 * per_epoch)] == starts
    other_seed = windows_of(corpora, "web", seed=1)
    assert [other_seed.locate(index)[1] for index in range(per_epoch)] != epochs[0]
    unshuffled = windows_of(corpora, "web", shuffle=False)
    assert [unshuffled.locate(index)[1] for index in range(2 * per_epoch)] == every_window * 2


def test_mixture_proportions_hold_in_every_prefix():
    mixture = Mixture([Fraction(7, 10), Fraction(2, 10), Fraction(1, 10)])
    counts = [0, 0, 0]
    for index in range(20_000):
        source, taken_before = mixture.locate(index)
        assert taken_before == counts[source]  # each source's windows are taken in order
        counts[source] += 1
        for weight, count in zip(mixture.weights, counts, strict=True):
            assert abs(count - (index + 1) * weight) <= 2  # a window or two, at any step
    assert mixture.counts(20_000) == counts == [14_000, 4_000, 2_000]


def test_a_mixture_reads_each_folder_through_its_own_epochs(corpora):
    windows = windows_of(corpora, "web:0.75,code:0.25")
    sources = [windows.locate(index) for index in range(4000)]
    code = [start for source, start in sources if source == 1]
    assert len(code) == 1000
    per_epoch = windows.windows_per_epoch[1]
    first_epoch = code[:per_epoch]
    assert sorted(first_epoch) == [index * (SEQ_LEN + 1) for index in range(per_epoch)]


def test_parse_mixture_accepts_one_folder_or_weighted_folders():
    assert parse_mixture("/data/web") == [("/data/web", Fraction(1))]
    assert parse_mixture("/d/web:0.7, /d/code:0.3") == [("/d/web", Fraction(7, 10)), ("/d/code", Fraction(3, 10))]
    for bad, words in (
        ("/a:0.5,/b:-0.5", ["-0.5", "/b", "> 0"]),
        ("/a:0.5,/b:x", ["'x'", "/b"]),
        ("/a:1,/a:2", ["twice"]),
        ("/a:1,:2", ["':2'"]),
    ):
        with pytest.raises(ValueError) as error:
            parse_mixture(bad)
        assert str(error.value).startswith("training.dataset_path")
        for word in words:
            assert word in str(error.value), (word, str(error.value))


# --------------------------------------------------------------------------- the loader


def test_global_batches_are_identical_at_every_layout_and_with_accumulation(corpora):
    global_batch, steps = 12, 6

    def factory():
        return windows_of(corpora, "web:0.6,code:0.4")

    reference = global_batches(loaders(factory, 1, global_batch), steps)
    for dp_degree in (2, 3, 4):
        assert global_batches(loaders(factory, dp_degree, global_batch // dp_degree), steps) == reference, dp_degree
    # dp 2 with 3 micro-batches of 2 windows each per step.
    assert global_batches(loaders(factory, 2, 2), steps, accumulation=3) == reference
    # With read-ahead: the same batches.
    ahead = loaders(factory, 3, 4, prefetch=3)
    assert global_batches(ahead, steps) == reference
    for loader in ahead:
        loader.close()
    # Rows are windows of the expected tokens: window 0 of the global order, straight from the stream.
    source, start = factory().locate(0)
    name = ("web", "code")[source]
    assert reference[0][0] == framed_stream(corpora[name][1])[start : start + SEQ_LEN]


@pytest.mark.parametrize("new_degree,new_batch,accumulation", [(2, 6, 1), (3, 4, 1), (2, 2, 3), (1, 12, 1)])
def test_resume_at_another_layout_replays_the_same_global_batches(corpora, new_degree, new_batch, accumulation):
    def factory():
        return windows_of(corpora, "web:0.6,code:0.4")

    saved_layout = loaders(factory, 4, 3, prefetch=2)
    global_batches(saved_layout, steps=5)
    states = [loader.state_dict() for loader in saved_layout]
    assert all(state == states[0] for state in states)  # one layout-independent state
    assert states[0]["windows_consumed"] == 60  # what was consumed, not what was read ahead
    expected = global_batches(saved_layout, steps=4)
    for loader in saved_layout:
        loader.close()

    resumed = loaders(factory, new_degree, new_batch, prefetch=1)
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert global_batches(resumed, steps=4, accumulation=accumulation) == expected


def test_a_resume_far_into_training_reads_the_windows_found_by_arithmetic(corpora):
    windows = windows_of(corpora, "web:0.6,code:0.4")
    loader = DataLoader(windows, 2, 1, 4)
    state = loader.state_dict()
    far = 10**11 // (SEQ_LEN + 1)  # a position of 1e11 tokens: thousands of epochs in
    loader.load_state_dict(state | {"windows_consumed": far})
    inputs, labels = loader.next_batch()
    for row, window in enumerate((far + 2, far + 3)):
        source, start = windows.locate(window)
        stream = framed_stream(corpora[("web", "code")[source]][1])
        assert inputs[row].tolist() == stream[start : start + SEQ_LEN]
        assert labels[row].tolist() == stream[start + 1 : start + SEQ_LEN + 1]


def test_a_changed_dataset_is_named_unless_allowed(corpora):
    def state_of(spec: str, **options) -> dict:
        loader = DataLoader(windows_of(corpora, spec, **options), 2, 0, 1)
        loader.next_batch()
        return loader.state_dict()

    saved = state_of("web:0.6,code:0.4")
    changes = {
        "data.seed": windows_of(corpora, "web:0.6,code:0.4", seed=5),
        "data.shuffle": windows_of(corpora, "web:0.6,code:0.4", shuffle=False),
        "training.dataset_path weights": windows_of(corpora, "web:0.5,code:0.5"),
        "training.dataset_path:": windows_of(corpora, "web"),
    }
    for named, windows in changes.items():
        with pytest.raises(ValueError, match=named) as error:
            DataLoader(windows, 2, 0, 1).load_state_dict(saved)
        assert "data.allow_changed_data" in str(error.value)
    allowed = DataLoader(windows_of(corpora, "web:0.6,code:0.4", seed=5), 2, 0, 1, allow_changed_data=True)
    allowed.load_state_dict(saved)
    assert allowed.windows_consumed == 2


def test_the_same_data_in_another_place_resumes(corpora, tmp_path):
    loader = DataLoader(windows_of(corpora, "web"), 2, 0, 1)
    loader.next_batch()
    expected = loader.next_batch()[0]
    moved = copy_of(corpora["web"][0], tmp_path / "moved")  # e.g. another mount point
    resumed = DataLoader(open_prepared(str(moved), ByteTokenizer(), "the byte tokenizer", SEQ_LEN, True, 0), 2, 0, 1)
    resumed.load_state_dict(loader.state_dict() | {"windows_consumed": 2})
    assert torch.equal(resumed.next_batch()[0], expected)


def test_a_corrupted_token_id_fails_the_batch_not_the_embedding(corpora, tmp_path):
    folder = tmp_path / "web"
    folder.mkdir()
    for name in os.listdir(corpora["web"][0]):
        (folder / name).write_bytes((corpora["web"][0] / name).read_bytes())
    with open(folder / "tokens-00000.bin", "r+b") as shard:
        shard.write(b"\xff\xff" * 64)  # id 65535, far beyond the byte tokenizer's 258
    windows = open_prepared(str(folder), ByteTokenizer(), "the byte tokenizer", SEQ_LEN, False, 0)
    assert "tokens-00000.bin" in verify_share(windows, 0, 1) and "checksum" in verify_share(windows, 0, 1)
    with pytest.raises(ValueError, match="65535.*vocabulary"):
        DataLoader(windows, 2, 0, 1).next_batch()


def test_the_ranks_share_the_checksum_work(corpora):
    windows = windows_of(corpora, "web:1,code:1")
    files = [name for folder in windows.folders for name in folder.file_names]
    checked = []
    for folder in windows.folders:
        original = folder.verify_checksums
        folder.verify_checksums = lambda names, original=original: checked.extend(names) or original(names)
    for rank in range(3):
        assert verify_share(windows, rank, 3) is None
    assert sorted(checked) == sorted(files) and len(checked) == len(files)  # each file once over the ranks


def test_read_ahead_errors_reach_the_training_thread():
    def broken_documents():
        yield "fine"
        raise ValueError("corpus.jsonl:2: line is not valid JSON")

    loader = DataLoader(PackedLoader(broken_documents, ByteTokenizer(), 8, 1, 0, 1).windows, 1, 0, 1, prefetch=2)
    with pytest.raises(ValueError, match="corpus.jsonl:2"):
        for _ in range(10):
            loader.next_batch()
    loader.close()


# --------------------------------------------------------------------------- raw streams


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


def test_a_raw_stream_resumes_from_its_cursor_without_tokenizing_from_the_start():
    documents = make_documents(9, 500)

    def source():
        return iter(documents)

    original = PackedLoader(source, CountingTokenizer(), SEQ_LEN, 2, 1, 3)
    for _ in range(300):
        original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch()[0] for _ in range(3)]

    tokenizer = CountingTokenizer()
    resumed = PackedLoader(source, tokenizer, SEQ_LEN, 2, 1, 3)
    resumed.load_state_dict(state)
    for expected_inputs in expected:
        assert torch.equal(resumed.next_batch()[0], expected_inputs)
    epoch, document, _ = json.loads(state["cursor"])
    assert epoch * len(documents) + document > 150  # far into the data ...
    assert tokenizer.encoded < 40  # ... yet only the documents around the position were tokenized


def test_raw_stream_batches_match_after_a_resume():
    documents = make_documents(9, 200)
    original = PackedLoader(lambda: iter(documents), ByteTokenizer(), SEQ_LEN, 3, 0, 2)
    for _ in range(50):
        original.next_batch()
    state = original.state_dict()
    resumed = PackedLoader(lambda: iter(documents), ByteTokenizer(), SEQ_LEN, 6, 0, 1)  # another layout
    resumed.load_state_dict(state)
    rank1 = PackedLoader(lambda: iter(documents), ByteTokenizer(), SEQ_LEN, 3, 1, 2)
    rank1.load_state_dict(state)
    for _ in range(5):
        assert torch.equal(resumed.next_batch()[0], torch.cat([original.next_batch()[0], rank1.next_batch()[0]]))


def test_raw_streams_warn_at_large_dp_degrees_and_prepared_data_never(corpora, tmp_path):
    text = write_jsonl(tmp_path / "corpus" / "a.jsonl", ["one document"])
    stream = open_windows(
        "text",
        str(text.parent),
        ByteTokenizer(),
        SEQ_LEN,
        hf_assets_path=None,
        shuffle=True,
        seed=0,
        cache_folder=str(tmp_path / "cache"),
    )
    assert stream_warning(stream, "text", 2) is None
    warning = stream_warning(stream, "text", 8)
    assert "8" in warning and "python -m titanlite.data.prepare" in warning and "\n" not in warning
    assert stream_warning(windows_of(corpora, "web"), "prepared", 4096) is None


# --------------------------------------------------------------------------- bad prepared folders


def copy_of(folder: Path, destination: Path) -> Path:
    destination.mkdir()
    for name in os.listdir(folder):
        (destination / name).write_bytes((folder / name).read_bytes())
    return destination


def test_bad_folders_are_one_line_naming_the_file(corpora, tmp_path):
    web = corpora["web"][0]
    truncated = copy_of(web, tmp_path / "truncated")
    with open(truncated / "tokens-00002.bin", "r+b") as shard:
        shard.truncate(100)
    no_manifest = copy_of(web, tmp_path / "no_manifest")
    (no_manifest / "manifest.json").unlink()
    cases = {
        str(truncated): ["tokens-00002.bin", "100 bytes", "expected 2000"],
        str(no_manifest): ["manifest.json", "python -m titanlite.data.prepare"],
        str(tmp_path / "nowhere"): ["nowhere", "no such prepared folder"],
    }
    for path, words in cases.items():
        with pytest.raises(ValueError) as error:
            open_prepared(path, ByteTokenizer(), "the byte tokenizer", SEQ_LEN, True, 0)
        message = str(error.value)
        assert message.startswith(f"training.dataset_path {path}:") and "\n" not in message
        for word in words:
            assert word in message, (word, message)


def test_data_from_another_tokenizer_is_refused(corpora, tmp_path):
    write_word_tokenizer(tmp_path / "tokenizer", 20, specials=("<s>", "</s>"))
    words = build_tokenizer(str(tmp_path / "tokenizer"))
    with pytest.raises(ValueError) as error:
        open_prepared(str(corpora["web"][0]), words, f"model.hf_assets_path {tmp_path / 'tokenizer'}", SEQ_LEN, True, 0)
    message = str(error.value)
    assert "another tokenizer" in message and ByteTokenizer.fingerprint in message and words.fingerprint in message
    assert "model.hf_assets_path" in message


# --------------------------------------------------------------------------- the prepare command


def test_prepare_refuses_a_folder_it_did_not_make_and_reruns_in_no_time(tmp_path, capsys):
    source = write_jsonl(tmp_path / "src" / "a.jsonl", make_documents(4, 50))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "precious.txt").write_text("keep me")
    assert prepare_main(["--dataset_path", str(source), "--output", str(occupied), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(occupied) in err[0] and "--output" in err[0]
    assert (occupied / "precious.txt").read_text() == "keep me"

    out = tmp_path / "out"
    assert prepare_main(["--dataset_path", str(source), "--output", str(out), "--workers", "1"]) == 0
    before = {name: (out / name).stat().st_mtime_ns for name in os.listdir(out)}
    capsys.readouterr()
    assert prepare_main(["--dataset_path", str(source), "--output", str(out), "--workers", "2"]) == 0
    assert {name: (out / name).stat().st_mtime_ns for name in os.listdir(out)} == before  # nothing rewritten
    assert "already prepared" in capsys.readouterr().out
    # The source grew since: the old folder is not handed out as if it held it.
    write_jsonl(source, make_documents(4, 51))
    assert prepare_main(["--dataset_path", str(source), "--output", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "files have changed" in err[0] and str(out) in err[0]


def snapshot(folder: Path) -> dict:
    """Every path under ``folder``, with each file's bytes."""
    return {str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes() for path in folder.rglob("*")}


# (id, arguments after --dataset_path {tmp}/src, what the line must match, files to write first);
# "{tmp}" stands for the case's folder. Found after the work began, the bad line must not leave out.partial.
PREPARE_MISTAKES = [
    ("bad_json_line", ["--output", "{tmp}/out", "--workers", "2"],
     r"{tmp}/src/part-1\.jsonl:2: line is not valid JSON", {"src/part-1.jsonl": '{"text": "a"}\n{"text": \n'}),
    ("shard_tokens_zero", ["--output", "{tmp}/out", "--shard_tokens", "0"],
     r"--shard_tokens: expected >= 1, got 0", {}),
    ("workers_zero", ["--output", "{tmp}/out", "--workers", "0"], r"--workers: expected >= 1, got 0", {}),
    ("output_below_a_file", ["--output", "{tmp}/taken/out"],
     r"--output {tmp}/taken/out: {tmp}/taken is a file, so no folder can be made below it", {"taken": "a file"}),
    ("output_is_a_file", ["--output", "{tmp}/taken"],
     r"--output {tmp}/taken: exists and is not a prepared folder; choose another path", {"taken": "x"}),
    ("partial_not_left_by_prepare", ["--output", "{tmp}/out"],
     r"--output {tmp}/out: {tmp}/out\.partial exists and was not left by a prepare; move it away",
     {"out.partial": "x"}),
]  # fmt: skip


@pytest.mark.parametrize(
    "arguments, expect, files", [case[1:] for case in PREPARE_MISTAKES], ids=[case[0] for case in PREPARE_MISTAKES]
)
def test_a_prepare_mistake_is_one_line_and_writes_nothing(tmp_path, capsys, arguments, expect, files):
    write_jsonl(tmp_path / "src" / "part-0.jsonl", make_documents(8, 5))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = prepare_main(
        ["--dataset_path", f"{tmp_path}/src", *(arg.replace("{tmp}", str(tmp_path)) for arg in arguments)]
    )
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    prefix = "titanlite.data.prepare: "
    assert lines[0].startswith(prefix) and re.fullmatch(
        expect.replace("{tmp}", re.escape(str(tmp_path))), lines[0][len(prefix) :]
    ), lines
    assert snapshot(tmp_path) == before


class FullDiskWriter(prepare_module.PreparedWriter):
    """Writes its first chunk, then fails as a write to a full disk does: ENOSPC, naming no file."""

    def add(self, tokens, document_lengths):
        super().add(tokens, document_lengths)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def refuse_folders(path, *args, **kwargs):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)


@pytest.mark.parametrize(
    "target, stand_in, expect",
    [
        ("PreparedWriter", FullDiskWriter, r"{out}\.partial: No space left on device; {out} was not created"),
        ("os.makedirs", refuse_folders, r"{out}\.partial\.\d+: Permission denied; {out} was not created"),
    ],
    ids=["full_disk", "no_permission"],
)
def test_an_os_error_is_one_line_and_removes_the_partial_folder(
    tmp_path, monkeypatch, capsys, target, stand_in, expect
):
    source = write_jsonl(tmp_path / "src" / "part.jsonl", make_documents(9, 40))
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(f"titanlite.data.prepare.{target}", stand_in)
    code = prepare_main(["--dataset_path", str(source), "--output", str(out), "--workers", "1"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert re.fullmatch("titanlite.data.prepare: " + expect.replace("{out}", re.escape(str(out))), lines[0]), lines
    assert snapshot(tmp_path) == before


def start_and_stop_prepare(command: list[str], env: dict, partial: Path, signum: int, group: bool) -> subprocess.Popen:
    """Starts ``command``, sends ``signum`` well into the work to it alone or to its whole
    process group (its workers too), and waits."""
    # A child inherits an ignored SIGINT (a test run started in the background has one), never a handler.
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    deadline = time.monotonic() + 120
    while not (partial / "tokens-00002.bin").exists():  # well into the work
        assert process.poll() is None, "the prepare finished before it could be stopped: make the source bigger"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (os.killpg if group else os.kill)(process.pid, signum)
    try:
        process.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left, also when the wait failed
            os.killpg(process.pid, signal.SIGKILL)
    return process


def test_a_stopped_prepare_cleans_up_a_killed_one_leaves_nothing_that_loads_and_a_rerun_succeeds(tmp_path):
    documents = make_documents(6, 12_000, max_words=60)
    source = write_jsonl(tmp_path / "src" / "big.jsonl", documents)
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "titanlite.data.prepare",
        "--dataset_path",
        str(source),
        "--output",
        str(out),
        "--workers",
        "2",
        "--shard_tokens",
        "20000",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    partial = Path(str(out) + ".partial")
    # Ctrl-C and kill PID: one line, and the work removed.
    for signum in (signal.SIGINT, signal.SIGTERM):
        stopped = start_and_stop_prepare(command, env, partial, signum, group=False)
        lines = stopped.stderr.read().strip().splitlines()
        assert stopped.returncode == 130, (signum, stopped.returncode, lines)
        assert lines == [f"titanlite.data.prepare: interrupted; {out} was not created"], (signum, lines)
        assert not out.exists() and not partial.exists()

    start_and_stop_prepare(command, env, partial, signal.SIGKILL, group=True).stderr.close()  # no chance to clean up
    assert not out.exists() and partial.is_dir()
    with pytest.raises(ValueError, match=r"no such prepared folder \(an unfinished prepare left it as \.partial"):
        PreparedFolder(str(out))

    subprocess.run(command, env=env, check=True, capture_output=True, timeout=300)
    assert not partial.exists()
    folder = PreparedFolder(str(out))
    assert folder.verify_checksums() is None and folder.documents == len(documents)
    clean = prepare_documents(tmp_path / "clean", documents, shard_tokens=20000)
    for name in folder.file_names:
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name


def test_a_worker_that_dies_mid_prepare_ends_the_command_with_one_line(tmp_path, monkeypatch, capsys):
    # A worker lost to the kernel's out-of-memory killer must end the command, not hang it.
    source = write_jsonl(tmp_path / "src" / "part.jsonl", make_documents(7, 50))
    out = tmp_path / "out"
    argv = ["--dataset_path", str(source), "--output", str(out), "--workers", "2"]
    monkeypatch.setattr(prepare_module, "encode_chunk", exit_abruptly)  # what each worker is asked to run
    assert prepare_main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "a worker process died" in lines[0] and str(out) in lines[0], lines
    assert not out.exists()
    assert not out.exists() and not Path(f"{out}.partial").exists()
    monkeypatch.undo()
    assert prepare_main(argv) == 0 and PreparedFolder(str(out)).documents == 50


def test_a_dropped_loader_stops_its_read_ahead_thread(corpora):
    # A loader nobody closed must not leave a thread behind: a process that later starts
    # workers (prepare, the checkpoint writer) would carry it along.
    loader = DataLoader(windows_of(corpora, "web"), 2, 0, 1, prefetch=2)
    loader.next_batch()
    thread = loader._reader._thread
    assert thread.is_alive()
    del loader
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
