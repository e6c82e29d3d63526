"""Tests for the held-out loss (titanlite.validation) and the step profiler
(titanlite.profiling), on the tiny model and on 1-2 CPU ranks."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import tiny_args
from tests.rank_jobs import run_on_ranks
from titanlite import profiling as profiling_module
from titanlite.config import parse_args
from titanlite.config.metrics import Profiling
from titanlite.config.training import Validation
from titanlite.data import ByteTokenizer, build_documents
from titanlite.data.sources import python_stdlib_documents, stdlib_split_files
from titanlite.loss import cross_entropy_sum
from titanlite.profiling import Profiler, profiler_context
from titanlite.train import Trainer
from titanlite.trainer_setup import build_run_validator
from titanlite.validation import VALIDATION_SPLIT, Validator, build_validator, count_windows, open_held_out

SEQ_LEN = 32
TRAIN_ARGS = tiny_args(
    {
        "training.seq_len": SEQ_LEN,
        "training.local_batch_size": None,  # each test sets its own
        "optimizer.lr": 3e-3,
        "lr_scheduler.warmup_steps": 2,
        "metrics.log_freq": 10,
    }
)

# Held-out documents of uneven lengths, so windows straddle document boundaries. Their
# 9 whole windows split into global batches of 4 (2 ranks x 2) as 4 + 4 + 1: at the last
# step rank 0 has one held-out window and rank 1 none, yet both must run the forward.
# 315 tokens: 9 windows of 33 and 18 left over (a partial window, never evaluated).
HELD_OUT_DOCUMENTS = [f"doc {i}: " + "lorem ipsum dolor sit amet, " * (i % 4) for i in range(7)]
HELD_OUT_WINDOWS = 9


@pytest.fixture
def held_out_path(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in HELD_OUT_DOCUMENTS))
    return str(path)


def text_validation(path: str, **overrides) -> Validation:
    fields = dict(enable=True, dataset="text", dataset_path=path, local_batch_size=2, seq_len=-1, steps=-1)
    return Validation(**{**fields, **overrides})


def make_trainer(dump_folder: str, extra_args: list[str] = ()) -> Trainer:
    return Trainer(parse_args(TRAIN_ARGS + list(extra_args) + ["--job.dump_folder", dump_folder]))


def trainer_validator(trainer: Trainer, validation: Validation) -> Validator:
    """The validator the trainer builds for `validation` (turned on)."""
    job_config = dataclasses.replace(trainer.job_config, validation=dataclasses.replace(validation, enable=True))
    return build_run_validator(
        job_config,
        trainer.plan,
        trainer.tokenizer,
        trainer.loss_fn,
        trainer.loss_context,
        trainer.compute_context,
        trainer.mesh,
        trainer.device,
    )


def hand_loss(model: torch.nn.Module, documents: list[str], seq_len: int, windows: int | None = None) -> float:
    """Mean token loss over the first whole windows of the packed stream, built the obvious way."""
    tokenizer = ByteTokenizer()
    stream = []
    for document in documents:
        stream += [tokenizer.bos_id] + tokenizer.encode(document) + [tokenizer.eos_id]
    windows = windows if windows is not None else len(stream) // (seq_len + 1)
    batch = torch.tensor(stream[: windows * (seq_len + 1)]).view(windows, seq_len + 1)
    model.eval()
    with torch.no_grad():
        logits = model(batch[:, :-1])
    model.train()
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item()


# --------------------------------------------------------------------------- single process


def raw_held_out(validation: Validation):
    """The validator's window source for a raw held-out section (tokenized as it is read)."""
    return open_held_out(validation, ByteTokenizer(), SEQ_LEN, hf_assets_path=None, cache_folder="unused")


def test_held_out_fixture_has_the_intended_shape(held_out_path):
    documents = raw_held_out(text_validation(held_out_path)).documents
    assert count_windows(documents, ByteTokenizer(), SEQ_LEN) == HELD_OUT_WINDOWS
    assert count_windows(documents, ByteTokenizer(), SEQ_LEN, limit=4) == 4


def test_loss_of_untrained_model_matches_hand_computation(tmp_path, held_out_path):
    trainer = make_trainer(str(tmp_path), ["--training.local_batch_size", "2"])
    # 3 per batch: 9 windows take exactly 3 steps; 2 per batch: 5 steps, the last one half used.
    for local_batch_size, expected_steps in ((3, 3), (2, 5)):
        validator = trainer_validator(trainer, text_validation(held_out_path, local_batch_size=local_batch_size))
        result = validator.validate(trainer.model)
        assert result["steps"] == expected_steps
        assert result["tokens"] == HELD_OUT_WINDOWS * SEQ_LEN
        expected = hand_loss(trainer.model, HELD_OUT_DOCUMENTS, SEQ_LEN)
        assert result["loss"] == pytest.approx(expected, rel=1e-5)
        assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
        # Near ln(vocab) for a freshly initialised model, and the mode is put back.
        assert abs(result["loss"] - math.log(258)) < 1.0
        assert trainer.model.training

    # A fixed step count reads only the first windows, and every evaluation reads the same ones.
    validator = trainer_validator(trainer, text_validation(held_out_path, steps=2))
    first, second = validator.validate(trainer.model), validator.validate(trainer.model)
    assert first == second
    assert first["tokens"] == 4 * SEQ_LEN
    assert first["loss"] == pytest.approx(hand_loss(trainer.model, HELD_OUT_DOCUMENTS, SEQ_LEN, windows=4), rel=1e-5)


def test_more_steps_than_held_out_data_are_capped_at_one_pass(tmp_path, held_out_path, caplog):
    trainer = make_trainer(str(tmp_path), ["--training.local_batch_size", "2"])
    # The trainer's logging set-up (basicConfig(force=True)) dropped caplog's root handler.
    validation_logger = logging.getLogger("titanlite.validation")
    validation_logger.addHandler(caplog.handler)
    try:
        validator = trainer_validator(trainer, text_validation(held_out_path, steps=100))
    finally:
        validation_logger.removeHandler(caplog.handler)
    assert "evaluating them once" in caplog.text
    assert (validator.windows, validator.steps) == (HELD_OUT_WINDOWS, 5)
    assert validator.validate(trainer.model)["tokens"] == HELD_OUT_WINDOWS * SEQ_LEN


def test_validation_loss_decreases_while_training(tmp_path):
    trainer = make_trainer(str(tmp_path), ["--training.local_batch_size", "4", "--training.steps", "30"])
    validation = Validation(enable=True, dataset="python_stdlib", local_batch_size=4, steps=4)
    validator = trainer_validator(trainer, validation)
    losses = [validator.validate(trainer.model)["loss"]]
    for _ in range(3):
        for _ in range(10):
            trainer.train_step()
        losses.append(validator.validate(trainer.model)["loss"])
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 1.0, losses


def test_python_stdlib_validation_split_is_held_out():
    train_files, validation_files = stdlib_split_files("train"), stdlib_split_files("validation")
    assert train_files and validation_files
    assert not set(train_files) & set(validation_files)
    # The validator reads exactly that split.
    documents = build_documents("python_stdlib", None, split=VALIDATION_SPLIT)
    assert list(documents()) == list(python_stdlib_documents("validation"))


def test_configuration_errors_name_the_key(tmp_path, held_out_path):
    with pytest.raises(ValueError, match=r"^validation\.dataset 'text': dataset_path is required"):
        raw_held_out(Validation(enable=True, dataset="text"))
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"^validation\.dataset_path {missing}: no such file"):
        raw_held_out(Validation(enable=True, dataset="text", dataset_path=str(missing)))
    common = dict(
        tokenizer=ByteTokenizer(), training_seq_len=SEQ_LEN, training_local_batch_size=2, loss_fn=cross_entropy_sum
    )
    with pytest.raises(ValueError, match=r"^validation\.seq_len \(64\) must not exceed training\.seq_len \(32\)"):
        build_validator(text_validation(held_out_path, seq_len=64), **common)
    with pytest.raises(ValueError, match=r"^validation: the held-out documents hold less than one window"):
        build_validator(text_validation(held_out_path), **{**common, "training_seq_len": 4096})
    with pytest.raises(ValueError, match=r"^validation\.steps: expected -1 or a positive int, got 0"):
        build_validator(text_validation(held_out_path, steps=0), **common)


# --------------------------------------------------------------------------- two ranks (FSDP)


def validate_train_validate(dump_folder: str, held_out_path: str, local_batch_size: int) -> dict:
    """Held-out loss, then two training steps, then the held-out loss again."""
    trainer = make_trainer(dump_folder, ["--training.local_batch_size", str(local_batch_size)])
    validator = trainer_validator(trainer, text_validation(held_out_path))
    before = validator.validate(trainer.model)
    still_training = trainer.model.training
    for _ in range(2):
        trainer.train_step()
    after = validator.validate(trainer.model)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "before": before["loss"],
        "after": after["loss"],
        "steps": before["steps"],
        "tokens": before["tokens"],
        "still_training": still_training,
    }


def test_two_ranks_fsdp_match_one_process(tmp_path, held_out_path):
    # The same global batch of 4 sequences: 4 on one process, 2 on each of two FSDP ranks.
    single = validate_train_validate(str(tmp_path / "one"), held_out_path, 4)
    ranks = run_on_ranks(2, validate_train_validate, str(tmp_path / "two"), held_out_path, 2)
    for result in ranks:
        assert result["still_training"]
        assert result["steps"] == 3  # 9 windows over 2 ranks x 2: rank 1 has none at the last step
        assert result["tokens"] == single["tokens"] == HELD_OUT_WINDOWS * SEQ_LEN
        assert result["before"] == pytest.approx(single["before"], rel=1e-5)
        assert result["after"] == pytest.approx(single["after"], rel=1e-5)
    assert single["after"] < single["before"]


# --------------------------------------------------------------------------- profiler

STEP_MARKER = "titanlite_test_step"


def run_steps(profiler, steps: int) -> None:
    """A few small CPU steps, each named so that a trace can be checked for real content."""
    weight = torch.randn(64, 64)
    for _ in range(steps):
        with torch.profiler.record_function(STEP_MARKER):
            (weight @ weight).relu().sum()
        profiler.step()


def read_trace(path) -> dict:
    trace = json.loads(path.read_text())
    assert trace["traceEvents"], path
    return trace


def traced_steps(folder) -> list[int]:
    return sorted(int(p.name.removeprefix("iteration_")) for p in folder.iterdir())


def test_profiler_traces_the_last_step_of_every_window(tmp_path):
    config = Profiling(enable_profiling=True, profile_freq=3)
    with profiler_context(config, str(tmp_path), rank=1) as profiler:
        run_steps(profiler, 7)
    folder = tmp_path / "profile_traces"
    assert traced_steps(folder) == [3, 6]
    for step in (3, 6):
        trace = read_trace(folder / f"iteration_{step}" / "rank1_trace.json")
        names = [event.get("name") for event in trace["traceEvents"]]
        assert names.count(STEP_MARKER) == 1  # exactly the one step, not its warm-up step


def test_profiler_keeps_step_numbers_on_resume_and_window_of_one(tmp_path):
    resumed = tmp_path / "resumed"
    with Profiler(profile_freq=4, rank=0, traces_folder=str(resumed), start_step=5) as profiler:
        run_steps(profiler, 7)  # steps 6..12
    assert traced_steps(resumed) == [8, 12]

    # Every step traced; leaving the context must not overwrite the last trace with an empty one.
    every = tmp_path / "every"
    with Profiler(profile_freq=1, rank=0, traces_folder=str(every)) as profiler:
        run_steps(profiler, 2)
    assert traced_steps(every) == [1, 2]
    for step in (1, 2):
        trace = read_trace(every / f"iteration_{step}" / "rank0_trace.json")
        assert any(event.get("name") == STEP_MARKER for event in trace["traceEvents"])


def test_profiler_disabled_writes_nothing(tmp_path, monkeypatch, caplog):
    with profiler_context(Profiling(profile_freq=2), str(tmp_path), rank=0) as profiler:
        assert not profiler.enabled
        run_steps(profiler, 4)
    assert list(tmp_path.iterdir()) == []

    if torch.cuda.is_available():
        return  # the CPU-only warning path below does not apply
    monkeypatch.setattr(profiling_module, "_warned_no_cuda", False)
    config = Profiling(enable_memory_snapshot=True, profile_freq=2)
    with caplog.at_level(logging.WARNING, logger="titanlite.profiling"):
        for _ in range(2):  # warned once per process, not once per profiler
            with profiler_context(config, str(tmp_path), rank=0) as profiler:
                run_steps(profiler, 4)
    assert caplog.text.count("needs CUDA") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory snapshots need CUDA")
def test_memory_snapshots_on_cuda(tmp_path):
    config = Profiling(enable_memory_snapshot=True, profile_freq=2)
    with profiler_context(config, str(tmp_path), rank=0) as profiler:
        for _ in range(4):
            torch.randn(256, 256, device="cuda").sum()
            profiler.step()
    folder = tmp_path / "memory_snapshot"
    assert traced_steps(folder) == [2, 4]
    for step in (2, 4):
        assert (folder / f"iteration_{step}" / "rank0_memory_snapshot.pickle").stat().st_size > 0
