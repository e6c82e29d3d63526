"""Tests for the data package: tokenizers, document sources, packing, data-parallel splits and resume."""

from __future__ import annotations

import gzip
import json
import re
import sys
import types

import pytest
import torch

from titanlite.data import (
    ByteTokenizer,
    HFTokenizer,
    PackedLoader,
    build_documents,
    build_loader,
    build_tokenizer,
)
from titanlite.data.sources import python_stdlib_documents, stdlib_split_files, text_file_documents

# Short documents of different lengths so windows straddle document boundaries.
SMALL_DOCUMENTS = [f"document {index}: " + "abcdefghij"[: index % 10] * (index % 4 + 1) for index in range(40)]


def small_documents():
    return iter(SMALL_DOCUMENTS)


def expected_stream(documents, tokenizer, epochs: int) -> list[int]:
    """The reference token stream, built the slow and obvious way."""
    stream = []
    for _ in range(epochs):
        for document in documents:
            stream += [tokenizer.bos_id] + tokenizer.encode(document) + [tokenizer.eos_id]
    return stream


def make_loader(local_batch_size=2, dp_rank=0, dp_degree=1, seq_len=16, documents=small_documents):
    return PackedLoader(documents, ByteTokenizer(), seq_len, local_batch_size, dp_rank, dp_degree)


def global_windows(loaders, steps: int) -> list[torch.Tensor]:
    """Per step, the inputs of all ranks concatenated in rank order."""
    return [torch.cat([loader.next_batch()[0] for loader in loaders]) for _ in range(steps)]


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_with_non_ascii():
    tokenizer = ByteTokenizer()
    text = "héllo wörld ✓ 😀 — π"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= token_id < 256 for token_id in ids)
    assert tokenizer.decode([tokenizer.bos_id] + ids + [tokenizer.eos_id]) == text
    assert tokenizer.decode(torch.tensor(ids)) == text
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (256, 257, 258)
    assert isinstance(build_tokenizer(None), ByteTokenizer)


def _save_tiny_hf_tokenizer(folder, with_config: bool):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>", "<bos_x>", "<eos_x>"])
    tokenizer.train_from_iterator(["the cat sat on the mat", "the dog ate the cat", "a mat for a cat"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    if with_config:
        config = {"bos_token": "<bos_x>", "eos_token": {"content": "<eos_x>", "special": True}}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def test_hf_tokenizer_encodes_decodes_and_finds_special_tokens(tmp_path):
    reference = _save_tiny_hf_tokenizer(tmp_path, with_config=True)
    tokenizer = build_tokenizer(str(tmp_path))  # a folder
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.bos_id == reference.token_to_id("<bos_x>")
    assert tokenizer.eos_id == reference.token_to_id("<eos_x>")
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    ids = tokenizer.encode("the cat sat")
    assert ids == reference.encode("the cat sat", add_special_tokens=False).ids
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.decode([tokenizer.bos_id] + ids + [tokenizer.eos_id]).split() == ["the", "cat", "sat"]
    # A path to the file itself works too, and packing uses the tokenizer's BOS/EOS.
    same = build_tokenizer(str(tmp_path / "tokenizer.json"))
    loader = PackedLoader(lambda: iter(["the cat", "a dog"]), same, 4, 1, 0, 1)
    inputs, _ = loader.next_batch()
    assert inputs[0, 0].item() == tokenizer.bos_id


def test_hf_tokenizer_falls_back_to_well_known_tokens(tmp_path):
    reference = _save_tiny_hf_tokenizer(tmp_path, with_config=False)
    tokenizer = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.bos_id == reference.token_to_id("<s>")
    assert tokenizer.eos_id == reference.token_to_id("</s>")


def test_build_tokenizer_missing_path_names_it(tmp_path):
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(ValueError, match="no_such_tokenizer"):
        build_tokenizer(str(missing))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        build_tokenizer(str(tmp_path))  # folder exists but holds no tokenizer.json


# --------------------------------------------------------------------------- packing


def test_windows_are_shifted_and_documents_carry_bos_eos():
    tokenizer = ByteTokenizer()
    seq_len, batch = 16, 3
    loader = make_loader(local_batch_size=batch, seq_len=seq_len)
    stream = expected_stream(SMALL_DOCUMENTS, tokenizer, epochs=1)
    inputs, labels = loader.next_batch()
    assert inputs.shape == labels.shape == (batch, seq_len)
    assert inputs.dtype == labels.dtype == torch.int64
    for row in range(batch):
        window = stream[row * (seq_len + 1) : (row + 1) * (seq_len + 1)]
        assert inputs[row].tolist() == window[:-1]
        assert labels[row].tolist() == window[1:]
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert inputs[0, 0].item() == tokenizer.bos_id
    assert tokenizer.eos_id in inputs.flatten().tolist()
    assert loader.windows_consumed == batch


def test_ranks_get_disjoint_windows_matching_a_single_loader():
    degree, batch, steps = 4, 2, 5
    ranks = [make_loader(local_batch_size=batch, dp_rank=rank, dp_degree=degree) for rank in range(degree)]
    single = make_loader(local_batch_size=batch * degree)
    for _ in range(steps):
        rank_inputs = [loader.next_batch()[0] for loader in ranks]
        assert torch.equal(torch.cat(rank_inputs), single.next_batch()[0])
        # The small corpus never repeats within a step, so identical rows would mean overlap.
        rows = [tuple(row.tolist()) for inputs in rank_inputs for row in inputs]
        assert len(set(rows)) == len(rows)
    assert all(loader.windows_consumed == single.windows_consumed == steps * batch * degree for loader in ranks)


def test_epoch_wraps_around_and_carries_the_leftover(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second doc")
    tokenizer = ByteTokenizer()
    seq_len = 6
    loader = build_loader("text", str(tmp_path), tokenizer, seq_len, 1, 0, 1)
    stream = expected_stream(["first", "second doc"], tokenizer, epochs=10)
    one_epoch = len(expected_stream(["first", "second doc"], tokenizer, epochs=1))
    steps = 3 * one_epoch // (seq_len + 1) + 1  # well into the fourth epoch
    for step in range(steps):
        inputs, labels = loader.next_batch()
        window = stream[step * (seq_len + 1) : (step + 1) * (seq_len + 1)]
        assert inputs[0].tolist() == window[:-1] and labels[0].tolist() == window[1:]


# --------------------------------------------------------------------------- resume


def test_resume_continues_with_identical_tensors():
    original = make_loader(local_batch_size=2, dp_rank=1, dp_degree=2)
    for _ in range(3):
        original.next_batch()
    state = original.state_dict()
    assert state["windows_consumed"] == 12
    resumed = make_loader(local_batch_size=2, dp_rank=1, dp_degree=2)
    resumed.load_state_dict(state)
    for _ in range(4):
        expected_inputs, expected_labels = original.next_batch()
        inputs, labels = resumed.next_batch()
        assert torch.equal(inputs, expected_inputs) and torch.equal(labels, expected_labels)


def test_resume_backwards_restarts_the_stream():
    loader = make_loader(local_batch_size=2)
    at_start = loader.state_dict()
    first = loader.next_batch()[0]
    state = loader.state_dict()
    second = loader.next_batch()[0]
    loader.next_batch()
    loader.load_state_dict(state)
    assert torch.equal(loader.next_batch()[0], second)
    loader.load_state_dict(at_start)
    assert torch.equal(loader.next_batch()[0], first)


@pytest.mark.parametrize("new_degree,new_batch", [(2, 2), (1, 4)])
def test_resume_at_another_dp_degree_gives_the_same_global_windows(new_degree, new_batch):
    saved_layout = [make_loader(local_batch_size=1, dp_rank=rank, dp_degree=4) for rank in range(4)]
    global_windows(saved_layout, steps=3)
    states = [loader.state_dict() for loader in saved_layout]
    assert all(state == states[0] for state in states)  # every rank saves the same position
    expected = global_windows(saved_layout, steps=4)

    new_layout = [
        make_loader(local_batch_size=new_batch, dp_rank=rank, dp_degree=new_degree) for rank in range(new_degree)
    ]
    for loader in new_layout:
        loader.load_state_dict(states[0])
    for expected_step, step in zip(expected, global_windows(new_layout, steps=4), strict=True):
        assert torch.equal(step, expected_step)


def test_load_with_another_seq_len_is_an_error():
    state = make_loader(seq_len=16).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        make_loader(seq_len=32).load_state_dict(state)
    with pytest.raises(ValueError, match="windows_consumed"):
        make_loader(seq_len=16).load_state_dict({"seq_len": 16})


def test_loader_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dp_rank"):
        make_loader(dp_rank=2, dp_degree=2)
    with pytest.raises(ValueError, match="seq_len"):
        make_loader(seq_len=0)
    with pytest.raises(ValueError, match="local_batch_size"):
        make_loader(local_batch_size=0)


# --------------------------------------------------------------------------- sources


def test_python_stdlib_splits_are_non_empty_disjoint_and_deterministic():
    train_files, validation_files = stdlib_split_files("train"), stdlib_split_files("validation")
    assert len(train_files) > 100 and len(validation_files) > 5
    assert not set(train_files) & set(validation_files)
    assert all("site-packages" not in path and "dist-packages" not in path for path in train_files)
    assert train_files == sorted(train_files) and stdlib_split_files("train") == train_files

    documents = build_documents("python_stdlib", None, split="validation")
    first_pass = list(documents())
    assert first_pass and all(isinstance(document, str) and document.strip() for document in first_pass)
    assert list(documents()) == first_pass  # each call starts again from the beginning, same order
    first_train = next(python_stdlib_documents("train"))
    assert first_train not in first_pass
    with pytest.raises(ValueError, match="python_stdlib split"):
        build_documents("python_stdlib", None, split="test")


def test_text_dataset_reads_txt_jsonl_and_jsonl_gz(tmp_path):
    (tmp_path / "b_notes.txt").write_text("plain text ✓\nsecond line", encoding="utf-8")
    nested = tmp_path / "a_nested"
    nested.mkdir()
    rows = [json.dumps({"text": "row one"}), "", json.dumps({"text": "row two", "id": 2})]  # blank line is skipped
    (nested / "rows.jsonl").write_text("\n".join(rows) + "\n")
    with gzip.open(tmp_path / "c_packed.jsonl.gz", "wt", encoding="utf-8") as packed:
        packed.write(json.dumps({"text": "zipped row"}) + "\n")
    (tmp_path / "ignored.csv").write_text("not,a,document")

    documents = build_documents("text", str(tmp_path))
    assert list(documents()) == ["row one", "row two", "plain text ✓\nsecond line", "zipped row"]
    assert list(documents()) == list(documents())
    assert list(text_file_documents(str(tmp_path / "c_packed.jsonl.gz"))) == ["zipped row"]


def test_text_dataset_errors_name_the_path(tmp_path):
    missing = tmp_path / "missing_corpus"
    with pytest.raises(ValueError, match="missing_corpus"):
        build_documents("text", str(missing))

    empty = tmp_path / "empty_corpus"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty_corpus"):
        build_documents("text", str(empty))

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        list(text_file_documents(str(bad_json)))

    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"content": "wrong field"}) + "\n")
    with pytest.raises(ValueError, match=r"no_text\.jsonl:1.*'text'"):
        build_documents("text", str(no_text))

    no_documents = tmp_path / "blank.jsonl"
    no_documents.write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank\.jsonl.*no documents"):
        build_documents("text", str(no_documents))


def test_build_documents_rejects_unknown_dataset_and_missing_path():
    with pytest.raises(ValueError, match="dataset 'wikipedia'"):
        build_documents("wikipedia", None)
    with pytest.raises(ValueError, match="dataset_path"):
        build_documents("text", None)
    with pytest.raises(ValueError, match="dataset_path"):
        build_documents("huggingface", None)


def test_huggingface_source_yields_the_text_field(monkeypatch):
    calls = []

    def fake_load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        return iter([{"text": "first record"}, {"text": "second record", "meta": 1}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset))
    documents = build_documents("huggingface", "some/corpus", split="validation")
    assert list(documents()) == ["first record", "second record"]
    assert calls[-1] == ("some/corpus", None, "validation", True)


@pytest.mark.parametrize(
    "dataset, dataset_path, split, expected_call",
    [
        ("c4", None, "train", ("allenai/c4", "en", "train", True)),
        ("c4", None, "validation", ("allenai/c4", "en", "validation", True)),
        ("c4_validation", None, "train", ("allenai/c4", "en", "validation", True)),
        ("c4", "/mirror/c4", "train", ("/mirror/c4", "en", "train", True)),
    ],
)
def test_torchtitan_c4_names_read_allenai_c4_en(monkeypatch, dataset, dataset_path, split, expected_call):
    calls = []

    def fake_load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        return iter([{"text": "c4 record", "url": "https://example.com", "timestamp": "2019"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset))
    documents = build_documents(dataset, dataset_path, split=split)
    assert list(documents()) == ["c4 record"]
    assert set(calls) == {expected_call}


def test_c4_test_reads_json_lines_at_torchtitans_path(tmp_path, monkeypatch):
    folder = tmp_path / "tests" / "assets" / "c4_test"
    folder.mkdir(parents=True)
    records = [
        {"text": "first c4 document", "timestamp": "2019-04-25", "url": "https://a.example"},
        {"text": "second c4 document", "timestamp": "2019-04-26", "url": "https://b.example"},
    ]
    (folder / "data.json").write_text("".join(json.dumps(record) + "\n" for record in records))
    monkeypatch.chdir(tmp_path)  # torchtitan's default path is relative to where the run starts
    assert list(build_documents("c4_test", None)()) == ["first c4 document", "second c4 document"]
    # dataset_path moves it; the validation split of c4_test is the same sample, as in torchtitan
    monkeypatch.chdir("/")
    assert list(build_documents("c4_test", str(folder), split="validation")()) == [
        "first c4 document",
        "second c4 document",
    ]


def test_c4_test_errors_name_the_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^dataset_path tests/assets/c4_test: no such file or folder$"):
        build_documents("c4_test", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: folder has no \.json, \.jsonl or \.jsonl\.gz files$"):
        build_documents("c4_test", str(tmp_path / "empty"))
    (tmp_path / "array").mkdir()
    (tmp_path / "array" / "data.json").write_text('[{"text": "a JSON array, not JSON lines"}]')
    with pytest.raises(ValueError, match=r"data\.json:1: expected a JSON object with a string 'text' field"):
        build_documents("c4_test", str(tmp_path / "array"))


def test_huggingface_without_datasets_package_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ValueError, match=r"some/corpus.*pip install datasets"):
        build_documents("huggingface", "some/corpus")


def test_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError) as error:
        build_documents("text", str(tmp_path / "nowhere"))
    assert "\n" not in str(error.value)
