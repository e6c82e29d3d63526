"""The estimators under pipeline parallelism, without real process groups: in-flight
micro-batches against torch's own schedules, the bubble and the stage-to-stage bytes in the
step time, per-stage memory (simulated on a fake process group) and floor, and the sweep's
PP verdicts."""

import sys
from pathlib import Path

import pytest
import torch

from titanlite.config import ConfigError, parse_args
from titanlite.estimate import check_memory_floor, estimate_for_job_config, estimate_memory, estimate_step_time
from titanlite.estimate.compute import rank_work
from titanlite.estimate.floor import fullest_floor
from titanlite.estimate.pipeline import backward_per_forward, in_flight_microbatches, stage_params
from titanlite.estimate.sweep_report import sweep_verdicts
from titanlite.metrics import flops_per_token
from titanlite.models.llama import Transformer
from titanlite.models.llama.args import LLAMA3_FLAVORS
from titanlite.parallel.bubble import rank_actions
from titanlite.parallel.pipeline import PipelinePlan, plan_pipeline
from titanlite.plan import plan_run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402

LLAMA3_8B = LLAMA3_FLAVORS["8B"]
TINY_PP = [
    "--model.name=llama3",
    "--model.flavor=tiny",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
    "--training.mixed_precision_param=float32",
    "--activation_checkpoint.mode=none",
    "--parallelism.pipeline_parallel_degree=2",
]


def _plan(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> PipelinePlan:
    stages = tuple((f"layers.{index}",) for index in range(pp * stages_per_rank))
    return PipelinePlan(schedule, pp, stages, microbatches)


# --- in-flight micro-batches ------------------------------------------------------------------


def _most_held(actions) -> int:
    """The most chunks whose forward ran and whose input backward has not, along the actions
    (kind, stage, micro-batch) torch runs on one rank (titanlite.parallel.bubble.rank_actions,
    checked against torch's own printout in test_pipeline_bubble.py)."""
    held = most = 0
    for kind, _, _ in actions:
        held += {"F": 1, "B": -1, "I": -1}.get(kind, 0)
        most = max(most, held)
    return most


@pytest.mark.parametrize(
    "name, stages_per_rank",
    [
        ("Interleaved1F1B", 2),
        ("Interleaved1F1B", 3),
        ("LoopedBFS", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
    ],
)
def test_in_flight_chunks_are_what_torchs_multi_stage_schedules_hold(name, stages_per_rank):
    for pp in (2, 4):
        for microbatches in (1, 2, 4, 8, 12):
            if name != "ZBVZeroBubble" and microbatches > pp and microbatches % pp:
                continue  # the looped schedules refuse it (and so does plan_pipeline)
            orders = rank_actions(name, pp, stages_per_rank, microbatches)
            plan = _plan(name, pp, stages_per_rank, microbatches)
            held = [in_flight_microbatches(plan, rank) for rank in range(pp)]
            assert held == [_most_held(orders[rank]) for rank in range(pp)], (pp, microbatches)


def test_1f1b_holds_fewer_micro_batches_on_later_stages_and_gpipe_holds_all():
    plan = _plan("1F1B", 4, 1, 8)
    assert [in_flight_microbatches(plan, rank) for rank in range(4)] == [4, 3, 2, 1]
    few = _plan("1F1B", 4, 1, 2)
    assert [in_flight_microbatches(few, rank) for rank in range(4)] == [2, 2, 2, 1]
    gpipe = _plan("GPipe", 4, 1, 8)
    assert {in_flight_microbatches(gpipe, rank) for rank in range(4)} == {8}


# --- step time --------------------------------------------------------------------------------


def _pipeline(schedule: str, pp: int, local_batch: int, microbatch: int = 1, args=LLAMA3_8B) -> PipelinePlan:
    config = parse_args(
        [
            f"--parallelism.pipeline_parallel_degree={pp}",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--parallelism.pipeline_parallel_microbatch_size={microbatch}",
        ]
    )
    return plan_pipeline(config.parallelism, Transformer, args, local_batch)


def test_stages_split_the_models_parameters_and_flops():
    plan = _pipeline("Interleaved1F1B", 4, 8)
    with torch.device("meta"):
        model = Transformer(LLAMA3_8B)
    stages = stage_params(model, plan)
    assert sum(stage.total for stage in stages) == sum(p.numel() for p in model.parameters())
    assert sum(stage.blocks for stage in stages) == LLAMA3_8B.n_layers
    assert stages[0].embedding == model.tok_embeddings.weight.numel()
    # Each rank's FLOPs add up to the whole model's; the busiest rank does at least 1/p of them.
    whole = flops_per_token(LLAMA3_8B, 4096)
    per_rank = [rank_work(LLAMA3_8B, 4096, 0.0, _one_rank(plan, rank)).flops for rank in range(plan.pp)]
    assert sum(per_rank) == pytest.approx(whole, rel=1e-12)
    assert rank_work(LLAMA3_8B, 4096, 0.0, plan).flops == pytest.approx(max(per_rank), rel=1e-12)


def _one_rank(plan: PipelinePlan, rank: int) -> PipelinePlan:
    """The plan seen by one rank only: its stages, as a one-rank pipeline."""
    return PipelinePlan(plan.schedule, 1, tuple(plan.stage_modules[s] for s in plan.rank_stages(rank)), 1)


@pytest.mark.parametrize("schedule, microbatches", [("1F1B", 2), ("1F1B", 8), ("Interleaved1F1B", 8), ("GPipe", 4)])
def test_step_time_is_the_compute_stretched_by_the_bubble(schedule, microbatches):
    # Two ranks in one node, no data or tensor parallelism: the pipeline is all there is.
    plan = _pipeline(schedule, 2, microbatches)
    timing = estimate_step_time(
        LLAMA3_8B, seq_len=4096, local_batch_size=microbatches, hardware="h100", dp_shard=1, pipeline=plan
    )
    # Selective AC every 2nd block (the default) recomputes half the blocks' forwards in the
    # backward: the bubble is the schedule's at that backward-to-forward ratio.
    work = rank_work(LLAMA3_8B, 4096, 0.5, plan)
    ratio = 2 + 3 * work.recompute_flops / work.flops
    assert 2.4 < ratio < 2.5 and backward_per_forward(work.flops, work.recompute_flops) == round(ratio, 2)
    assert timing.pp == 2 and timing.bubble == plan.bubble_at(round(ratio, 2)) and timing.microbatches == microbatches
    assert timing.bubble == pytest.approx(plan.bubble, rel=1e-12)  # no split backward: the ratio does not matter
    assert timing.all_gather_bytes == timing.reduce_scatter_bytes == 0
    pipelined = max(timing.compute_s / (1 - timing.bubble), timing.pp_s) + timing.pp_exposed_s
    assert timing.step_s == pytest.approx(pipelined, rel=1e-12)
    assert timing.pp_link == "intra-node"
    assert f"pipeline bubble {plan.bubble:.1%}" in timing.describe()
    # Per device: the pipeline's tokens over its two GPUs.
    assert timing.tokens_per_device_per_step == microbatches * 4096 / 2


def test_interleaving_shrinks_the_bubble_and_more_micro_batches_shrink_it_further():
    def step_s(schedule, microbatches, ac_mode="selective"):
        plan = _pipeline(schedule, 4, microbatches)
        common = dict(seq_len=4096, local_batch_size=microbatches, hardware="h100", dp_shard=1, ac_mode=ac_mode)
        return estimate_step_time(LLAMA3_8B, pipeline=plan, **common)

    one, interleaved = step_s("1F1B", 4), step_s("Interleaved1F1B", 4)
    # 1F1B idles (p - 1) / (m + p - 1) = 3/7 of the step; interleaving 2 stages per rank gives
    # Megatron's (p - 1) / (v m) of the compute, 3/11 of the step (the closed formula used
    # before, half of 1F1B's, undercounted it: 3/14).
    assert one.bubble == pytest.approx(3 / 7) and interleaved.bubble == pytest.approx(3 / 11)
    assert interleaved.step_s < one.step_s
    # The zero-bubble schedules fill most of the rest; less so when AC lengthens the inputs'
    # gradient, whose wait the weights' gradient cannot fill.
    zero_bubble = {ac: step_s("ZBVZeroBubble", 8, ac).bubble for ac in ("none", "full")}
    assert zero_bubble["none"] == pytest.approx(_pipeline("ZBVZeroBubble", 4, 8).bubble, rel=1e-12)
    assert zero_bubble["none"] < zero_bubble["full"] < step_s("Interleaved1F1B", 8).bubble
    per_microbatch = [step_s("1F1B", m).step_s / m for m in (4, 8, 16)]
    assert per_microbatch == sorted(per_microbatch, reverse=True)


@pytest.mark.parametrize("tp, sequence_parallel", [(1, True), (2, True), (2, False)])
def test_stage_boundaries_send_one_activation_and_its_gradient_per_micro_batch(tp, sequence_parallel):
    microbatches, seq = 4, 2048
    plan = _pipeline("1F1B", 2, microbatches)
    common = dict(seq_len=seq, local_batch_size=microbatches, hardware="h100", dp_shard=1, pipeline=plan)
    timing = estimate_step_time(LLAMA3_8B, tp=tp, sequence_parallel=sequence_parallel, grad_accum_steps=3, **common)
    sequence = seq // tp if sequence_parallel else seq
    activation = 1 * sequence * LLAMA3_8B.dim * 2  # one sequence per micro-batch, bf16
    # Rank 0 sends each micro-batch's output forward; rank 1 each input gradient back.
    assert timing.pp_bytes == 3 * microbatches * activation
    assert timing.pp_exposed_s == pytest.approx(2 * 1 * activation * 3 / 450e9)
    # Interleaved (4 stages on 2 ranks): each rank has 3 sends per micro-batch.
    looped = _pipeline("Interleaved1F1B", 2, microbatches)
    interleaved = estimate_step_time(
        LLAMA3_8B, tp=tp, sequence_parallel=sequence_parallel, **{**common, "pipeline": looped}
    )
    assert interleaved.pp_bytes == 3 * microbatches * activation


def test_a_schedule_torch_refuses_is_an_error_the_sweep_skips(capsys):
    argv = [*TINY_PP, "--training.local_batch_size=1"]
    with pytest.raises(
        ValueError, match=r"^1F1B needs at least one micro-batch per stage: .* = 1 is below the 2 stages"
    ):
        estimate_for_job_config(parse_args(argv), 2, "h100")
    gpipe = parse_args([*argv, "--parallelism.pipeline_parallel_schedule=GPipe"])
    assert estimate_for_job_config(gpipe, 2, "h100").bubble == 0.5
    # One sequence a step on 2 GPUs: a pipeline of 2 stages gets one micro-batch.
    sweep = ["--sweep", "--skip_memory", "--sweep_sizes", "2", "--sweep_pp", "2", "--sweep_schedules", "1F1B,GPipe"]
    assert estimate.main([*TINY_PP, "--training.global_batch_size=1", *sweep]) == 0
    out = capsys.readouterr().out
    assert "skipped 2 GPUs 2 x 1 x 1 x 1 (1F1B): 1F1B needs at least one micro-batch per stage" in out
    # The layouts without a pipeline are tried too (here they cannot split one sequence).
    assert "skipped 2 GPUs 1 x 2 x 1: the global batch of 1 sequences does not split over 2" in out


def test_pipeline_across_nodes_uses_the_inter_node_link_and_splits_the_fsdp_traffic():
    plan = _pipeline("1F1B", 2, 8)
    common = dict(seq_len=4096, local_batch_size=8, hardware="h100", dp_shard=8)
    timing = estimate_step_time(LLAMA3_8B, pipeline=plan, **common)
    assert timing.pp_link == "inter-node" and timing.shard_link == "intra-node"
    whole = estimate_step_time(LLAMA3_8B, dp_shard=8, **{k: v for k, v in common.items() if k != "dp_shard"})
    # Each stage gathers its half of the weights once per step, not every block twice.
    assert timing.all_gather_bytes < whole.all_gather_bytes / 2
    assert timing.world_size == 16 and timing.strategy == "PP + FSDP"


# --- memory -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_memory():
    """Per-stage estimates of the tiny model on PP 2 x FSDP 2, for the schedules compared below."""
    return {
        schedule: estimate_memory(parse_args([*TINY_PP, f"--parallelism.pipeline_parallel_schedule={schedule}"]), 4)
        for schedule in ("1F1B", "GPipe")
    }


def test_each_pp_rank_holds_its_stages_state_only(tiny_memory):
    whole = estimate_memory(parse_args(TINY_PP[:-1]), 2)  # FSDP 2: the same shards of the whole model
    estimate = tiny_memory["1F1B"]
    ranks = estimate.pipeline
    assert [rank.stages for rank in ranks] == [(0,), (1,)]
    assert sum(rank.num_params for rank in ranks) == whole.num_params == estimate.num_params
    worst = estimate.worst_stage
    assert estimate.peak == worst.peak and worst.peak_bytes == max(rank.peak_bytes for rank in ranks)
    # The parameter shards at each rank's peak add up to the whole model's (FSDP pads each
    # parameter to its largest shard, the same either way).
    assert sum(rank.peak["parameters"] for rank in ranks) == whole.peak["parameters"]


def test_gpipe_holds_every_micro_batch_and_1f1b_its_stages_share(tiny_memory):
    one_f_one_b, gpipe = tiny_memory["1F1B"].pipeline, tiny_memory["GPipe"].pipeline
    assert [rank.in_flight for rank in one_f_one_b] == [2, 1]
    assert [rank.in_flight for rank in gpipe] == [4, 4]
    for rank in (0, 1):
        per_microbatch = one_f_one_b[rank].microbatch_activations
        assert per_microbatch > 0 and gpipe[rank].microbatch_activations == per_microbatch
        extra = (gpipe[rank].in_flight - one_f_one_b[rank].in_flight) * per_microbatch
        assert gpipe[rank].peak_bytes - one_f_one_b[rank].peak_bytes == extra


def test_a_micro_batch_waiting_for_its_backward_holds_only_what_its_forward_saved():
    # Under full activation checkpointing a waiting micro-batch keeps each block's input,
    # not the block's recomputed activations (those exist for the one micro-batch in its
    # backward): the further in-flight micro-batches cost far less than without checkpointing.
    # benchmarks/pipeline.py --ac-mode full measures the peaks this gives (docs/performance.md).
    none, full = (
        estimate_memory(parse_args([*TINY_PP, f"--activation_checkpoint.mode={mode}"]), 2).pipeline
        for mode in ("none", "full")
    )
    for rank_none, rank_full in zip(none, full, strict=True):
        assert 0 < rank_full.microbatch_activations < rank_none.microbatch_activations / 2
        # What the rank's peak holds beyond its one simulated micro-batch.
        assert rank_full.peak["activations"] < rank_none.peak["activations"]


def test_the_floor_is_per_stage_and_the_fullest_must_fit(monkeypatch):
    config = parse_args([*TINY_PP, "--parallelism.pipeline_parallel_microbatch_size=2"])
    plan = plan_run(config, 2)
    whose, floor = fullest_floor(config, plan)
    whole_config = parse_args(TINY_PP[:-1])
    _, whole = fullest_floor(whole_config, plan_run(whole_config, 1))
    # The stage with the output (the larger one) is the fullest; it holds one micro-batch's logits.
    assert whose.startswith("pp rank 1 (stage(s) 1)")
    assert floor["weights and Adam state"] < whole["weights and Adam state"]
    assert floor["logits"] == whole["logits"] * 2 // 4
    assert floor["unsharded stage weights and gradients"] == 0  # no FSDP: gradients are plain
    # Under FSDP each micro-batch but the last keeps the stage's gradients unsharded (float32
    # here) and the gathered weights stay: the stage's parameters twice, whatever the shards.
    _, sharded = fullest_floor(config, plan_run(config, 4))
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    stage_params = sum(
        p.numel() for name in plan.pipeline.stage_modules[1] for p in model.get_submodule(name).parameters()
    )
    assert sharded["unsharded stage weights and gradients"] == stage_params * (4 + 4)
    one = parse_args(
        [
            *TINY_PP,
            "--parallelism.pipeline_parallel_microbatch_size=4",
            "--parallelism.pipeline_parallel_schedule=GPipe",
        ]
    )
    assert fullest_floor(one, plan_run(one, 4))[1]["unsharded stage weights and gradients"] == 0
    monkeypatch.setattr("titanlite.estimate.floor.device_memory_bytes", lambda *_: (1, "a 1-byte test device"))
    with pytest.raises(ConfigError, match=r"^pp rank 1 \(stage\(s\) 1\) of model llama3 tiny on 1 shard\(s\)") as error:
        check_memory_floor(config, plan)
    assert "parallelism.pipeline_parallel_degree" in str(error.value)
    # Logits larger than the weights: the micro-batch size is the key to lower.
    long = parse_args(
        [
            *TINY_PP,
            "--training.seq_len=1024",
            "--parallelism.pipeline_parallel_microbatch_size=4",
            "--parallelism.pipeline_parallel_schedule=GPipe",
        ]
    )
    with pytest.raises(ConfigError, match=r"^parallelism.pipeline_parallel_microbatch_size 4 \(x seq_len 1024\)"):
        check_memory_floor(long, plan_run(long, 2))


# --- the sweep ---------------------------------------------------------------------------------


def test_sweep_tries_each_pipeline_degree_and_schedule(capsys):
    debug = str(Path(__file__).resolve().parent.parent / "train_configs" / "debug_model.toml")
    argv = ["--job.config_file", debug, "--sweep", "--skip_memory", "--sweep_sizes", "16", "--json"]
    assert estimate.main([*argv, "--sweep_pp", "1,2,4", "--sweep_schedules", "1f1b,Interleaved1F1B"]) == 0
    import json

    results = json.loads(capsys.readouterr().out)
    pipelines = {(r["layout"].get("pp", 1), r["layout"].get("schedule")) for r in results}
    assert pipelines == {(1, None), (2, "1F1B"), (2, "Interleaved1F1B"), (4, "1F1B"), (4, "Interleaved1F1B")}
    for result in results:
        layout, timing = result["layout"], result["step_time"]
        pp = layout.get("pp", 1)
        assert pp * layout["dp_replicate"] * layout["dp_shard"] * layout["tp"] == 16
        assert timing["pp"] == pp and (timing["bubble"] > 0) == (pp > 1)


def _row(pp: int, tokens_per_s: float, fits: bool, peak_gib: float) -> dict:
    layout = {"world_size": 64, "dp_replicate": 1, "dp_shard": 64 // pp, "tp": 1}
    layout.update({"pp": pp, "schedule": "1F1B", "strategy": "PP + FSDP"} if pp > 1 else {"strategy": "FSDP"})
    step_time = {"tokens_per_second_per_device": tokens_per_s, "mfu_percent": 30.0, "bubble": 0.2, "microbatches": 4}
    step_time.update({"compute_s": 1.0, "all_gather_s": 0.5, "reduce_scatter_s": 0.5, "all_reduce_s": 0.5})
    step_time["shard_link"] = "inter-node"
    return {
        "layout": layout,
        "step_time": step_time,
        "memory": {"fits": fits, "peak_bytes": peak_gib * 2**30, "device_bytes": 80 * 2**30},
    }


def test_sweep_says_when_pp_wins_and_when_it_does_not():
    nothing_else_fits = [_row(1, 900, False, 140.0), _row(2, 700, True, 60.0)]
    assert sweep_verdicts(nothing_else_fits)[0].endswith(
        "PP wins: no layout without PP fits in memory (the smallest peak, FSDP 1x64x1, is 140.0 GiB of 80)"
    )
    communication_bound = [_row(1, 500, True, 60.0), _row(2, 700, True, 50.0)]
    verdict = sweep_verdicts(communication_bound)[0]
    assert verdict.startswith("64 GPUs: PP + FSDP 2x1x32x1 1F1B wins"), verdict
    assert "PP wins: +40% over the best without PP, FSDP 1x64x1, whose data-parallel collectives (1,500 ms" in verdict
    loses = sweep_verdicts([_row(1, 900, True, 60.0), _row(2, 700, True, 50.0)])[0]
    assert loses.endswith(
        "PP does not: the best with PP, PP + FSDP 2x1x32x1 1F1B, reaches 700 (-22%), its pipeline bubble idling "
        "20% of its step (4 micro-batches)"
    ), loses
