"""The step-time model (titanlite.estimate.step_time) and the hardware table
(titanlite.estimate.hardware): the roofline threshold C / W (compute over communication bandwidth), FSDP vs HSDP traffic
worked out by hand, the link each group uses, the verdict, and the error messages."""

import dataclasses

import pytest

from titanlite.config import JobConfig
from titanlite.estimate import (
    HARDWARE,
    estimate_for_job_config,
    estimate_step_time,
    get_hardware,
    parse_hardware_overrides,
    threshold_tokens_per_device,
)
from titanlite.metrics import count_params, flops_per_token, peak_flops_per_device
from titanlite.models.llama.args import LLAMA2_FLAVORS, LLAMA3_FLAVORS

LLAMA2_7B = LLAMA2_FLAVORS["7B"]
N_7B = count_params(LLAMA2_7B)  # every parameter, embedding included: FSDP moves them all
# Llama-2 7B by hand: 4 x 4096^2 attention + 3 x 4096 x 11008 SwiGLU + 2 x 4096 norms per
# block; root unit = embedding + output (2 x 32000 x 4096) + final norm (4096).
BLOCK_7B = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
ROOT_7B = 2 * 32000 * 4096 + 4096


def estimate(**kwargs):
    """Llama-2 7B on H100s, seq 2048, one sequence per device, unless told otherwise."""
    options = dict(seq_len=2048, local_batch_size=1, hardware="h100")
    options.update(kwargs)
    return estimate_step_time(options.pop("model_args", LLAMA2_7B), **options)


# --- the roofline threshold C / W ----------------------------------------------------------------


def test_threshold_reproduces_the_published_tpu_v2_number():
    # Seed: C = 4.5e13 FLOP/s, W_ici = 2.48e11 B/s -> B/X > C/W ~ 181 tokens per chip,
    # and ~46K tokens for a 256-chip pod.
    threshold = threshold_tokens_per_device(4.5e13, 2.48e11)
    assert round(threshold) == 181
    assert round(threshold * 256, -3) == 46_000


def test_threshold_reproduces_the_published_fsdp_2550():
    # The published roofline rule for FSDP: "the same condition: B/X > C/W = 2550", with no
    # chip named; 2550 is TPU v5p's (4.59e14 bf16 FLOP/s over 1.8e11 B/s of ICI) in How To
    # Scale Your Model, which that rule follows.
    assert threshold_tokens_per_device(4.59e14, 1.8e11) == pytest.approx(2550)


def test_threshold_through_hardware_overrides_matches_the_published_rule():
    tpu_like = get_hardware("h100", peak_flops=4.5e13, intra_node_bw=2.48e11)
    result = estimate(hardware=tpu_like, dp_shard=8)
    assert result.threshold_tokens_per_device == pytest.approx(4.5e13 / 2.48e11)


def test_h100_threshold_is_c_over_w_of_the_link_the_fsdp_group_uses():
    inside_a_node = estimate(dp_shard=8)
    across_nodes = estimate(dp_shard=64)
    assert inside_a_node.threshold_tokens_per_device == pytest.approx(989e12 / 450e9)  # ~2,198
    assert across_nodes.threshold_tokens_per_device == pytest.approx(989e12 / 50e9)  # 19,780
    assert round(across_nodes.threshold_tokens_per_device) == 19_780
    # Pure DDP's heavy traffic is the replicate all-reduce; one device has no traffic.
    assert estimate(dp_replicate=16, dp_shard=1).threshold_tokens_per_device == pytest.approx(19_780)
    assert estimate(dp_shard=1).threshold_tokens_per_device is None


def test_break_even_is_c_over_w_in_the_rules_own_setting():
    # The rule's own setting: bf16 weights and gradients, every weight gathered in forward
    # and backward and its gradient reduce-scattered (6 bytes per parameter, like the
    # all-reduce's 2 x 2 bytes plus forward's 2), no recomputation, full peak. Then
    # compute = F x t / C and comm = 6 N (n-1)/n / W, so t* = C/W x 6 N (n-1)/n / F.
    result = estimate(
        dp_shard=64, reduce_dtype="bfloat16", reshard_after_forward="always", ac_mode="none", efficiency=1.0
    )
    c_over_w = 989e12 / 50e9
    flops = flops_per_token(LLAMA2_7B, 2048)
    assert result.break_even_tokens_per_device == pytest.approx(c_over_w * 6 * N_7B * 63 / 64 / flops)
    # ... which is C/W to within the embedding's and attention's shares (a few percent).
    assert result.break_even_tokens_per_device == pytest.approx(c_over_w, rel=0.05)


def test_verdict_flips_when_tokens_per_device_cross_the_threshold():
    setting = dict(
        seq_len=1024,
        dp_shard=64,
        reduce_dtype="bfloat16",
        reshard_after_forward="always",
        ac_mode="none",
        efficiency=1.0,
    )
    break_even = estimate(**setting).break_even_tokens_per_device
    below = int(break_even // 1024)
    assert estimate(local_batch_size=below, **setting).verdict == "communication-bound"
    assert estimate(local_batch_size=below + 1, **setting).verdict == "compute-bound"
    # Well either side of C / W the verdict agrees with the roofline rule.
    c_over_w = 989e12 / 50e9
    assert estimate(local_batch_size=int(0.5 * c_over_w / 1024), **setting).verdict == "communication-bound"
    assert estimate(local_batch_size=int(2 * c_over_w / 1024), **setting).verdict == "compute-bound"


# --- 8-way vs 64-way FSDP vs HSDP traffic, by hand -----------------------------------------------


def test_fsdp_8_way_traffic_by_hand():
    # bf16 params gathered twice (forward + backward), fp32 gradients reduce-scattered.
    result = estimate(dp_shard=8, reshard_after_forward="always")
    assert result.all_gather_bytes == pytest.approx(2 * N_7B * 2 * 7 / 8)
    assert result.reduce_scatter_bytes == pytest.approx(N_7B * 4 * 7 / 8)
    assert result.all_reduce_bytes == 0
    assert result.comm_s == pytest.approx((2 * N_7B * 2 + N_7B * 4) * 7 / 8 / 450e9)


def test_fsdp_64_way_traffic_by_hand():
    result = estimate(dp_shard=64, reshard_after_forward="always")
    assert result.all_gather_bytes == pytest.approx(2 * N_7B * 2 * 63 / 64)
    assert result.reduce_scatter_bytes == pytest.approx(N_7B * 4 * 63 / 64)
    assert result.all_reduce_bytes == 0
    # All of it crosses nodes: 7.875 N bytes at 50 GB/s.
    assert result.comm_s == pytest.approx(7.875 * N_7B / 50e9)


def test_hsdp_8x8_traffic_by_hand():
    result = estimate(dp_replicate=8, dp_shard=8, reshard_after_forward="always")
    # Inside each node: the same traffic as 8-way FSDP.
    assert result.all_gather_bytes == pytest.approx(2 * N_7B * 2 * 7 / 8)
    assert result.reduce_scatter_bytes == pytest.approx(N_7B * 4 * 7 / 8)
    # Across nodes: one all-reduce of the 1/8 gradient shard in fp32 over 8 replicas.
    assert result.all_reduce_bytes == pytest.approx(2 * (N_7B / 8) * 4 * 7 / 8)
    assert result.all_reduce_s == pytest.approx(0.875 * N_7B / 50e9)
    assert result.comm_s == pytest.approx(7 * N_7B / 450e9 + 0.875 * N_7B / 50e9)
    # HSDP sends 9x fewer bytes over the network than 64-way FSDP (7.875 N vs 0.875 N).
    fsdp_64 = estimate(dp_shard=64, reshard_after_forward="always")
    inter_fsdp = fsdp_64.all_gather_bytes + fsdp_64.reduce_scatter_bytes
    assert inter_fsdp / result.all_reduce_bytes == pytest.approx(9)
    assert result.comm_s < fsdp_64.comm_s / 4


def test_three_intra_group_collectives_and_one_inter_group():
    # Seed: "3 collectives x layers" inside the group, "1 all_reduce at the end" across
    # groups. With one dtype (bf16) each intra-group collective moves one model's worth.
    result = estimate(dp_replicate=8, dp_shard=8, reduce_dtype="bfloat16", reshard_after_forward="always")
    one_model = N_7B * 2 * 7 / 8
    assert result.all_gather_bytes + result.reduce_scatter_bytes == pytest.approx(3 * one_model)
    assert result.all_reduce_bytes == pytest.approx(2 * N_7B / 8 * 2 * 7 / 8)


def test_default_reshard_skips_the_last_block_and_root_in_backward():
    assert BLOCK_7B == 202_383_360
    default = estimate(dp_shard=8)
    assert default.all_gather_bytes == pytest.approx((2 * N_7B - BLOCK_7B - ROOT_7B) * 2 * 7 / 8)
    never = estimate(dp_shard=8, reshard_after_forward="never")
    assert never.all_gather_bytes == pytest.approx(N_7B * 2 * 7 / 8)


def test_gradient_accumulation_repeats_fsdp_traffic_but_not_the_all_reduce():
    one = estimate(dp_replicate=8, dp_shard=8)
    four = estimate(dp_replicate=8, dp_shard=8, grad_accum_steps=4)
    assert four.all_gather_bytes == pytest.approx(4 * one.all_gather_bytes)
    assert four.reduce_scatter_bytes == pytest.approx(4 * one.reduce_scatter_bytes)
    assert four.all_reduce_bytes == pytest.approx(one.all_reduce_bytes)
    assert four.tokens_per_device_per_step == 4 * one.tokens_per_device_per_step
    assert four.compute_s == pytest.approx(4 * one.compute_s)


def test_ddp_is_one_full_all_reduce():
    result = estimate(dp_replicate=16, dp_shard=1)
    assert result.strategy == "DDP"
    assert result.all_gather_bytes == result.reduce_scatter_bytes == 0
    assert result.all_reduce_bytes == pytest.approx(2 * N_7B * 4 * 15 / 16)


# --- which link a group uses -------------------------------------------------------------------


@pytest.mark.parametrize(
    "replicate, shard, gpus_per_node, shard_link, replicate_link",
    [
        (1, 8, 8, "intra-node", "none"),  # 8-way FSDP: one node
        (1, 64, 8, "inter-node", "none"),  # 64-way FSDP spans 8 nodes
        (8, 8, 8, "intra-node", "inter-node"),  # HSDP: shard in a node, replicas across
        (2, 4, 8, "intra-node", "intra-node"),  # HSDP inside one node
        (1, 8, 4, "inter-node", "none"),  # 8-way FSDP on 4-GPU nodes
        (4, 3, 8, "inter-node", "inter-node"),  # shard group of 3 straddles ranks 6-8
        (2, 3, 8, "intra-node", "intra-node"),  # 6 ranks, one node
        (16, 1, 8, "none", "inter-node"),  # DDP over 2 nodes
    ],
)
def test_link_choice(replicate, shard, gpus_per_node, shard_link, replicate_link):
    result = estimate(dp_replicate=replicate, dp_shard=shard, gpus_per_node=gpus_per_node)
    assert (result.shard_link, result.replicate_link) == (shard_link, replicate_link)
    assert result.hardware.gpus_per_node == gpus_per_node


# --- compute, recomputation, step time and MFU ---------------------------------------------------


def test_single_device_has_no_communication_and_mfu_equals_efficiency():
    result = estimate(dp_shard=1, ac_mode="none", efficiency=0.4)
    assert result.strategy == "single process"
    assert result.comm_s == result.exposed_comm_s == 0
    assert result.step_s == result.compute_s
    assert result.verdict == "compute-bound"
    assert result.mfu_percent == pytest.approx(40.0)
    flops = flops_per_token(LLAMA2_7B, 2048)
    assert result.compute_s == pytest.approx(flops * 2048 / (989e12 * 0.4))
    assert result.tokens_per_second_per_device == pytest.approx(989e12 * 0.4 / flops)


def test_recompute_flops_per_activation_checkpointing_mode():
    args = LLAMA3_FLAVORS["8B"]
    flops = flops_per_token(args, 2048)
    blocks_forward = (flops - 6 * (4096 + 4096 * 128256)) / 3
    full = estimate(model_args=args, dp_shard=1, ac_mode="full")
    assert full.recompute_flops_per_token == pytest.approx(blocks_forward)
    # A little under +1 forward (8/6): the output projection is not recomputed.
    assert 1.25 < (full.flops_per_token + full.recompute_flops_per_token) / full.flops_per_token < 8 / 6
    every_3rd = estimate(model_args=args, dp_shard=1, ac_mode="selective", selective_ac_option="3")
    assert every_3rd.recompute_flops_per_token == pytest.approx(blocks_forward * 11 / 32)  # blocks 0,3,...,30
    for mode, option in (("none", "2"), ("selective", "op")):
        assert (
            estimate(model_args=args, dp_shard=1, ac_mode=mode, selective_ac_option=option).recompute_flops_per_token
            == 0
        )
    # MFU counts model FLOPs only, so recomputation lowers it.
    assert full.mfu_percent < estimate(model_args=args, dp_shard=1, ac_mode="none").mfu_percent


def test_step_time_overlaps_communication_and_adds_the_exposed_part():
    result = estimate(dp_shard=64)
    assert result.overlapped
    assert result.exposed_comm_s == pytest.approx(result.comm_s / (32 + 1))  # one FSDP unit's share
    assert result.step_s == pytest.approx(max(result.compute_s, result.comm_s) + result.exposed_comm_s)
    assert result.tokens_per_second_per_device == pytest.approx(2048 / result.step_s)
    assert "tokens/s/device" in result.describe()


# --- hardware table ------------------------------------------------------------------------


def test_table_peaks_come_from_the_metrics_table():
    names = {
        "h100": "NVIDIA H100 80GB HBM3",
        "h200": "NVIDIA H200",
        "a100": "NVIDIA A100-SXM4-80GB",
        "b200": "NVIDIA B200",
        "mi300x": "AMD Instinct MI300X",
        "l40s": "NVIDIA L40S",
    }
    assert set(names) <= set(HARDWARE)
    for key, device_name in names.items():
        assert HARDWARE[key].peak_flops == peak_flops_per_device(device_name)
    h100 = HARDWARE["h100"]
    assert (h100.peak_flops, h100.memory_bytes, h100.intra_node_bw, h100.inter_node_bw) == (
        989e12,
        80 * 2**30,
        450e9,
        50e9,
    )


def test_unknown_hardware_names_the_choices_and_suggests_one():
    with pytest.raises(
        ValueError, match=r"hardware 'h1000' is not known \(choose from h100, .*\); did you mean 'h100'\?"
    ):
        get_hardware("h1000")
    with pytest.raises(ValueError, match="hardware 'tpu' is not known"):
        estimate(hardware="tpu")


def test_hardware_names_are_forgiving_and_overrides_replace_fields():
    assert get_hardware("H100") == get_hardware("h-100") == HARDWARE["h100"]
    slower = get_hardware("h100", inter_node_bw=25e9, gpus_per_node=4, peak_flops=None)
    assert (slower.inter_node_bw, slower.gpus_per_node, slower.peak_flops) == (25e9, 4, 989e12)
    assert dataclasses.replace(HARDWARE["h100"], inter_node_bw=25e9, gpus_per_node=4) == slower
    # Halving the network doubles 64-way FSDP's communication time.
    fast, slow = estimate(dp_shard=64), estimate(dp_shard=64, hardware=get_hardware("h100", inter_node_bw=25e9))
    assert slow.comm_s == pytest.approx(2 * fast.comm_s)


def test_bad_overrides_are_clear():
    with pytest.raises(
        ValueError, match=r"hardware field 'inter_node_bandwidth' is not known .*did you mean 'inter_node_bw'"
    ):
        get_hardware("h100", inter_node_bandwidth=1e9)
    with pytest.raises(ValueError, match="hardware peak_flops must be a positive number, got -1"):
        get_hardware("h100", peak_flops=-1)
    with pytest.raises(ValueError, match="gpus_per_node must be a whole number"):
        get_hardware("h100", gpus_per_node=2.5)


def test_command_line_overrides_parse():
    assert parse_hardware_overrides(["inter_node_bw=25e9", " gpus_per_node=4"]) == {
        "inter_node_bw": 25e9,
        "gpus_per_node": 4,
    }
    with pytest.raises(ValueError, match="must look like field=value"):
        parse_hardware_overrides(["inter_node_bw"])
    with pytest.raises(ValueError, match="'fast' is not a number"):
        parse_hardware_overrides(["inter_node_bw=fast"])


# --- bad input --------------------------------------------------------------------------------


def test_world_size_not_matching_the_degrees():
    with pytest.raises(
        ValueError,
        match=r"data_parallel_replicate_degree \(2\) x .*data_parallel_shard_degree \(8\) "
        r"must equal the world size \(8\)",
    ):
        estimate(dp_replicate=2, dp_shard=8, world_size=8)
    # -1 takes the ranks left over, but only with a world size.
    assert estimate(dp_replicate=2, dp_shard=-1, world_size=16).dp_shard == 8
    with pytest.raises(ValueError, match="needs world_size"):
        estimate(dp_replicate=2, dp_shard=-1)
    with pytest.raises(ValueError, match="cannot both be -1"):
        estimate(dp_replicate=-1, dp_shard=-1, world_size=8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dp_shard=0), "dp_shard must be a positive integer or -1, got 0"),
        (dict(dp_replicate=-2), "dp_replicate must be a positive integer or -1, got -2"),
        (dict(seq_len=0), "seq_len must be a positive integer, got 0"),
        (dict(local_batch_size=1.5), "local_batch_size must be a positive integer, got 1.5"),
        (dict(grad_accum_steps=0), "grad_accum_steps must be a positive integer"),
        (dict(gpus_per_node=0), "gpus_per_node must be a positive integer"),
        (
            dict(reshard_after_forward="sometimes"),
            r"reshard_after_forward 'sometimes' is not known \(choose from default, always, never\)",
        ),
        (dict(ac_mode="partial"), "ac_mode 'partial' is not known"),
        (dict(param_dtype="float16"), "param_dtype 'float16' is not known"),
        (dict(ac_mode="selective", selective_ac_option="0"), "selective_ac_option must be 'op' or a positive integer"),
        (dict(efficiency=0), r"efficiency must be in \(0, 1\]"),
        (dict(efficiency=1.5), r"efficiency must be in \(0, 1\]"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate(**kwargs)


def test_estimate_from_a_job_config():
    config = JobConfig()  # llama3 debugmodel, seq 2048, local batch 8, shard -1, selective AC
    config.training.global_batch_size = 64
    result = estimate_for_job_config(config, world_size=4, hardware="a100")
    assert (result.strategy, result.dp_shard, result.tokens_per_device_per_step) == ("FSDP", 4, 2 * 8 * 2048)
    assert result.hardware.name == "a100"
    config.parallelism.data_parallel_replicate_degree = 3
    config.parallelism.data_parallel_shard_degree = 2
    with pytest.raises(ValueError, match=r"must equal the world size \(4\)"):
        estimate_for_job_config(config, world_size=4, hardware="a100")
    config.parallelism.data_parallel_replicate_degree = 2
    config.training.global_batch_size = 20
    with pytest.raises(ValueError, match="must be a multiple"):
        estimate_for_job_config(config, world_size=4, hardware="a100")
