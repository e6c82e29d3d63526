"""The estimators for mixture-of-experts models and expert parallelism: active parameters in
the FLOPs and MFU (the pipeline's per-stage count included), the experts' memory per rank
(arithmetic, floor and simulation), the all-to-all bytes against a count by hand, the links
an EP group uses, and the sweep's EP degrees. Arithmetic and fake process groups only; the
bytes real all-to-alls move are benchmarks/moe.py's (its --quick run is a smoke test)."""

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from titanlite.config import parse_args
from titanlite.estimate import estimate_for_job_config, estimate_memory, estimate_step_time
from titanlite.estimate.communication import group_spans_nodes
from titanlite.estimate.compute import device_flops_per_token, rank_work
from titanlite.estimate.expert_parallel import expert_all_to_all_bytes
from titanlite.estimate.floor import exact_model_state_bytes, fullest_floor
from titanlite.estimate.held_whole import HeldWhole, held_whole
from titanlite.estimate.simulation import expert_parallel_bytes, measure_real_memory
from titanlite.estimate.tensor_parallel import tensor_parallel_bytes
from titanlite.metrics import flops_per_token
from titanlite.metrics.flops import active_params, attention_flops_per_token, model_on_meta, param_counts
from titanlite.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS
from titanlite.models.qwen3 import QWEN3_FLAVORS
from titanlite.parallel.pipeline import PipelinePlan, plan_pipeline
from titanlite.plan import plan_run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import estimate  # noqa: E402

A3B = QWEN3_FLAVORS["30B-A3B"]
CONFIG = str(Path(__file__).resolve().parent.parent / "train_configs" / "qwen3_30b_a3b.toml")
TINY_MOE = [
    "--model.name=qwen3",
    "--model.flavor=tiny_moe",
    "--training.seq_len=64",
    "--training.local_batch_size=2",
    "--activation_checkpoint.mode=none",
]


def _a3b_step(**kwargs):
    options = dict(seq_len=4096, local_batch_size=1, hardware="h100", dp_shard=8, ac_mode="full")
    options.update(kwargs)
    return estimate_step_time(A3B, **options)


# --- FLOPs and MFU: the experts a token meets ------------------------------------------------


def test_step_time_flops_and_mfu_count_the_active_parameters():
    # 30B-A3B by hand: a token meets the router and 8 of the 128 experts of each of 48 blocks.
    counts = param_counts(A3B)
    expert = 3 * A3B.dim * A3B.moe_hidden_dim
    assert counts.experts == (128 * expert,) * 48
    assert active_params(A3B) == counts.total - counts.embedding - 48 * 120 * expert
    timing = _a3b_step()
    assert timing.flops_per_token == 6 * active_params(A3B) + attention_flops_per_token(A3B, 4096)
    assert timing.flops_per_token < 6 * counts.total / 5  # all experts would be ~9x the active ones
    mfu = 100 * timing.tokens_per_second_per_device * timing.flops_per_token / timing.hardware.peak_flops
    assert timing.mfu_percent == pytest.approx(mfu, rel=1e-12)
    # Full AC recomputes the blocks' forward: a third of their active FLOPs.
    blocks = timing.flops_per_token - 6 * counts.head
    assert timing.recompute_flops_per_token == pytest.approx(blocks / 3, rel=1e-12)


def test_pipeline_stages_count_only_the_experts_a_token_meets():
    config = parse_args(["--model.name=qwen3", "--model.flavor=30B-A3B", "--parallelism.pipeline_parallel_degree=4"])
    plan = plan_pipeline(config.parallelism, type(model_on_meta(A3B)), A3B, 8)
    stages = [rank_work(A3B, 4096, 0.0, _one_stage(plan, stage)) for stage in range(plan.num_stages)]
    # The stages' FLOPs add up to the whole model's active ones, not to 6 x all its weights.
    assert sum(stage.flops for stage in stages) == pytest.approx(flops_per_token(A3B, 4096), rel=1e-12)
    assert sum(stage.experts for stage in stages) == sum(param_counts(A3B).experts)
    assert sum(stage.moe_layers for stage in stages) == A3B.n_layers


def _one_stage(plan: PipelinePlan, stage: int) -> PipelinePlan:
    """One stage of ``plan`` as a one-rank pipeline."""
    return PipelinePlan("1F1B", 1, (plan.stage_modules[stage],), 1)


# --- memory: the experts per rank ------------------------------------------------------------


def test_expert_state_per_rank_is_the_experts_over_ep_over_the_shards_left():
    model = model_on_meta(A3B)
    experts = sum(param_counts(A3B).experts)
    for shards, ep in ((8, 1), (8, 2), (8, 8), (64, 8), (2, 2), (4, 4), (16, 16)):
        state = exact_model_state_bytes(model, shards, ep=ep, kind="experts")
        # n_experts / ep experts on a rank, FSDP-sharded over shards / ep: 1/shards of them all.
        assert state.parameters == experts * 4 / ep / (shards // ep)
        assert state.optimizer_state == 2 * state.parameters + 48 * 3 * 4  # and one step counter per weight
    # Under TP 2 an ep group takes both tp ranks of ep / 2 shard ranks: each TP rank holds its
    # own n_experts / ep, FSDP-sharded over shards / (ep / 2): 1/(shards x 2) of them all, the
    # same on every rank (128 experts split evenly).
    for shards, ep in ((4, 2), (4, 8), (32, 8)):
        for shard_rank, tp_rank in ((0, 0), (shards - 1, 1)):
            state = exact_model_state_bytes(
                model, shards, rank=shard_rank, tp_rank=tp_rank, ep=ep, kind="experts", tp=2
            )
            assert state.parameters == experts * 4 / (shards * 2)
    # Expert parallelism alone (no FSDP left over the experts): a rank's experts shrink as 1/ep.
    alone = {ep: exact_model_state_bytes(model, ep, ep=ep, kind="experts").parameters for ep in (2, 4, 8, 16)}
    assert [alone[2] / alone[ep] for ep in (2, 4, 8, 16)] == [1, 2, 4, 8]
    dense = exact_model_state_bytes(model, 8, kind="dense").parameters
    assert dense + exact_model_state_bytes(model, 8, ep=4, kind="experts").parameters == pytest.approx(
        exact_model_state_bytes(model, 8).parameters, rel=1e-6
    )


def test_floor_counts_each_ranks_experts_under_ep():
    # With or without EP a rank's weights and Adam state are 1/s of the experts and of the
    # rest: EP only changes which experts (n_experts / ep of them, over the s / ep ranks left).
    base = ["--job.config_file", CONFIG, "--parallelism.data_parallel_shard_degree=8"]
    floors = {}
    for ep in (1, 4):
        config = parse_args([*base, f"--parallelism.expert_parallel_degree={ep}"])
        floors[ep] = fullest_floor(config, plan_run(config, 8))[1]["weights and Adam state"]
    model = model_on_meta(A3B)
    dense, experts = (exact_model_state_bytes(model, 8, kind=kind) for kind in ("dense", "experts"))
    assert (
        floors[1]
        == floors[4]
        == dense.parameters + dense.optimizer_state + experts.parameters + (experts.optimizer_state)
    )


def test_simulated_memory_under_ep_gathers_fewer_experts_and_buffers_the_all_to_all():
    estimates = {
        ep: estimate_memory(parse_args([*TINY_MOE, f"--parallelism.expert_parallel_degree={ep}"]), 4, "cpu")
        for ep in (1, 2, 4)
    }
    block_experts = param_counts(QWEN3_FLAVORS["tiny_moe"]).experts[0]
    args = QWEN3_FLAVORS["tiny_moe"]
    buffers = 2 * 2 * 64 * args.top_k * args.dim * 2  # bf16 rows received and sent back
    for ep in (2, 4):
        assert estimates[ep].exact == estimates[1].exact  # 4 experts split evenly: no padding changes
        gathered = int(block_experts * (1 - 1 / ep)) * 2
        change = estimates[ep].peak["temporary"] - estimates[1].peak["temporary"]
        assert change == buffers - gathered
        assert estimates[ep].peak_bytes - estimates[1].peak_bytes == change
        assert any("expert parallelism" in note for note in estimates[ep].notes)


def test_simulated_pipeline_stage_under_ep_holds_its_experts_gathered_over_ep():
    # PP 2 x FSDP 2, two micro-batches: each stage stays gathered (bf16) with its gradients
    # unreduced (fp32) for the whole step; under EP 2 that is half of its experts.
    pipeline = [
        *TINY_MOE,
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_microbatch_size=1",
    ]
    estimates = {
        ep: estimate_memory(parse_args([*pipeline, f"--parallelism.expert_parallel_degree={ep}"]), 4, "cpu")
        for ep in (1, 2)
    }
    args = QWEN3_FLAVORS["tiny_moe"]
    buffers = 2 * 1 * 64 * args.top_k * args.dim * 2
    for without, with_ep in zip(estimates[1].pipeline, estimates[2].pipeline, strict=True):
        blocks = [name for stage in with_ep.stages for name in _stage_blocks(stage)]
        held_experts = param_counts(args).experts[0] * len(blocks)
        change = with_ep.peak["temporary"] - without.peak["temporary"]
        assert change == buffers - held_experts // 2 * (2 + 4), with_ep.pp_rank


def _stage_blocks(stage: int) -> list[str]:
    """The blocks pipeline stage ``stage`` of tiny_moe holds under PP 2."""
    config = parse_args([*TINY_MOE, "--parallelism.pipeline_parallel_degree=2"])
    modules = plan_run(config, 4).pipeline.stage_modules[stage]
    return [name for name in modules if name.startswith("layers.")]


# --- the all-to-all ----------------------------------------------------------------------------


def test_all_to_all_bytes_by_hand():
    # One rank's 4096 tokens, 8 experts each, rows of 2048 bf16: every pair's row goes to its
    # expert and back in forward, both again reversed in backward, and once more forward for
    # every recomputed layer; 7 of 8 owners are other ranks. Before each forward 128 int64 counts.
    row = 2048 * 2
    pairs = 4096 * 8
    per_layer_forward = (2 * pairs * row + 128 * 8) * 7 / 8
    per_layer_backward = 2 * pairs * row * 7 / 8
    by_hand = 48 * (2 * per_layer_forward + per_layer_backward)  # full AC: each forward twice
    assert expert_all_to_all_bytes(4096, 8, 2048, 2, 128, 8, 48, 48) == pytest.approx(by_hand, rel=1e-12)
    assert expert_all_to_all_bytes(4096, 8, 2048, 2, 128, 1, 48, 48) == 0
    timing = _a3b_step(ep=8)
    assert timing.ep_bytes == pytest.approx(by_hand, rel=1e-12)
    assert timing.ep_s == pytest.approx(by_hand / timing.hardware.intra_node_bw, rel=1e-12)
    assert timing.ep_link == "intra-node"
    # Beyond a node the same bytes take the network.
    across = _a3b_step(ep=8, gpus_per_node=4)
    assert across.ep_link == "inter-node" and across.ep_s == pytest.approx(by_hand / across.hardware.inter_node_bw)


def test_ep_leaves_each_rank_fewer_experts_to_gather():
    # 8 shard ranks, EP 4: the dense weights are gathered (bf16) and reduce-scattered (fp32)
    # over the 8, each rank's 32 experts over the 2 ranks holding the same ones. Reshard
    # "default" gathers all but the last block and the root again in backward.
    counts = param_counts(A3B)
    experts = sum(counts.experts)
    dense = counts.total - experts
    dense_regathered = sum(counts.blocks[:-1]) - sum(counts.experts[:-1])
    experts_regathered = sum(counts.experts[:-1])
    plain, ep4 = _a3b_step(), _a3b_step(ep=4)
    assert ep4.all_gather_bytes == pytest.approx(
        (dense + dense_regathered) * 2 * 7 / 8 + (experts + experts_regathered) / 4 * 2 / 2, rel=1e-12
    )
    assert ep4.reduce_scatter_bytes == pytest.approx(dense * 4 * 7 / 8 + experts / 4 * 4 / 2, rel=1e-12)
    assert plain.reduce_scatter_bytes == pytest.approx(counts.total * 4 * 7 / 8, rel=1e-12)
    # FSDP's traffic overlaps the compute; the all-to-alls do not (the experts wait for their rows).
    data_parallel_s = ep4.all_gather_s + ep4.reduce_scatter_s + ep4.all_reduce_s
    step_s = max(ep4.compute_s + ep4.ep_s, data_parallel_s) + data_parallel_s / (A3B.n_layers + 1)
    assert ep4.step_s == pytest.approx(step_s, rel=1e-12)


@pytest.mark.parametrize("tp, ep", [(1, 1), (1, 4), (2, 1), (2, 4)])
def test_replicas_all_reduce_each_ranks_shard_of_the_experts(tp, ep):
    # HSDP 2 x 4 (x TP): a rank's experts are n_experts / ep of them over 4 / (ep / tp) ranks,
    # 1/4 of them all without EP (every TP rank holding the same) and 1/(4 x tp) with it; the
    # dense weights 1/(4 x tp), but for the routers, which every TP rank holds whole (1/4). The
    # replicas all-reduce that shard in fp32.
    counts = param_counts(A3B)
    experts, routers = sum(counts.experts), 48 * 128 * 2048
    timing = _a3b_step(dp_replicate=2, dp_shard=4, tp=tp, ep=ep)
    expert_shard = experts / 4 if ep == 1 else experts / (4 * tp)
    shard = (counts.total - experts - routers) / (4 * tp) + routers / 4 + expert_shard
    assert timing.all_reduce_bytes == pytest.approx(2 * shard * 4 / 2, rel=1e-12)


@pytest.mark.parametrize(
    "shard, tp, ep, gpus_per_node, ep_spans, expert_shard_spans",
    [
        (64, 1, 8, 8, False, True),  # an EP group per node, the experts' FSDP across nodes
        (64, 1, 16, 8, True, True),
        (8, 1, 8, 8, False, False),
        # Under TP 2 an EP group is the 2 tp ranks of ep / 2 shard ranks: ep consecutive ranks.
        (16, 2, 4, 8, False, True),
        (16, 2, 8, 8, False, True),  # one node; the experts' FSDP group strides 8 ranks
        (16, 2, 16, 8, True, True),
    ],
)
def test_ep_group_links(shard, tp, ep, gpus_per_node, ep_spans, expert_shard_spans):
    assert group_spans_nodes(1, shard, tp, gpus_per_node, "ep", ep=ep) is ep_spans
    assert group_spans_nodes(1, shard, tp, gpus_per_node, "expert_shard", ep=ep) is expert_shard_spans


def test_bad_expert_parallel_degrees_are_one_clear_error():
    with pytest.raises(ValueError, match=r"expert_parallel_degree \(3\) must divide .*data_parallel_shard_degree"):
        _a3b_step(ep=3)
    with pytest.raises(ValueError, match=r"expert_parallel_degree \(256\) must divide the model's n_experts \(128\)"):
        _a3b_step(dp_shard=256, ep=256)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        estimate_step_time(QWEN3_FLAVORS["0.6B"], seq_len=64, local_batch_size=1, hardware="h100", dp_shard=2, ep=2)


# --- tensor parallelism: attention split, the MoE layers' tokens split over the TP ranks ------


def test_tp_divides_all_the_flops_the_moe_layers_by_token():
    # By hand: each of 48 MoE layers' router (2048 x 128) and a token's 8 experts of 3 x 2048 x 768.
    moe = 6 * 48 * (2048 * 128 + 8 * 3 * 2048 * 768)
    plain, tp2 = _a3b_step(), _a3b_step(dp_shard=4, tp=2)
    done = plain.flops_per_token + plain.recompute_flops_per_token  # full AC: the MoE's forward again too
    moe_done = moe * 4 / 3
    tokens, speed = 4096, plain.hardware.peak_flops * plain.efficiency
    assert plain.compute_s == pytest.approx(done * tokens / speed, rel=1e-12)
    assert tp2.compute_s == pytest.approx(done / 2 * tokens / speed, rel=1e-12)
    # Each TP rank routes its own half of the sequence through router and experts.
    assert plain.moe_flops_per_token == pytest.approx(moe_done, rel=1e-12)
    assert tp2.moe_flops_per_token == pytest.approx(moe_done / 2, rel=1e-12)
    assert (plain.moe_tokens_per_device_per_micro_batch, tp2.moe_tokens_per_device_per_micro_batch) == (4096, 2048)
    # MFU counts each token's model FLOPs once over the 2 devices sharing it.
    assert tp2.tokens_per_device_per_step == 4096 / 2
    useful_flops_per_s = tp2.flops_per_token * 4096 / 2 / tp2.step_s
    assert tp2.mfu_percent == pytest.approx(100 * useful_flops_per_s / tp2.hardware.peak_flops, rel=1e-12)


def test_pipeline_stage_work_counts_each_stages_moe_layers():
    config = parse_args(["--model.name=qwen3", "--model.flavor=30B-A3B", "--parallelism.pipeline_parallel_degree=4"])
    plan = plan_pipeline(config.parallelism, type(model_on_meta(A3B)), A3B, 8)
    stages = [rank_work(A3B, 4096, 1.0, _one_stage(plan, stage), 2) for stage in range(plan.num_stages)]
    whole = rank_work(A3B, 4096, 1.0, None)
    assert sum(stage.moe_flops for stage in stages) == whole.moe_flops == 6 * param_counts(A3B).moe_active
    assert sum(stage.moe_recompute_flops for stage in stages) == pytest.approx(whole.moe_flops / 3, rel=1e-12)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tp_collectives_of_an_moe_block(sequence_parallel):
    # Per block, in units of one whole [tokens, dim] activation: attention's all-gather and
    # reduce-scatter (all-reduce) both ways, 4; the MoE layer, with sequence parallel, takes and
    # gives the rank's part of the sequence: nothing; without it, it all-gathers its output in
    # forward and its input's gradient in backward: 2. Full AC re-runs attention's 2 per block
    # (the recomputation stops before the block's last collective); the ends 4.
    timing = _a3b_step(dp_shard=4, tp=2, sequence_parallel=sequence_parallel)
    activation = 4096 * 2048 * 2
    per_block, recomputed = (4, 2) if sequence_parallel else (6, 2)
    units = 48 * per_block + 48 * recomputed + 4
    # Every TP rank's gradients of the routers and experts it holds whole are partial sums over
    # its tokens: FSDP all-reduces them over tp (bf16), once in the step's one micro-batch.
    held_whole = 48 * 128 * 2048 + sum(param_counts(A3B).experts)
    assert timing.tp_moe_gradient_bytes == pytest.approx(2 * held_whole * 2 / 2, rel=1e-12)
    activations = (units * activation + 3 * 2 * 4096 * 4) / 2
    assert timing.tp_bytes == pytest.approx(activations + timing.tp_moe_gradient_bytes, rel=1e-12)
    dense = replace(A3B, n_experts=0)  # the same attention with a dense FFN: 8 per block
    dense_timing = estimate_step_time(
        dense,
        seq_len=4096,
        local_batch_size=1,
        hardware="h100",
        dp_shard=4,
        tp=2,
        ac_mode="full",
        sequence_parallel=sequence_parallel,
    )
    dense_recomputed = 3 if sequence_parallel else 2
    expected = 48 * (8 - per_block + dense_recomputed - recomputed) * activation / 2
    assert dense_timing.tp_bytes - activations == pytest.approx(expected)
    # EP over the TP ranks splits the experts: only the routers' gradients are summed.
    with_ep = _a3b_step(dp_shard=4, tp=2, ep=2, sequence_parallel=sequence_parallel)
    assert with_ep.tp_moe_gradient_bytes == pytest.approx(2 * 48 * 128 * 2048 * 2 / 2, rel=1e-12)


def test_all_to_all_under_ep_x_tp_sends_the_tp_ranks_share_of_the_tokens():
    # EP 2 is the TP group: each TP rank routes its 2048 of the data-parallel rank's 4096 tokens
    # and exchanges them with its TP partner, the next rank.
    with_tp = _a3b_step(dp_shard=4, tp=2, ep=2)
    assert with_tp.ep_bytes == pytest.approx(expert_all_to_all_bytes(2048, 8, 2048, 2, 128, 2, 48, 48), rel=1e-12)
    assert with_tp.ep_bytes < _a3b_step(ep=2).ep_bytes / 2 + 48 * 2 * 128 * 8  # half the rows, the same counts
    assert with_tp.ep_bytes == _a3b_step(dp_shard=4, tp=2, ep=2, sequence_parallel=False).ep_bytes
    assert with_tp.ep_link == "intra-node"
    # EP 4 over TP 2 x 2 shard ranks: 4 consecutive ranks, across 2-GPU nodes.
    assert _a3b_step(dp_shard=4, tp=2, ep=4, gpus_per_node=2).ep_link == "inter-node"


def test_simulated_all_to_all_buffers_are_divided_by_tp():
    config = parse_args([*TINY_MOE, "--parallelism.expert_parallel_degree=2"])
    plan = plan_run(config, 4)
    args = QWEN3_FLAVORS["tiny_moe"]
    model = model_on_meta(args)
    with_tp = replace(plan, parallel_dims=replace(plan.parallel_dims, tp=2))
    buffers = 2 * 2 * 64 * args.top_k * args.dim * 2  # all of the rank's 2 x 64 tokens, bf16 rows both ways
    assert expert_parallel_bytes(plan, config, model, None)["buffers"] == buffers
    # Each TP rank routes half of them.
    assert expert_parallel_bytes(with_tp, config, model, None)["buffers"] == buffers // 2


# --- the sweep ---------------------------------------------------------------------------------


def test_sweep_varies_the_expert_parallel_degree(capsys):
    argv = ["--job.config_file", CONFIG, "--sweep", "--sweep_sizes", "8", "--sweep_pp", "1", "--skip_memory"]
    argv += ["--sweep_ep", "1,2,8,3"]
    assert estimate.main([*argv, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    # TP 1, 2 and 4 (8 would split 30B-A3B's 4 key/value heads), each with every EP degree that
    # fits its ranks (all the tp ranks, then some of its 8 / tp shard ranks): 3 divides neither
    # them nor the 128 experts, and TP 4 takes EP 8 only.
    tried = {(1, 1), (1, 2), (1, 8), (2, 1), (2, 2), (2, 8), (4, 1), (4, 8)}
    rows = [(r["layout"]["tp"], r["layout"].get("ep", 1)) for r in results]
    assert set(rows) == tried and len(rows) == len(set(rows))
    assert estimate.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert not any(line.startswith("skipped") for line in lines)
    by_layout = dict(zip(rows, results, strict=True))
    ep2 = by_layout[(1, 2)]["step_time"]
    assert ep2["ep"] == 2 and ep2["ep_bytes"] > 0 and by_layout[(1, 1)]["step_time"]["ep_bytes"] == 0
    # TP 2 sums over tp the gradients of the weights both TP ranks hold whole: without EP the
    # experts' too, with EP 2 (over the two TP ranks) the routers' only.
    tp2, tp2_ep2 = by_layout[(2, 1)]["step_time"], by_layout[(2, 2)]["step_time"]
    assert tp2["tp_moe_gradient_bytes"] > 100 * tp2_ep2["tp_moe_gradient_bytes"] > 0
    # Nor does TP split the experts: 1/4 of them per GPU at TP 2 (8 / 2 shards) is too much for
    # 80 GB; with EP 2 over the TP ranks 1/8.
    assert not by_layout[(2, 1)]["memory_floor"]["fits"] and by_layout[(2, 2)]["memory_floor"]["fits"]
    verdict = lines[-1]
    assert verdict.startswith("8 GPUs: FSDP + EP 1x8x1 ep ") and "EP wins" in verdict and "TP does not" in verdict
    assert math.isfinite(ep2["step_s"])


# --- DeepSeek-V3: what TP holds whole (latent attention's down-projections, shared experts) ---


@pytest.mark.parametrize("flavor", ["16B", "671B"])
def test_deepseek_tp_holds_the_low_rank_projections_and_shared_experts_whole(flavor):
    args = DEEPSEEK_V3_FLAVORS[flavor]
    model = model_on_meta(args)
    attention, moe_block = model.layers["0"].attention, model.layers[str(args.n_layers - 1)]
    # On the meta model: the modules the block's attention_tp_plan marks "replicate" (the
    # query bottleneck only where q_lora_rank is set), and the router and shared experts.
    whole = ["wkv_a", "kv_norm"] + (["wq_a", "q_norm"] if args.q_lora_rank else [])
    per_block = sum(p.numel() for name in whole for p in getattr(attention, name).parameters())
    latent = args.kv_lora_rank + args.qk_rope_head_dim + args.q_lora_rank
    assert per_block == args.dim * latent + args.kv_lora_rank + args.q_lora_rank
    moe = moe_block.feed_forward
    beside_experts = sum(p.numel() for p in moe.parameters()) - sum(p.numel() for p in moe.experts.parameters())
    shared = sum(p.numel() for p in moe.shared_experts.parameters())
    assert shared == 3 * args.dim * args.n_shared_experts * args.moe_hidden_dim
    moe_layers = args.n_layers - args.first_k_dense_replace
    assert held_whole(model) == HeldWhole(
        args.n_layers * per_block, args.n_layers * latent, moe_layers * beside_experts
    )
    # TP 2 splits every FLOP but those of the held-whole projections, which each rank runs on the
    # whole micro-batch: fwd + bwd (6) and full AC's forward again (2) per weight.
    one, two = (rank_work(args, 4096, 1.0, None, tp) for tp in (1, 2))
    replicated = 8 * args.n_layers * per_block
    assert device_flops_per_token(two, 2) == pytest.approx(
        (one.flops + one.recompute_flops - replicated) / 2 + replicated
    )
    # In backward each projection's output gradient is all-reduced over tp: 2 x tokens x features.
    options = dict(seq_len=4096, local_batch_size=1, hardware="h100", dp_shard=4, tp=2, ac_mode="full")
    timing = estimate_step_time(args, **options)
    assert timing.tp_moe_gradient_bytes == pytest.approx(
        2 * 2 * (moe_layers * beside_experts + sum(param_counts(args).experts)) / 2
    )
    blocks = (True, True, args.n_layers, moe_layers)  # sequence and loss parallel, full AC, the MoE blocks
    without = tensor_parallel_bytes(args, 4096, 2, 2, *blocks)
    held_sums = 2 * 4096 * args.n_layers * latent * 2 / 2
    assert timing.tp_bytes == pytest.approx(without + held_sums + timing.tp_moe_gradient_bytes)


@pytest.mark.parametrize("name, world_size", [("deepseek_v3_16b", 8), ("deepseek_v3_671b", 512)])
def test_deepseek_configs_plan_and_estimate_what_their_comments_say(name, world_size):
    # The shipped layout plans on its GPUs (the trainer's own checks, as --job.validate_only
    # runs them), and the step estimate is the one the config's comment quotes from the sweep.
    path = Path(__file__).resolve().parent.parent / "train_configs" / f"{name}.toml"
    job_config = parse_args(["--job.config_file", str(path)])
    plan_run(job_config, world_size)
    quoted = re.search(r"([\d,]+) tokens/s/GPU", path.read_text().split("[parallelism]")[1]).group(1)
    timing = estimate_for_job_config(job_config, world_size, "h100")
    assert f"{timing.tokens_per_second_per_device:,.0f}" == quoted


def test_a_float32_moe_is_simulated_with_its_rows_split_evenly_and_holds_what_it_really_holds():
    """float32 runs the experts as a loop that reads the routed counts on the host; the fake
    tensors of the simulation have no values, so the simulated loop splits the rows evenly.
    Its tensors have the same sizes whatever the split: the estimate is what one real
    process holds."""
    argv = [*TINY_MOE, "--training.mixed_precision_param=float32"]
    estimate = estimate_memory(parse_args(argv), 1, "cpu")
    real = measure_real_memory(parse_args(argv))
    for name in ("parameters", "gradients", "optimizer_state"):
        assert real[name] == getattr(estimate.measured, name), name
    assert estimate.activations == pytest.approx(real["activations"], rel=0.02)
    assert estimate.peak_bytes == pytest.approx(real["peak"], rel=0.02)
