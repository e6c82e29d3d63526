"""Validation on a prepared folder: the windows, the order and the loss of the raw source it was
prepared from, split over 1 to 4 data-parallel ranks, with nothing tokenized while it runs.

The losses are compared with ``==``. Rank r's step s reads the block of windows
``[(s * dp + r) * b, ... + b)``, so the blocks of b windows, and each block's float32 loss sum,
are the same at every degree; only the order in which the float64 totals add those sums
changes, and float64 adds a few dozen float32 values of one magnitude without rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import shutil

import pytest
import torch
import torch.distributed as dist

from tests.prepared_data import make_documents, prepare_documents
from tests.rank_jobs import run_on_ranks
from titanlite.config import ConfigError, parse_args
from titanlite.config.training import Validation
from titanlite.data import ByteTokenizer, PreparedWindows
from titanlite.loss import cross_entropy_sum
from titanlite.models.llama import LlamaArgs, Transformer
from titanlite.parallel import ParallelDims
from titanlite.train import Trainer
from titanlite.trainer_setup import build_run_validator
from titanlite.validation import Validator, build_validator

SEQ_LEN = 16
LOCAL_BATCH = 2
# 40 documents of 0-12 words: 79 whole windows of 17 byte tokens, so the last block of 2
# windows is partial and the blocks do not divide evenly over 3 or 4 ranks.
DOCUMENTS = make_documents(seed=5, count=40, max_words=12)
DP_DEGREES = (1, 2, 3, 4)
# A small model, so that a forward takes milliseconds; the byte tokenizer's vocabulary.
MODEL_ARGS = LlamaArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=258, multiple_of=16, max_seq_len=32)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> tuple[str, str]:
    """(the raw JSON-lines file, the folder prepared from it in shards of 97 tokens, so that
    windows straddle shard files)."""
    root = tmp_path_factory.mktemp("held_out")
    folder = prepare_documents(root / "prepared", DOCUMENTS, shard_tokens=97)
    return str(root / "prepared-source" / "part.jsonl"), str(folder)


def held_out_section(kind: str, held_out: tuple[str, str], **overrides) -> Validation:
    raw_path, folder = held_out
    dataset, path = ("text", raw_path) if kind == "raw" else ("prepared", folder)
    fields = dict(enable=True, dataset=dataset, dataset_path=path, local_batch_size=LOCAL_BATCH, steps=-1)
    return Validation(**{**fields, **overrides})


def make_validator(kind: str, held_out, dp_rank: int = 0, dp_degree: int = 1, steps: int = -1, **options) -> Validator:
    """The validator of the raw source or the prepared folder, as build_validator makes it."""
    return build_validator(
        held_out_section(kind, held_out, steps=steps),
        tokenizer=ByteTokenizer(),
        training_seq_len=SEQ_LEN,
        training_local_batch_size=LOCAL_BATCH,
        loss_fn=cross_entropy_sum,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        **options,
    )


def small_model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(MODEL_ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.eval()


@contextlib.contextmanager
def counting_encodes():
    """Counts the texts the byte tokenizer encodes inside the block ([count], reset at will)."""
    calls = [0]
    encode, encode_batch = ByteTokenizer.encode, ByteTokenizer.encode_batch

    def counted_encode(self, text):
        calls[0] += 1
        return encode(self, text)

    def counted_encode_batch(self, texts):
        calls[0] += len(texts)
        return encode_batch(self, texts)

    ByteTokenizer.encode, ByteTokenizer.encode_batch = counted_encode, counted_encode_batch
    try:
        yield calls
    finally:
        ByteTokenizer.encode, ByteTokenizer.encode_batch = encode, encode_batch


@pytest.fixture
def encode_calls():
    with counting_encodes() as calls:
        yield calls


def windows_read(validator: Validator) -> list[torch.Tensor]:
    """The [inputs | last label] rows this rank's loader hands the validator, step by step."""
    loader = validator._new_loader()
    rows = []
    for _ in range(validator.steps):
        inputs, labels = loader.next_batch()
        rows.append(torch.cat([inputs, labels[:, -1:]], dim=1))
    return rows


# --------------------------------------------------------------------------- one process


def hand_windows() -> torch.Tensor:
    """Every whole held-out window, [W, seq_len + 1], cut from the stream built the obvious way."""
    tokenizer = ByteTokenizer()
    stream = []
    for document in DOCUMENTS:
        stream += [tokenizer.bos_id] + tokenizer.encode(document) + [tokenizer.eos_id]
    count = len(stream) // (SEQ_LEN + 1)
    return torch.tensor(stream[: count * (SEQ_LEN + 1)]).view(count, SEQ_LEN + 1)


def test_each_rank_reads_its_own_blocks_of_the_raw_windows(held_out, encode_calls):
    expected = hand_windows()
    # The last block is partial, and at dp 3 and 4 the last step is partly past the set.
    assert len(expected) % LOCAL_BATCH and all(len(expected) % (LOCAL_BATCH * dp) for dp in (3, 4))
    for dp_degree in DP_DEGREES:
        for rank in range(dp_degree):
            raw = make_validator("raw", held_out, rank, dp_degree)
            encode_calls[0] = 0
            prepared = make_validator("prepared", held_out, rank, dp_degree)
            assert isinstance(prepared.held_out, PreparedWindows)
            assert (prepared.windows, prepared.steps) == (raw.windows, raw.steps) == (len(expected), raw.steps)
            prepared_rows = windows_read(prepared)
            assert encode_calls[0] == 0, "the prepared validator tokenized text"
            raw_rows = windows_read(raw)
            for step, (from_raw, from_prepared) in enumerate(zip(raw_rows, prepared_rows, strict=True)):
                # Rows past the set only keep the ranks' forward counts equal: they are not
                # evaluated, and there the raw stream runs on into its next pass.
                in_set = prepared._rows_in_set(step)
                first = (step * dp_degree + rank) * LOCAL_BATCH  # block step * dp + rank
                assert torch.equal(from_prepared[:in_set], expected[first : first + in_set]), (dp_degree, rank, step)
                assert torch.equal(from_raw[:in_set], from_prepared[:in_set]), (dp_degree, rank, step)


def test_a_mixture_is_refused_for_validation(held_out):
    _, folder = held_out
    with pytest.raises(ValueError, match=r"^validation\.dataset_path .*: expected one prepared folder, not a mixture$"):
        build_validator(
            Validation(enable=True, dataset="prepared", dataset_path=f"{folder}:1,{folder}-copy:1"),
            tokenizer=ByteTokenizer(),
            training_seq_len=SEQ_LEN,
            training_local_batch_size=LOCAL_BATCH,
            loss_fn=cross_entropy_sum,
        )


# --------------------------------------------------------------------------- the trainer


def trainer_args(dump_folder: str, validation: Validation) -> list[str]:
    return [
        "--model.flavor=tiny",
        f"--training.seq_len={SEQ_LEN}",
        f"--training.local_batch_size={LOCAL_BATCH}",
        "--training.mixed_precision_param=float32",
        "--activation_checkpoint.mode=none",
        "--validation.enable",
        f"--validation.dataset={validation.dataset}",
        f"--validation.dataset_path={validation.dataset_path}",
        "--validation.steps=-1",
        f"--job.dump_folder={dump_folder}",
    ]


@pytest.mark.parametrize("kind", ["prepared", "raw"])
def test_nothing_is_tokenized_while_training_with_prepared_validation(kind, held_out, tmp_path, encode_calls):
    """Two training steps and an evaluation after the trainer is built: the prepared folder
    encodes nothing (training reads the built-in corpus, prepared); the raw source, the same
    run's counterpart, shows that the count sees tokenizing."""
    trainer = Trainer(parse_args(trainer_args(str(tmp_path), held_out_section(kind, held_out))))
    encode_calls[0] = 0
    for _ in range(2):
        trainer.train_step()
    result = trainer.validator.validate(trainer.model)
    if kind == "prepared":
        assert encode_calls[0] == 0
    else:
        assert encode_calls[0] >= len(DOCUMENTS)
    assert result["tokens"] == len(hand_windows()) * SEQ_LEN


def test_the_trainer_validator_warns_and_checks_like_training(held_out, tmp_path, caplog):
    """At dp 4 a raw held-out source gets training's warning, a prepared folder none; a
    prepared file whose bytes changed is a config error naming validation.dataset_path."""
    trainer = Trainer(parse_args(trainer_args(str(tmp_path / "dump"), held_out_section("prepared", held_out))))
    four_ranks = dataclasses.replace(trainer.plan, parallel_dims=ParallelDims(1, 4, world_size=4))

    def build(validation: Validation) -> Validator:
        job_config = dataclasses.replace(trainer.job_config, validation=validation)
        setup = (trainer.tokenizer, trainer.loss_fn, trainer.loss_context, trainer.compute_context, None)
        return build_run_validator(job_config, four_ranks, *setup, trainer.device)

    titanlite_logger = logging.getLogger("titanlite")  # the trainer's logging set-up dropped caplog's root handler
    titanlite_logger.addHandler(caplog.handler)
    try:
        build(held_out_section("prepared", held_out))
        assert not caplog.records
        build(held_out_section("raw", held_out))
    finally:
        titanlite_logger.removeHandler(caplog.handler)
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith("validation.dataset text is tokenized as it is read: every one of the 4 data-parallel")
    assert "set validation.dataset = 'prepared'" in warning

    corrupted = shutil.copytree(held_out[1], tmp_path / "corrupted")
    with open(corrupted / "tokens-00001.bin", "r+b") as shard:
        shard.write(b"\x07")
    with pytest.raises(ConfigError, match=rf"^validation\.dataset_path {corrupted}: tokens-00001\.bin does not match"):
        build(held_out_section("prepared", (None, str(corrupted))))


# --------------------------------------------------------------------------- 4 ranks


def validate_on_subgroups(held_out: tuple[str, str]) -> dict:
    """On 4 ranks: for dp 1 to 4, the first dp ranks form a group and validate on it, from the
    prepared folder and from the raw source, over the whole set and over 3 steps; the same
    weights everywhere (seed 0). Also how many texts the prepared validators encoded."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = small_model()
    results = {}
    with counting_encodes() as encodes:
        for dp_degree in DP_DEGREES:
            group = dist.new_group(list(range(dp_degree)))  # every rank takes part in making it
            if rank >= dp_degree:
                continue
            for kind, steps in itertools.product(("prepared", "raw"), (-1, 3)):
                before = encodes[0]
                validator = make_validator(kind, held_out, rank, dp_degree, steps=steps, process_group=group)
                result = validator.validate(model)
                results[(kind, dp_degree, steps)] = (result["loss"], result["tokens"])
                if kind == "prepared":
                    results["prepared encodes"] = results.get("prepared encodes", 0) + encodes[0] - before
    dist.destroy_process_group()
    return results


def test_losses_equal_the_raw_source_and_one_rank_on_4_ranks_in_groups_of_1_to_4(held_out):
    """Exact equality: see the module docstring."""
    one_process = make_validator("raw", held_out).validate(small_model())
    whole_set = (one_process["loss"], one_process["tokens"])
    assert whole_set[1] == len(hand_windows()) * SEQ_LEN
    ranks = run_on_ranks(4, validate_on_subgroups, held_out)
    for rank, results in enumerate(ranks):
        assert results.pop("prepared encodes") == 0, rank
        assert sorted(results) == sorted(
            (kind, dp, steps) for kind in ("prepared", "raw") for dp in DP_DEGREES if dp > rank for steps in (-1, 3)
        )
        for dp_degree in DP_DEGREES[rank:]:
            assert results[("prepared", dp_degree, -1)] == results[("raw", dp_degree, -1)] == whole_set
            # 3 steps: the first 3 * b * dp windows, the same from either source.
            first_windows = min(3 * LOCAL_BATCH * dp_degree, len(hand_windows()))
            assert results[("prepared", dp_degree, 3)] == results[("raw", dp_degree, 3)]
            assert results[("prepared", dp_degree, 3)][1] == first_windows * SEQ_LEN
