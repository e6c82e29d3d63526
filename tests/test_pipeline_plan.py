"""The pipeline plan, without any process group: how the layers split into stages (by counts
or by hand), which stages each pp rank runs, and every layout that cannot run refused as a
config error before a rank starts. The runs themselves are in test_pipeline_parity.py."""

import dataclasses
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

from tests.helpers import TINY, tiny_args
from titanlite.config import ConfigError, parse_args
from titanlite.config.parallelism import PIPELINE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from titanlite.models.llama.model import Transformer
from titanlite.parallel import ParallelDims
from titanlite.parallel.pipeline import microbatch_warning, plan_pipeline
from titanlite.plan import plan_run
from titanlite.train import main

# The keys, as the overrides below name them.
SCHEDULE = "parallelism.pipeline_parallel_schedule"
MICROBATCH = "parallelism.pipeline_parallel_microbatch_size"
PER_STAGE = "parallelism.pipeline_parallel_layers_per_stage"
FIRST_LESS = "parallelism.pipeline_parallel_first_stage_less_layers"
LAST_LESS = "parallelism.pipeline_parallel_last_stage_less_layers"
BY_HAND = "parallelism.module_fqns_per_model_part"
PP = "parallelism.pipeline_parallel_degree"

EIGHT_LAYERS = dataclasses.replace(TINY, n_layers=8)


def pipeline_config(overrides: dict | None = None):
    """The tiny run's config with PP 2 and `overrides` (dotted keys), as the command line gives it."""
    return parse_args(tiny_args({PP: 2, **(overrides or {})}))


def plan_of(overrides: dict | None = None, model_args=EIGHT_LAYERS, local_batch_size: int = 8):
    return plan_pipeline(pipeline_config(overrides).parallelism, Transformer, model_args, local_batch_size)


def blocks_per_stage(plan) -> list[int]:
    return [sum(name.startswith("layers.") for name in stage) for stage in plan.stage_modules]


# --- the split by counts --------------------------------------------------------------


def test_default_split_gives_the_embedding_and_the_output_a_block_each():
    plan = plan_of()
    assert plan.stage_modules == (
        ("tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"),
        ("layers.4", "layers.5", "layers.6", "layers.7", "norm", "output"),
    )
    assert (plan.schedule, plan.num_stages, plan.stages_per_rank, plan.microbatches) == ("1F1B", 2, 1, 8)


@pytest.mark.parametrize(
    "overrides, blocks",
    [
        # 12 units of work (8 blocks, the embedding and the output 1 and 3, or 3 and 1) over 2 stages: 6 each.
        ({LAST_LESS: 3}, [5, 3]),
        ({FIRST_LESS: 3}, [3, 5]),
        ({FIRST_LESS: 0,
          LAST_LESS: 0}, [4, 4]),
        # Looped: 4 stages of 10 units, the 2 left over to the later stages (2, 2, 3, 3).
        ({SCHEDULE: "Interleaved1F1B"}, [1, 2, 3, 2]),
        ({SCHEDULE: "ZBVZeroBubble"}, [1, 2, 3, 2]),
        # 2 blocks a stage, the outer modules counting for none: 4 stages.
        ({SCHEDULE: "LoopedBFS", PER_STAGE: 2,
          FIRST_LESS: 0,
          LAST_LESS: 0}, [2, 2, 2, 2]),
        # 1 unit a stage with 4 stages per rank: 10 units minus the 2 the outer modules take.
        ({SCHEDULE: "InterleavedZeroBubble",
          PER_STAGE: 1}, [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]),
    ],
)  # fmt: skip
def test_split_by_counts(overrides, blocks):
    plan = plan_of(overrides)
    assert blocks_per_stage(plan) == blocks
    # Every module once, in the model's order: the stages chain into the whole model.
    flat = [name for stage in plan.stage_modules for name in stage]
    assert flat == ["tok_embeddings", *(f"layers.{i}" for i in range(8)), "norm", "output"]
    assert plan.stage_modules[0][0] == "tok_embeddings" and plan.stage_modules[-1][-2:] == ("norm", "output")


def test_blocks_of_unequal_work_split_by_work():
    """Blocks whose work differs (DeepSeek-V3's dense blocks against its MoE ones; the costs
    the trainer passes are block_flops_per_token) split where the work before a boundary
    comes nearest its share; equal work keeps the split by counts."""
    parallelism = pipeline_config({FIRST_LESS: 0, LAST_LESS: 0}).parallelism
    heavy_first = plan_pipeline(parallelism, Transformer, EIGHT_LAYERS, 8, block_costs=[3, 3, 1, 1, 1, 1, 1, 1])
    assert blocks_per_stage(heavy_first) == [2, 6]  # 6 units of 12 before the boundary
    even = plan_pipeline(parallelism, Transformer, EIGHT_LAYERS, 8, block_costs=[5] * 8)
    assert blocks_per_stage(even) == blocks_per_stage(plan_of({FIRST_LESS: 0, LAST_LESS: 0})) == [4, 4]


def test_tiny_model_fills_two_stages_per_rank():
    # The parity tests run the tiny model's 3 blocks on 4 stages: the embedding alone first.
    plan = plan_of({SCHEDULE: "Interleaved1F1B"}, model_args=TINY)
    assert plan.stage_modules == (("tok_embeddings",), ("layers.0",), ("layers.1",), ("layers.2", "norm", "output"))


# --- the split by hand ------------------------------------------------------------------


def test_split_by_hand_on_the_command_line():
    by_hand = "tok_embeddings,layers.0,layers.1;layers.2,norm,output"
    plan = plan_of({BY_HAND: by_hand}, model_args=TINY)
    assert plan.stage_modules == (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "norm", "output"))


@pytest.mark.parametrize(
    "stages, message",
    [
        ([["tok_embeddings", "layers.0"], ["layers.1", "layers.9", "norm", "output"]],
         r"names 'layers\.9', which the model does not have"),
        ([["tok_embeddings", "layers.0"], ["layers.2", "norm", "output"]], r"leaves out 'layers\.1'"),
        ([["tok_embeddings", "layers.1"], ["layers.0", "layers.2", "norm", "output"]],
         r"does not list each module once, in the model's order"),
        ([["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "layers.2", "norm", "output"]],
         r"does not list each module once"),
        ([["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"], []], r"has an empty stage"),
        # Right modules, wrong count for the schedule: 3 stages on 2 ranks.
        ([["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2", "norm", "output"]],
         r"1F1B needs exactly 1 stage\(s\) per pp rank, but parallelism\.module_fqns_per_model_part gives 3 stage"),
    ],
)  # fmt: skip
def test_bad_split_by_hand(stages, message):
    parallelism = dataclasses.replace(pipeline_config().parallelism, module_fqns_per_model_part=stages)
    with pytest.raises(ValueError, match=rf"^(parallelism\.module_fqns_per_model_part |parallelism\.).*{message}"):
        plan_pipeline(parallelism, Transformer, TINY, 8)


# --- stages to ranks ------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_stage_to_rank_mapping_is_the_schedules_own(schedule, pp):
    # A stage the plan builds on another rank than the schedule sends to would deadlock.
    plan = plan_of({PP: pp, SCHEDULE: schedule})
    by_rank = {rank: plan.rank_stages(rank) for rank in range(pp)}
    assert sorted(stage for stages in by_rank.values() for stage in stages) == list(range(plan.num_stages))
    style = "v" if PIPELINE_SCHEDULES[schedule] == "v" else "loop"
    torch_mapping = generate_stage_to_rank_mapping(pp, plan.num_stages, style=style)
    assert {stage: rank for rank, stages in by_rank.items() for stage in stages} == torch_mapping


def test_v_schedules_put_the_first_and_last_stage_on_rank_zero():
    plan = plan_of({SCHEDULE: "DualPipeV"})
    assert [plan.rank_stages(rank) for rank in range(2)] == [[0, 3], [1, 2]]
    looped = plan_of({SCHEDULE: "LoopedBFS"})
    assert [looped.rank_stages(rank) for rank in range(2)] == [[0, 2], [1, 3]]


# --- layouts that cannot run ----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, local_batch_size, message",
    [
        ({SCHEDULE: "ZBVZeroBubble", PER_STAGE: 2},
         8, r"^parallelism\.pipeline_parallel_schedule ZBVZeroBubble needs exactly 2 stage\(s\) per pp rank, but "
            r"parallelism\.pipeline_parallel_layers_per_stage gives 5 stage\(s\) over "
            r"parallelism\.pipeline_parallel_degree = 2$"),
        ({SCHEDULE: "DualPipeV",
          BY_HAND: "tok_embeddings,layers.0,layers.1,layers.2,layers.3;"
                                                    "layers.4,layers.5,layers.6,layers.7,norm,output"},
         8, r"DualPipeV needs exactly 2 stage\(s\) per pp rank, but parallelism\.module_fqns_per_model_part gives 2"),
        ({SCHEDULE: "Interleaved1F1B", PER_STAGE: 5},
         8, r"Interleaved1F1B needs 2 or more stage\(s\) per pp rank, but "
            r"parallelism\.pipeline_parallel_layers_per_stage gives 2 stage\(s\)"),
        ({PER_STAGE: 1},
         8, r"1F1B needs exactly 1 stage\(s\) per pp rank, but .* gives 10 stage\(s\)"),
        ({PER_STAGE: 3},
         8, r"^parallelism\.pipeline_parallel_layers_per_stage \(3\) must divide the model's 8 blocks plus "
            r"first/last_stage_less_layers \(2\) = 10$"),
        # The embedding counted as 2 blocks, more than the first stage's share of the work.
        ({PP: 4, SCHEDULE: "LoopedBFS",
          FIRST_LESS: 2},
         8, r"^the model's 8 blocks do not fill 8 pipeline stages \(blocks per stage: \[-1, 1, 1, 1, 1, 2, 2, 1\]\)"),
        ({MICROBATCH: 3},
         8, r"^training\.local_batch_size \(8\) must be a multiple of "
            r"parallelism\.pipeline_parallel_microbatch_size \(3\)$"),
        # torch's 1F1B and DualPipeV fill the pipeline with one micro-batch per stage first.
        ({MICROBATCH: 8},
         8, r"^1F1B needs at least one micro-batch per stage: training\.local_batch_size / "
            r"parallelism\.pipeline_parallel_microbatch_size = 1 is below the 2 stages; "),
        ({SCHEDULE: "DualPipeV", MICROBATCH: 4},
         8, r"^DualPipeV needs at least one micro-batch per stage: .* = 2 is below the 4 stages; "),
        # The interleaved schedules run m // pp rounds of equal size: 5 is not 2 rounds' worth.
        ({SCHEDULE: "InterleavedZeroBubble"},
         5, r"^InterleavedZeroBubble runs the micro-batches in 2 equal rounds: training\.local_batch_size / "
            r"parallelism\.pipeline_parallel_microbatch_size = 5 must be a multiple of 2 \(with "
            r"parallelism\.pipeline_parallel_degree = 2\)$"),
    ],
)  # fmt: skip
def test_layout_that_cannot_run(overrides, local_batch_size, message):
    with pytest.raises(ValueError, match=message):
        plan_of(overrides, local_batch_size=local_batch_size)


def test_weight_tying_cannot_be_split():
    tied = SimpleNamespace(**dataclasses.asdict(EIGHT_LAYERS), tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"^parallelism\.pipeline_parallel_degree \(2\) cannot split a model whose "):
        plan_pipeline(pipeline_config().parallelism, Transformer, tied, 8)
    untied = SimpleNamespace(**dataclasses.asdict(EIGHT_LAYERS), tie_word_embeddings=False)
    assert plan_pipeline(pipeline_config().parallelism, Transformer, untied, 8).num_stages == 2


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6])
def test_looped_schedules_take_microbatch_counts_that_fill_equal_rounds(schedule, microbatches):
    # 3 micro-batches on 2 ranks make 1 round (3 // 2) of 3, 6 make 3 rounds of 2: torch runs both.
    plan = plan_of({SCHEDULE: schedule, MICROBATCH: 1}, local_batch_size=microbatches)
    assert plan.microbatches == microbatches


def test_unknown_schedule_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"'Interleaved1F1' is not known \(choose from GPipe, .*\); did you mean "):
        pipeline_config({SCHEDULE: "Interleaved1F1"})
    # Names match without regard to case, as torch's own lookup does.
    assert plan_of({SCHEDULE: "interleaved1f1b"}).schedule == "Interleaved1F1B"


# --- before any process group: plan_run and job.validate_only --------------------------------


def test_pp_must_divide_the_world_size():
    with pytest.raises(
        ConfigError, match=r"^parallelism\.pipeline_parallel_degree \(2\) must divide the world size \(3\)"
    ):
        plan_run(pipeline_config(), world_size=3)
    overrides = {"parallelism.tensor_parallel_degree": 2}
    with pytest.raises(ConfigError, match=r"degree x parallelism\.tensor_parallel_degree \(4\) must divide the world"):
        plan_run(pipeline_config(overrides), world_size=6)
    # The data-parallel degrees fill what PP (and TP) leave of the world.
    replicate = {"parallelism.data_parallel_replicate_degree": 2, "parallelism.data_parallel_shard_degree": 4}
    with pytest.raises(ConfigError, match=r"\(2\) x parallelism\.data_parallel_shard_degree \(4\) must equal the world "
                       r"size \(8\) / parallelism\.pipeline_parallel_degree \(2\);"):  # fmt: skip
        plan_run(pipeline_config(replicate), world_size=8)


@pytest.mark.parametrize(
    "world_size, overrides, strategy, dp_shard",
    [
        (2, {}, "PP", 1),
        (4, {}, "PP + FSDP", 2),  # the data-parallel degree takes what PP leaves
        (8, {"parallelism.tensor_parallel_degree": 2}, "PP + FSDP + TP", 2),
        (8, {"parallelism.data_parallel_replicate_degree": 2}, "PP + HSDP", 2),
    ],
)
def test_plan_run_with_pipeline(world_size, overrides, strategy, dp_shard):
    plan = plan_run(pipeline_config({"training.local_batch_size": 4, **overrides}), world_size=world_size)
    dims = plan.parallel_dims
    assert (dims.pp, dims.dp_shard, dims.strategy) == (2, dp_shard, strategy)
    assert dims.pp * dims.dp_replicate * dims.dp_shard * dims.tp == world_size
    # PP ranks of one pipeline read the same batch: only the data-parallel ranks divide it.
    assert plan.global_batch_size == 4 * dims.dp_degree
    assert plan.pipeline.stage_modules == plan_of(model_args=TINY).stage_modules


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD_SCHEDULES)
def test_split_backward_refuses_compiled_blocks_and_fsdp_resharding_after_forward(schedule):
    # 4 micro-batches: enough for every one of them (DualPipeV takes one per stage).
    split = {SCHEDULE: schedule, "training.local_batch_size": 4, MICROBATCH: 1}
    refused = rf"^parallelism\.pipeline_parallel_schedule {schedule} splits the backward, which "
    with pytest.raises(ConfigError, match=refused + "compiled blocks do not support; "):
        plan_run(pipeline_config({**split, "compile.enable": True}), world_size=2)
    always = {**split, "parallelism.fsdp_reshard_after_forward": "always"}
    with pytest.raises(ConfigError, match=refused + "loses the weights' gradients of stages that FSDP reshards after"):
        plan_run(pipeline_config(always), world_size=4)
    # Without FSDP nothing reshards; FSDP's default under PP keeps a stage gathered for the run.
    assert plan_run(pipeline_config(always), world_size=2).pipeline.schedule == schedule
    assert plan_run(pipeline_config(split), world_size=4).parallel_dims.fsdp_applied
    # Schedules without the split take both.
    compiled = {**always, SCHEDULE: "Interleaved1F1B", "compile.enable": True}
    assert plan_run(pipeline_config(compiled), world_size=4).pipeline.schedule == "Interleaved1F1B"


def test_no_pipeline_plan_without_pp():
    assert plan_run(parse_args(tiny_args()), world_size=2).pipeline is None
    assert ParallelDims.resolve(1, -1, 2).pp == 1


@pytest.mark.parametrize(
    "overrides, warning",
    [
        # GPipe takes a single micro-batch: (p - 1) / (m + p - 1) = 1/2 of the step idle.
        ({SCHEDULE: "GPipe", MICROBATCH: 2},
         "1 micro-batch(es) per step for 2 pipeline stages: each rank idles 50% of the step (pipeline bubble)"),
        # Interleaved, one round of 2 micro-batches through 4 stages on 2 ranks: as GPipe through 4
        # ranks, m + 4 - 1 = 5 chunk slots of which each rank is busy 4, so 1/5 idle (the closed
        # formula used before, 1/3 divided by the 2 stages per rank = 17%, undercounted it).
        ({SCHEDULE: "Interleaved1F1B"},
         "2 micro-batch(es) per step for 4 pipeline stages: each rank idles 20% of the step (pipeline bubble)"),
    ],
)  # fmt: skip
def test_fewer_microbatches_than_stages_is_a_warning(overrides, warning, monkeypatch, capsys, quiet_process_state):
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TITANLITE_CONFIG_WARNINGS_SHOWN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*tiny_args({PP: 2, **overrides}), "--job.validate_only"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"titanlite: warning: {warning}; raise training.local_batch_size or lower "
                                "parallelism.pipeline_parallel_microbatch_size"]  # fmt: skip
    assert out.startswith("titanlite: config ok: PP over 2 rank(s), ")


def test_enough_microbatches_is_no_warning():
    assert microbatch_warning(plan_of({SCHEDULE: "ZBVZeroBubble"})) is None
