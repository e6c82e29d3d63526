"""Checkpoints of tensor-parallel runs: resumed on other layouts, averaged, exported.

The runs are test_checkpoint_resume's (the tiny model, 8 steps, global batch 8, float32,
EMA with decay 0.9, built by its Session) on the layout TP 2 x FSDP 2 over 4 ranks, where
every weight is a DTensor on the 2-D (dp_shard, tp) mesh: column-wise weights are split by
rows over tp and then by FSDP's strided shard over dp_shard, row-wise ones by columns over
tp and rows over dp_shard, norms only over dp_shard. The reference is the uninterrupted
single-process run; TP's parity tests show that every layout matches it within 1e-5.

Two jobs of one launch of 4 processes (tests.rank_jobs.run_jobs_on_ranks), each running
one Trainer after another:

* four_rank: the uninterrupted TP2 x FSDP2 run, saving after steps 4 and 8; an FSDP-4 run
  and a CP 2 x FSDP 2 run saved after step 4; the TP2 x FSDP2 step-4 checkpoint resumed on
  FSDP 4 and on TP 2 x DDP 2 (a 3-D mesh), the FSDP-4 one resumed on TP2 x FSDP2, and the
  CP 2 x FSDP 2 one on FSDP 4 (reading the same token ids).
* single: the uninterrupted single-process run; the TP2 x FSDP2 step-4 checkpoint resumed
  on one process, without TP.

The TP2 x FSDP2 run's step-8 checkpoint is then exported to Hugging Face and loaded with
load_model, in this process. Last, a checkpoint from before TP (no train_state.tp) resumes.
"""

import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import TINY, free_ports, full_tensor, full_weights, tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_checkpoint_resume import (
    GLOBAL_BATCH,
    SAVE_AT,
    STEPS,
    Session,
    assert_bit_identical,
    assert_close_tensors,
    copy_checkpoint,
    layout,
    loaded_state,
    max_difference,
    position,
    positions,
    record_after_each_step,
    train_to_end,
    uninterrupted,
)
from titanlite.checkpoint import CheckpointError
from titanlite.checkpoint.files import stored_keys
from titanlite.checkpoint.hf_export import export_to_hf
from titanlite.checkpoint.load import load_model
from titanlite.config import parse_args
from titanlite.train import Trainer

# Layouts by name: their arguments and (replicate, shard, tp) degrees. The global batch stays
# 8 sequences, read in parts by the data-parallel ranks; on 4 ranks with TP, ranks 0 and 1
# form one TP group and 2 and 3 the other, and the two groups read different parts.
LAYOUTS = {
    "single": (layout(1), (1, 1, 1)),
    "fsdp4": (layout(4), (1, 4, 1)),
    "tp2_fsdp2": (
        ["--parallelism.tensor_parallel_degree=2", f"--training.local_batch_size={GLOBAL_BATCH // 2}"],
        (1, 2, 2),
    ),
    "tp2_ddp2": (
        [
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            f"--training.local_batch_size={GLOBAL_BATCH // 2}",
        ],
        (2, 1, 2),
    ),
    # Context parallelism: ranks 0 and 1 split the sequences ranks 2 and 3 also split; FSDP
    # shards over all 4 (dp_shard x cp).
    "cp2_fsdp2": (
        ["--parallelism.context_parallel_degree=2", f"--training.local_batch_size={GLOBAL_BATCH // 2}"],
        (1, 2, 1),
    ),
}
TP_GROUP_LEADERS = (0, 2)
# (checkpoint written by, resumed on): the step-4 checkpoints of the runs on 4 ranks.
RESUMES = [
    ("tp2_fsdp2", "fsdp4"),
    ("fsdp4", "tp2_fsdp2"),
    ("tp2_fsdp2", "tp2_ddp2"),
    ("tp2_fsdp2", "single"),
    ("cp2_fsdp2", "fsdp4"),
]


def optimizer_moments(trainer) -> dict:
    """Adam's whole moments and step count, by parameter name."""
    names = {param: name for name, param in trainer.model.named_parameters()}
    return {
        names[param]: {key: full_tensor(value) for key, value in state.items()}
        for param, state in trainer.optimizer.state.items()
    }


def state_at(trainer) -> dict:
    """What a checkpoint of `trainer` now holds, whole."""
    return position(trainer) | {
        "moments": optimizer_moments(trainer),
        "lr": trainer.lr_scheduler.get_last_lr()[0],
        "weights": full_weights(trainer.model),
        "ema": full_weights(trainer.ema),
    }


class LayoutLines(logging.Handler):
    """Keeps what the trainer logs about resuming a checkpoint another layout wrote."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        if "resharded" in record.getMessage():
            self.lines.append(record.getMessage())


def resume(session: Session, *args) -> dict:
    """test_checkpoint_resume's resume(), keeping Adam's moments as loaded and the log's
    line about the layouts (logged on rank 0)."""
    handler = LayoutLines()
    logging.getLogger("titanlite").addHandler(handler)
    try:
        trainer = session.trainer(*args)
    finally:
        logging.getLogger("titanlite").removeHandler(handler)
    loaded = loaded_state(trainer) | {"moments": optimizer_moments(trainer)}
    return train_to_end(trainer) | {"loaded": loaded, "layout_lines": handler.lines}


def record_state_at(trainer, step: int) -> dict:
    """Fills in state_at(trainer) just after train_step `step`, when a checkpoint is saved."""
    recorded = {}
    train_step = trainer.train_step

    def recording_train_step():
        result = train_step()
        if trainer.step == step:
            recorded.update(state_at(trainer))
        return result

    trainer.train_step = recording_train_step
    return recorded


def four_rank_worker(dump: str, ports: list[int]) -> dict:
    session, out = Session(ports), {}
    tp2_fsdp2 = LAYOUTS["tp2_fsdp2"][0]
    trainer = session.trainer(tp2_fsdp2, f"--checkpoint.interval={SAVE_AT}", f"--job.dump_folder={dump}/tp2_fsdp2")
    initial_ema = full_weights(trainer.ema)
    after, at_save = record_after_each_step(trainer), record_state_at(trainer, SAVE_AT)
    out["tp2_fsdp2"] = train_to_end(trainer) | {"after": after, "initial_ema": initial_ema}
    out["saved_by_tp2_fsdp2"] = at_save

    for source in ("fsdp4", "cp2_fsdp2"):
        trainer = session.trainer(LAYOUTS[source][0], f"--job.dump_folder={dump}/{source}")
        for _ in range(SAVE_AT):
            trainer.train_step()
        out[f"saved_by_{source}"] = state_at(trainer)
        trainer.checkpointer.save(trainer.step)
        trainer.checkpointer.close()

    for source, target in RESUMES:
        if target != "single":
            out[f"{source}_to_{target}"] = resume_copy(session, f"{dump}/{source}", target, dump)
    session.end()
    return out


def single_worker(dump: str, tp_run_folder: str) -> dict:
    session = Session([0] * 2)  # no process group on one rank: the ports go unused
    return {
        "straight": uninterrupted(session, LAYOUTS["single"][0], f"--job.dump_folder={dump}/straight"),
        "tp2_fsdp2_to_single": resume_copy(session, tp_run_folder, "single", dump),
    }


def resume_copy(session: Session, source_dump: str, target: str, dump: str) -> dict:
    """Resume a copy of the step-4 checkpoint in `source_dump` on the layout `target`."""
    name = f"{Path(source_dump).name}_to_{target}"
    folder = copy_checkpoint(f"{source_dump}/checkpoint/step-{SAVE_AT}", f"{dump}/{name}")
    return resume(session, LAYOUTS[target][0], f"--job.dump_folder={folder}")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """Both sets of runs as jobs of one launch of 4 processes, the single process's after
    the 4 ranks' (it resumes their checkpoint)."""
    four, one = tmp_path_factory.mktemp("tp_four_rank"), tmp_path_factory.mktemp("tp_single")
    jobs = {
        "four_rank": Job(4, four_rank_worker, (str(four), free_ports(7))),
        "single": Job(1, single_worker, (str(one), str(four / "tp2_fsdp2"))),
    }
    results = run_jobs_on_ranks(4, jobs)
    return {"four_rank": (four, results["four_rank"]), "single": (one, results["single"])}


@pytest.fixture(scope="module")
def four_rank(launch):
    return launch["four_rank"]


@pytest.fixture(scope="module")
def single(launch):
    return launch["single"]


# --- checks ------------------------------------------------------------------------------


def test_tp_ranks_of_a_group_train_on_the_same_batches(four_rank):
    ranks = four_rank[1]
    for name in ("tp2_fsdp2", "fsdp4_to_tp2_fsdp2", "tp2_fsdp2_to_tp2_ddp2"):
        for leader in TP_GROUP_LEADERS:
            assert ranks[leader][name]["batches"] == ranks[leader + 1][name]["batches"], name
        assert ranks[0][name]["batches"] != ranks[2][name]["batches"], name


def test_uninterrupted_tp_run_matches_the_single_process_run(four_rank, single):
    """The premise of every comparison below, with EMA: the TP run trains like one process."""
    run, reference = four_rank[1][0]["tp2_fsdp2"], single[1][0]["straight"]
    assert run["steps"] == reference["steps"] == list(range(1, STEPS + 1))
    assert reference["loss"][-1] < reference["loss"][0] - 0.1
    torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(reference["loss"]), rtol=1e-5, atol=0)
    assert_close_tensors(run["initial_ema"], reference["initial_ema"], atol=0)
    for step, (ours, theirs) in enumerate(zip(run["after"], reference["after"], strict=True), start=1):
        assert positions(ours) == positions(theirs), step
        assert_close_tensors(ours["weights"], theirs["weights"], atol=1e-5)
        assert_close_tensors(ours["ema"], theirs["ema"], atol=1e-5)
    last = reference["after"][-1]
    assert max_difference(last["ema"], last["weights"]) > 1e-3  # the EMA is not the weights


def layout_text(name: str) -> str:
    """The layout as log_resumed_layout names it (4 ranks under CP: cp = 4 / the others)."""
    replicate, shard, tp = LAYOUTS[name][1]
    cp = 4 // (replicate * shard * tp) if name.startswith("cp") else 1
    context = f"cp {cp} x " if cp > 1 else ""
    return f"{replicate * shard * cp * tp} rank(s) (replicate {replicate} x shard {shard} x {context}tp {tp})"


@pytest.mark.parametrize(("source", "target"), RESUMES, ids=[f"{s}_to_{t}" for s, t in RESUMES])
def test_resume_across_tensor_parallel_layouts(four_rank, single, source, target):
    key = f"{source}_to_{target}"
    saved = four_rank[1][0][f"saved_by_{source}"]
    reference = single[1][0]["straight"]
    ranks = (single if target == "single" else four_rank)[1]
    for rank in ranks:
        resumed = rank[key]
        loaded = resumed["loaded"]
        assert positions(loaded) == positions(saved) == positions(reference["after"][SAVE_AT - 1])
        # Resharding moves the saved numbers, it does not recompute them: weights, EMA,
        # Adam's moments and step, the schedule.
        assert_bit_identical(loaded["weights"], saved["weights"])
        assert_bit_identical(loaded["ema"], saved["ema"])
        assert loaded["moments"].keys() == saved["moments"].keys()
        for name, moments in saved["moments"].items():
            assert_bit_identical(loaded["moments"][name], moments)
        assert loaded["adam_steps"] == [SAVE_AT]
        assert loaded["scheduler_lr"] == loaded["param_group_lr"] == saved["lr"] == reference["lr"][SAVE_AT]
        assert resumed["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert resumed["end"] == reference["end"]
    first = ranks[0][key]
    # Rank 0 says that the checkpoint was resharded, naming both layouts.
    assert first["layout_lines"] == [
        f"resuming at step {SAVE_AT} on {layout_text(target)} from a checkpoint written by "
        f"{layout_text(source)}: model, optimizer and data position are resharded"
    ]
    torch.testing.assert_close(
        torch.tensor(first["loss"]), torch.tensor(reference["loss"][SAVE_AT:]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(first["grad_norm"]), torch.tensor(reference["grad_norm"][SAVE_AT:]), rtol=1e-5, atol=0
    )
    # The same token ids: each step's global batch is the rows every data-parallel rank read
    # (one rank per TP group), as a multiset.
    readers = [ranks[i] for i in TP_GROUP_LEADERS] if LAYOUTS[target][1][2] > 1 else ranks
    for step in range(SAVE_AT + 1, STEPS + 1):
        global_batch = sorted(row for rank in readers for row in rank[key]["batches"][step])
        assert global_batch == sorted(reference["batches"][step]), f"step {step}"
    assert_close_tensors(first["weights"], reference["weights"], atol=1e-5)
    assert_close_tensors(first["ema"], reference["ema"], atol=1e-5)


# --- export and load_model ----------------------------------------------------------------


def last_checkpoint(fixture, run: str) -> Path:
    return fixture[0] / run / "checkpoint" / f"step-{STEPS}"


def test_the_tp_checkpoint_holds_2d_shards(four_rank):
    """What the export and load_model below assemble: the vocabulary rows of the embedding
    are split over tp (129 each) and those unevenly over dp_shard (65 + 64)."""
    metadata = FileSystemReader(str(last_checkpoint(four_rank, "tp2_fsdp2"))).read_metadata()
    entry = metadata.state_dict_metadata["tok_embeddings.weight"]
    rows = sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in entry.chunks)
    assert rows == [(0, 65), (65, 64), (129, 65), (194, 64)]
    assert all(chunk.sizes[1] == TINY.dim for chunk in entry.chunks)


@pytest.mark.parametrize("use_ema", [False, True], ids=["weights", "ema"])
def test_hf_export_and_load_model_of_a_tp_checkpoint(four_rank, single, tmp_path, use_ema):
    transformers = pytest.importorskip("transformers")
    step_dir = last_checkpoint(four_rank, "tp2_fsdp2")
    trained = four_rank[1][0]["tp2_fsdp2"]["ema" if use_ema else "weights"]
    # load_model assembles the whole tensors the TP run held in pieces, bit for bit ...
    model, _ = load_model(step_dir, use_ema=use_ema)
    assert_bit_identical(full_weights(model), trained)
    # ... and they are the single-process run's within 1e-5.
    reference, _ = load_model(last_checkpoint(single, "straight"), use_ema=use_ema)
    assert_close_tensors(full_weights(model), full_weights(reference), atol=1e-5)

    out = export_to_hf(step_dir, tmp_path / "hf", use_ema=use_ema)
    hf_model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs, ours, single_process = hf_model.eval()(tokens).logits, model(tokens), reference(tokens)
    assert ours.abs().max().item() > 1e-2  # not trivially zero
    assert (theirs - ours).abs().max().item() <= 1e-5
    assert (theirs - single_process).abs().max().item() <= 1e-5


# --- a checkpoint from before tensor parallelism ------------------------------------------


def test_a_checkpoint_without_the_later_records_still_resumes(tmp_path, monkeypatch, quiet_process_state):
    """Checkpoints written before TP (PP) existed have no train_state.tp (train_state.pp), and
    older ones no train_state.global_batch_size; they must resume (as written by a layout
    without TP and PP, with no global batch to compare), while a missing entry a resume needs
    is still an error."""
    args = tiny_args({"training.steps": 2, "checkpoint.enable": True, "job.dump_folder": str(tmp_path)})
    written_by = Trainer.state_dict

    def without(*keys):
        return lambda self: {key: value for key, value in written_by(self).items() if key not in keys}

    monkeypatch.setattr(Trainer, "state_dict", without("tp", "pp", "global_batch_size"))
    Trainer(parse_args(args)).train()
    stored = set(stored_keys(tmp_path / "checkpoint" / "step-2"))
    assert {"train_state.step", "train_state.world_size"} <= stored
    assert not {"train_state.tp", "train_state.pp", "train_state.global_batch_size"} & stored
    monkeypatch.setattr(Trainer, "state_dict", written_by)
    resumed = Trainer(parse_args(args))
    assert (resumed.step, resumed.tokens_seen) == (2, 2 * 2 * 32)
    resumed.checkpointer.close()

    other = tmp_path / "other"
    monkeypatch.setattr(Trainer, "state_dict", without("tp", "tokens_seen"))
    Trainer(parse_args(args + [f"--job.dump_folder={other}"])).train()
    monkeypatch.setattr(Trainer, "state_dict", written_by)
    with pytest.raises(CheckpointError, match="train_state.tokens_seen"):
        Trainer(parse_args(args + [f"--job.dump_folder={other}"]))
