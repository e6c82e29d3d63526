"""Checkpoints, held-out loss, Hugging Face seeding and export, and start-up diagnostics of
pipeline-parallel runs.

Under pipeline parallelism the trainer's model is a LocalModel: the stages this rank runs,
each a model part sharded as a model of its own, under the whole model's names. Its
checkpoint is therefore the same model to DCP, and reshards to layouts without stages.

The runs are test_checkpoint_resume's (the tiny model, 8 steps, global batch 8, float32,
EMA with decay 0.9, built by its Session), here also computing the held-out loss (2 batches)
after steps 4 and 8. The reference is the uninterrupted single-process run. On 4 ranks the
layouts are PP 2 x FSDP 2 with 1F1B (2 stages, 2 micro-batches of 2 sequences) and with
Interleaved1F1B (4 stages, 2 per rank, 4 micro-batches of 1), and FSDP 4; ranks 0 and 1 hold
the first stage(s), 2 and 3 the last, and ranks 0 and 1 (like 2 and 3) read different parts
of each batch.

Two jobs of one launch of 4 processes:

* four_rank: the uninterrupted PP2 x FSDP2 run, saving asynchronously after steps 4 and 8;
  an FSDP-4 run saved after step 4; the PP2 x FSDP2 step-4 checkpoint resumed on FSDP 4 and
  the FSDP-4 one resumed on PP2 x FSDP2 with Interleaved1F1B; a PP2 x FSDP2 model seeded from
  a Hugging Face folder.
* single: the uninterrupted single-process run.

The PP run's step-8 checkpoint is then exported to Hugging Face by scripts/convert_dcp_to_hf.py.
"""

import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    TINY,
    capture_log_lines,
    free_ports,
    full_weights,
    hf_tensors,
    load_script,
    save_hf_llama,
    tiny_args,
)
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_checkpoint_resume import (
    SAVE_AT,
    STEPS,
    Session,
    assert_bit_identical,
    assert_close_tensors,
    copy_checkpoint,
    layout,
    loaded_state,
    max_difference,
    positions,
    record_after_each_step,
    train_to_end,
)
from tests.test_tp_checkpoint import LayoutLines, optimizer_moments, record_state_at, state_at
from tests.test_validation_profiling import (
    HELD_OUT_DOCUMENTS,
    HELD_OUT_WINDOWS,
    SEQ_LEN,
    hand_loss,
    text_validation,
    trainer_validator,
)
from titanlite.checkpoint.files import stored_keys
from titanlite.config import ConfigError, parse_args
from titanlite.metrics.flops import param_counts
from titanlite.models.llama import LlamaStateDictAdapter
from titanlite.plan import plan_run

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPORT = REPO_ROOT / "scripts" / "convert_dcp_to_hf.py"

VALIDATION = ["--validation.enable", "--validation.steps=2", f"--validation.freq={SAVE_AT}"]
PP = ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"]
LAYOUTS = {
    "single": layout(1),
    "fsdp4": layout(4),
    "pp2_fsdp2": [*PP, "--parallelism.pipeline_parallel_microbatch_size=2"],
    "pp2_interleaved": [
        *PP,
        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
        "--parallelism.pipeline_parallel_microbatch_size=1",
    ],
}
# Under PP 2 x FSDP 2 ranks 0 and 1 read the batches' two parts (2 and 3 read the same ones).
PP_READERS = (0, 1)
FIRST_STAGE_RANK, LAST_STAGE_RANK = 0, 2
# (checkpoint written by, resumed on): the step-4 checkpoints.
RESUMES = [("pp2_fsdp2", "fsdp4"), ("fsdp4", "pp2_interleaved")]


def record_held_out(trainer) -> dict:
    """step -> the held-out loss the trainer's validator computed after that step."""
    losses = {}
    validate = trainer.validator.validate

    def recording_validate(model):
        result = validate(model)
        losses[trainer.step] = result["loss"]
        return result

    trainer.validator.validate = recording_validate
    return losses


def resume(session: Session, source_dump: str, target: str, dump: str) -> dict:
    """Resume a copy of the step-4 checkpoint in `source_dump` on the layout `target`: what
    it loaded, its steps and held-out losses, and rank 0's line about the layouts."""
    name = f"{Path(source_dump).name}_to_{target}"
    folder = copy_checkpoint(f"{source_dump}/checkpoint/step-{SAVE_AT}", f"{dump}/{name}")
    handler = LayoutLines()
    logging.getLogger("titanlite").addHandler(handler)
    try:
        trainer = session.trainer(LAYOUTS[target], VALIDATION, f"--job.dump_folder={folder}")
    finally:
        logging.getLogger("titanlite").removeHandler(handler)
    loaded = loaded_state(trainer) | {"moments": optimizer_moments(trainer)}
    held_out = record_held_out(trainer)
    return train_to_end(trainer) | {"loaded": loaded, "layout_lines": handler.lines, "held_out": held_out}


def uninterrupted(session: Session, *args, short_held_out: str) -> dict:
    """The run's steps, the state after each, its held-out losses and the start-up log (on
    the ranks LOG_RANK names); at the end, the held-out loss over the short text set
    `short_held_out`, whose last batch is partly past its end."""
    log = capture_log_lines()
    trainer = session.trainer(*args)
    initial_ema = full_weights(trainer.ema)
    after, held_out = record_after_each_step(trainer), record_held_out(trainer)
    at_save = record_state_at(trainer, SAVE_AT)
    run = train_to_end(trainer)
    logging.getLogger("titanlite").removeHandler(log)
    short = trainer_validator(trainer, text_validation(short_held_out, local_batch_size=-1)).validate(trainer.model)
    if trainer.pipeline is None:
        short["by_hand"] = hand_loss(trainer.model, HELD_OUT_DOCUMENTS, SEQ_LEN)
    return run | {
        "after": after,
        "held_out": held_out,
        "short_held_out": short,
        "initial_ema": initial_ema,
        "saved": at_save,
        "log": log.lines,
    }


def four_rank_worker(dump: str, ports: list[int], hf_folder: str | None, short_held_out: str) -> dict:
    os.environ["LOG_RANK"] = f"{FIRST_STAGE_RANK},{LAST_STAGE_RANK}"  # the start-up lines of both stages
    session, out = Session(ports), {}
    out["pp2_fsdp2"] = uninterrupted(
        session,
        LAYOUTS["pp2_fsdp2"],
        VALIDATION,
        "--checkpoint.async_mode=async",
        f"--checkpoint.interval={SAVE_AT}",
        f"--job.dump_folder={dump}/pp2_fsdp2",
        short_held_out=short_held_out,
    )

    trainer = session.trainer(LAYOUTS["fsdp4"], VALIDATION, f"--job.dump_folder={dump}/fsdp4")
    for _ in range(SAVE_AT):
        trainer.train_step()
    out["fsdp4"] = {"saved": state_at(trainer)}
    trainer.checkpointer.save(trainer.step)
    trainer.checkpointer.close()

    for source, target in RESUMES:
        out[f"{source}_to_{target}"] = resume(session, f"{dump}/{source}", target, dump)

    if hf_folder is not None:
        trainer = session.trainer(
            LAYOUTS["pp2_fsdp2"],
            "--checkpoint.initial_load_in_hf",
            f"--checkpoint.initial_load_path={hf_folder}",
            f"--job.dump_folder={dump}/seeded",
        )
        out["seeded"] = {"weights": full_weights(trainer.model), "ema": full_weights(trainer.ema)}
        trainer.checkpointer.close()
    session.end()
    return out


def single_worker(dump: str, short_held_out: str) -> dict:
    session = Session([0] * 2)  # no process group on one rank: the ports go unused
    args = (LAYOUTS["single"], VALIDATION, f"--job.dump_folder={dump}/straight")
    return {"straight": uninterrupted(session, *args, short_held_out=short_held_out)}


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """Both jobs in one launch of 4 processes."""
    # The Hugging Face folder to seed from needs transformers (a test extra); without it only
    # the seeding test skips.
    hf_folder = None
    if importlib.util.find_spec("transformers") is not None:
        hf_folder = str(save_hf_llama(tmp_path_factory.mktemp("pp_hf") / "llama", seed=1))
    four, one = tmp_path_factory.mktemp("pp_four_rank"), tmp_path_factory.mktemp("pp_single")
    short_held_out = tmp_path_factory.mktemp("pp_held_out") / "held_out.jsonl"
    short_held_out.write_text("".join(json.dumps({"text": text}) + "\n" for text in HELD_OUT_DOCUMENTS))
    jobs = {
        "four_rank": Job(4, four_rank_worker, (str(four), free_ports(6), hf_folder, str(short_held_out))),
        "single": Job(1, single_worker, (str(one), str(short_held_out))),
    }
    results = run_jobs_on_ranks(4, jobs)
    return {"four_rank": (four, results["four_rank"]), "single": (one, results["single"]), "hf_folder": hf_folder}


@pytest.fixture(scope="module")
def four_rank(launch):
    return launch["four_rank"]


@pytest.fixture(scope="module")
def reference(launch) -> dict:
    """The uninterrupted single-process run."""
    return launch["single"][1][0]["straight"]


def whole(ranks: list[dict], key: str) -> dict:
    """The whole model's tensors of `key` from the ranks of one pipeline: each stage's rank
    holds only its own modules' (under the whole model's names), no name twice."""
    first, last = ranks[FIRST_STAGE_RANK][key], ranks[LAST_STAGE_RANK][key]
    assert first and last and not first.keys() & last.keys(), "the stages share no weight"
    return first | last


# --- checks ------------------------------------------------------------------------------


def test_uninterrupted_pp_run_matches_the_single_process_run(four_rank, reference):
    """The premise of the comparisons below, with EMA and the held-out loss."""
    ranks = [rank["pp2_fsdp2"] for rank in four_rank[1]]
    run = ranks[0]
    assert run["steps"] == reference["steps"] == list(range(1, STEPS + 1))
    assert reference["loss"][-1] < reference["loss"][0] - 0.1
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(run[key]), torch.tensor(reference[key]), rtol=1e-5, atol=0)
    assert_close_tensors(whole(ranks, "initial_ema"), reference["initial_ema"], atol=0)
    for step in range(STEPS):
        after = [rank["after"][step] for rank in ranks]
        assert positions(after[0]) == positions(reference["after"][step]), step
        assert_close_tensors(whole(after, "weights"), reference["after"][step]["weights"], atol=1e-5)
        assert_close_tensors(whole(after, "ema"), reference["after"][step]["ema"], atol=1e-5)
    last = reference["after"][-1]
    assert max_difference(last["ema"], last["weights"]) > 1e-3  # the EMA is not the weights


def test_held_out_loss_under_pp_matches_the_single_process(four_rank, reference):
    assert sorted(reference["held_out"]) == [SAVE_AT, STEPS]
    assert reference["held_out"][SAVE_AT] > reference["held_out"][STEPS] + 0.05  # it moved
    runs = [four_rank[1][rank]["pp2_fsdp2"] for rank in range(4)]
    resumed = four_rank[1][0]["fsdp4_to_pp2_interleaved"]["held_out"]
    for step, loss in reference["held_out"].items():
        for run in runs:  # every rank logs the same global loss
            assert run["held_out"][step] == pytest.approx(loss, rel=1e-5, abs=0)
    assert resumed[STEPS] == pytest.approx(reference["held_out"][STEPS], rel=1e-5, abs=0)


def test_held_out_loss_under_pp_leaves_out_the_rows_past_the_set(four_rank, reference):
    """9 held-out windows in batches of 8 (4 per data-parallel rank): the second batch holds
    one window of the set; the pipeline still runs whole batches (its shapes are fixed), and
    the other rows must not count."""
    expected = reference["short_held_out"]
    assert expected["tokens"] == HELD_OUT_WINDOWS * SEQ_LEN and expected["steps"] == 2
    assert expected["loss"] == pytest.approx(expected["by_hand"], rel=1e-5)
    for rank in four_rank[1]:
        ours = rank["pp2_fsdp2"]["short_held_out"]
        assert (ours["tokens"], ours["steps"]) == (expected["tokens"], expected["steps"])
        assert ours["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=0)


def test_validation_batches_of_another_shape_are_a_config_error_under_pp(tmp_path):
    base = tiny_args({"training.local_batch_size": 4, "validation.enable": True}) + LAYOUTS["pp2_fsdp2"]
    for key, value in (("local_batch_size", 2), ("seq_len", 16)):
        job_config = parse_args([*base, f"--validation.{key}={value}", f"--job.dump_folder={tmp_path}"])
        with pytest.raises(ConfigError) as error:
            plan_run(job_config, world_size=4)
        assert str(error.value).startswith(f"validation.{key} ({value}) must be -1 or training.{key} (")
    plan_run(parse_args([*base, "--validation.local_batch_size=4", "--validation.seq_len=32"]), world_size=4)


def layout_text(name: str) -> str:
    """The layout as log_resumed_layout names it when a pipeline-parallel layout is involved."""
    return {
        "pp2_fsdp2": "4 rank(s) (pp 2 x replicate 1 x shard 2 x tp 1)",
        "pp2_interleaved": "4 rank(s) (pp 2 x replicate 1 x shard 2 x tp 1)",
        "fsdp4": "4 rank(s) (pp 1 x replicate 1 x shard 4 x tp 1)",
    }[name]


def readers(target: str) -> tuple[int, ...]:
    return PP_READERS if target.startswith("pp") else (0, 1, 2, 3)


@pytest.mark.parametrize(("source", "target"), RESUMES, ids=[f"{s}_to_{t}" for s, t in RESUMES])
def test_resume_across_pipeline_layouts(four_rank, reference, source, target):
    key, ranks = f"{source}_to_{target}", four_rank[1]
    saved_by = [rank[source]["saved"] for rank in ranks]
    saved = whole(saved_by, "weights") if source.startswith("pp") else saved_by[0]["weights"]
    saved_ema = whole(saved_by, "ema") if source.startswith("pp") else saved_by[0]["ema"]
    saved_moments = whole(saved_by, "moments") if source.startswith("pp") else saved_by[0]["moments"]
    resumed = [rank[key] for rank in ranks]
    loaded = [rank["loaded"] for rank in resumed]
    pick = whole if target.startswith("pp") else lambda by_rank, name: by_rank[0][name]
    for rank in loaded:
        assert positions(rank) == positions(saved_by[0]) == positions(reference["after"][SAVE_AT - 1])
        assert rank["adam_steps"] == [SAVE_AT]
        assert rank["scheduler_lr"] == rank["param_group_lr"] == saved_by[0]["lr"] == reference["lr"][SAVE_AT]
    # Resharding moves the saved numbers, it does not recompute them.
    assert_bit_identical(pick(loaded, "weights"), saved)
    assert_bit_identical(pick(loaded, "ema"), saved_ema)
    moments = pick(loaded, "moments")
    assert moments.keys() == saved_moments.keys() == reference["weights"].keys()
    for name, value in saved_moments.items():
        assert_bit_identical(moments[name], value)

    first = resumed[0]
    assert first["layout_lines"] == [
        f"resuming at step {SAVE_AT} on {layout_text(target)} from a checkpoint written by "
        f"{layout_text(source)}: model, optimizer and data position are resharded"
    ]
    for rank in resumed:
        assert rank["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        assert rank["end"] == reference["end"]
        for metric in ("loss", "grad_norm"):
            torch.testing.assert_close(
                torch.tensor(rank[metric]), torch.tensor(reference[metric][SAVE_AT:]), rtol=1e-5, atol=0
            )
    # The same token ids: each step's global batch is the rows every data-parallel rank read.
    for step in range(SAVE_AT + 1, STEPS + 1):
        global_batch = sorted(row for reader in readers(target) for row in resumed[reader]["batches"][step])
        assert global_batch == sorted(reference["batches"][step]), f"step {step}"
    if target.startswith("pp"):  # the other stage's ranks read the same rows
        for reader in readers(target):
            assert resumed[reader]["batches"] == resumed[reader + LAST_STAGE_RANK]["batches"]
    assert_close_tensors(pick(resumed, "weights"), reference["weights"], atol=1e-5)
    assert_close_tensors(pick(resumed, "ema"), reference["ema"], atol=1e-5)


def test_the_pp_checkpoint_holds_the_whole_model(four_rank, launch):
    """Every weight of the model, under its own name, once: the stages' parts add up to the
    single process's checkpoint, entry for entry."""
    step_dir = four_rank[0] / "pp2_fsdp2" / "checkpoint" / f"step-{STEPS}"
    single_dir = launch["single"][0] / "straight" / "checkpoint" / f"step-{STEPS}"
    assert set(stored_keys(step_dir)) == set(stored_keys(single_dir))
    weights = launch["single"][1][0]["straight"]["weights"]  # stored under their own names, as torchtitan's
    assert set(weights) | {f"ema.{name}" for name in weights} <= set(stored_keys(step_dir))


# --- start-up diagnostics ------------------------------------------------------------------


def test_start_up_names_each_stage_and_its_parameters(four_rank):
    counts = param_counts(TINY)
    stages = {  # the stage's rank: (the stage, its modules, its parameters, its FSDP units)
        FIRST_STAGE_RANK: (0, "tok_embeddings, layers.0", counts.embedding + counts.blocks[0], 2),
        LAST_STAGE_RANK: (1, "layers.1, layers.2, norm, output", counts.total - counts.embedding - counts.blocks[0], 3),
    }
    for rank, (stage, modules, params, units) in stages.items():
        lines = four_rank[1][rank]["pp2_fsdp2"]["log"]
        held = [line for line in lines if "pipeline stage" in line]
        assert len(held) == 1 and held[0].startswith(
            f"rank {rank}: pipeline stage {stage} of 2 holds {modules} ({params / 1e6:.2f} M params, local "
        ), held
        summary = [line for line in lines if "M params" in line and "global batch" in line]
        assert len(summary) == 1
        assert (
            f"({counts.total / 1e6:.2f} M params, {params / 1e6:.2f} M of them in this rank's stages [{stage}])"
            in (summary[0])
        )
        assert "4 rank(s) (pp 2 x replicate 1 x shard 2 x tp 1)" in summary[0]
        # One FSDP unit per block plus the stage's root: no sharding warning.
        assert any(line.startswith(f"FSDP units: {units} (<root>, layers.") for line in lines), lines
        assert not [line for line in lines if "SHARDING PROBLEM" in line]
        assert "the model computes in float32, as configured" in lines
        memory = [line for line in lines if "peak memory" in line]
        assert len(memory) == 3 and all(": after forward+backward " in line for line in memory), memory
        assert all("after optimizer" in line and "after forward " not in line for line in memory)


# --- Hugging Face seeding and export -------------------------------------------------------


def test_hf_seeding_fills_every_stage(four_rank, launch):
    pytest.importorskip("transformers")  # the folder to seed from is written by it
    expected = LlamaStateDictAdapter(TINY).from_hf(hf_tensors(Path(launch["hf_folder"])))
    ranks = [rank["seeded"] for rank in four_rank[1]]
    seeded = whole(ranks, "weights")
    assert_bit_identical({name: seeded[name] for name in expected}, expected)
    # The weight average starts at the seeded weights, not the random ones.
    assert_bit_identical({name: whole(ranks, "ema")[name] for name in expected}, expected)


@pytest.mark.parametrize("use_ema", [False, True], ids=["weights", "ema"])
def test_export_of_a_pp_checkpoint_is_the_single_process_models(four_rank, launch, reference, tmp_path, use_ema):
    step_dir = four_rank[0] / "pp2_fsdp2" / "checkpoint" / f"step-{STEPS}"
    args = [str(step_dir), str(tmp_path / "hf")] + (["--ema"] if use_ema else [])
    assert load_script(EXPORT).main(args) == 0
    exported = LlamaStateDictAdapter(TINY).from_hf(hf_tensors(tmp_path / "hf"))
    # Bit for bit what the PP run trained, and within 1e-5 the single process's.
    trained = whole([rank["pp2_fsdp2"] for rank in four_rank[1]], "ema" if use_ema else "weights")
    assert_bit_identical(exported, {name: trained[name] for name in exported})
    single = reference["ema" if use_ema else "weights"]
    assert_close_tensors(exported, {name: single[name] for name in exported}, atol=1e-5)
