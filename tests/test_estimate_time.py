"""The step-time model (titanlite.estimate.step_time) and the hardware table
(titanlite.estimate.hardware): the roofline threshold C / W (compute over communication bandwidth), FSDP vs HSDP traffic
worked out by hand, TP's collectives against what DTensor really sends, the link each group uses, the verdict, and
the error messages."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import TINY
from titanlite.config import JobConfig, parse_args
from titanlite.estimate import (
    HARDWARE,
    estimate_for_job_config,
    estimate_step_time,
    get_hardware,
    parse_hardware_overrides,
    threshold_tokens_per_device,
)
from titanlite.estimate.communication import ring_bytes
from titanlite.estimate.context_parallel import kv_gather_bytes, kv_sent_bytes
from titanlite.estimate.float8 import FLOAT8_CAST_OVERHEAD
from titanlite.estimate.tensor_parallel import recomputed_collective_blocks, tensor_parallel_bytes
from titanlite.loss import cross_entropy_sum
from titanlite.metrics import count_params, flops_per_token, peak_flops_per_device
from titanlite.models.llama.args import LLAMA2_FLAVORS, LLAMA3_FLAVORS
from titanlite.models.llama.model import Attention
from titanlite.models.qwen3 import QWEN3_FLAVORS
from titanlite.parallel import loss_context
from titanlite.plan import build_model, plan_run

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


# --- tensor parallelism --------------------------------------------------------------------


class _CollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends in DTensor's collectives (ring volumes, as the estimator counts
    them). DTensor runs first (NotImplemented), so the mode sees the collectives it issues."""

    ROUNDS = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 2}

    def __init__(self):
        super().__init__()
        self.sent = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace != "_c10d_functional" or name not in self.ROUNDS:
            return out
        size, n = args[0].numel() * args[0].element_size(), _resolve_process_group(args[-1]).size()
        # An all-gather's input is this rank's piece, a reduce-scatter's or all-reduce's the whole.
        self.sent += size * (n - 1) if name == "all_gather_into_tensor" else self.ROUNDS[name] * ring_bytes(size, n)
        return out


def _measured_tp_bytes(world_size: int, argv: list[str], model: tuple[str, str]) -> tuple[float, float]:
    """(bytes this rank sent in TP's collectives during one forward + backward of ``model``
    (its name and flavor options) on a fake process group, the norms' gradient reductions
    among them)."""
    config = parse_args([*model, *argv])
    plan = plan_run(config, world_size)
    _clear_sharding_prop_cache()  # DTensor's cache would carry meshes across fake groups
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = build_model(config, plan, plan.parallel_dims.build_mesh("cpu"), device="cpu")
        # A cp rank's columns of each sequence (all of them without CP).
        batch = (config.training.local_batch_size, config.training.seq_len // plan.parallel_dims.cp)
        tokens = torch.randint(0, plan.model_args.vocab_size, batch)
        with _CollectiveBytes() as sent, loss_context(plan.parallel_dims, config):
            cross_entropy_sum(model(tokens), tokens).backward()
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()
    norms = sum(1 for p in model.parameters() if p.dim() == 1)
    # Under FSDP the norms' gradients, partial sums over the TP group, are all-reduced in
    # backward (without FSDP clipping does it): 2L + 1 vectors, which the estimator leaves out.
    norm_reductions = norms * 2 * ring_bytes(plan.model_args.dim * 4, 2) if plan.parallel_dims.fsdp_applied else 0.0
    return sent.sent, norm_reductions


# The MoE model's blocks are MoE blocks, which TP holds whole: attention's collectives, and with
# sequence parallel the MoE input's all-gather and its output gradient's, nothing else.
SEQUENCE_PARALLEL = "parallelism.enable_sequence_parallel"
_TP_MODELS = {"llama3": ("tiny", TINY), "qwen3": ("tiny_moe", QWEN3_FLAVORS["tiny_moe"])}


@pytest.mark.parametrize(
    "world_size, model, options",
    [
        (2, "llama3", {"activation_checkpoint.mode": "none"}),
        (2, "llama3", {"activation_checkpoint.mode": "full", "parallelism.enable_sequence_parallel": "false"}),
        (2, "llama3", {"activation_checkpoint.selective_ac_option": "op", "parallelism.disable_loss_parallel": "true"}),
        (2, "llama3", {"activation_checkpoint.selective_ac_option": "2", SEQUENCE_PARALLEL: "false"}),
        (4, "llama3", {"activation_checkpoint.mode": "full"}),  # FSDP 2 x TP 2
        (2, "qwen3", {"activation_checkpoint.mode": "full"}),
        (2, "qwen3", {"activation_checkpoint.mode": "none", "parallelism.enable_sequence_parallel": "false"}),
    ],
)
def test_tensor_parallel_bytes_are_what_dtensor_sends(world_size, model, options):
    """The estimator's TP volumes against the collectives the real TP plan issues (float32, so
    the activations are 4 bytes), per block, recomputation, embedding/output and logits."""
    flavor, args = _TP_MODELS[model]
    settings = {"training.seq_len": "16", "training.local_batch_size": "2", "training.mixed_precision_param": "float32"}
    settings |= {"parallelism.tensor_parallel_degree": "2", **options}
    argv = [f"--{key}={value}" for key, value in settings.items()]
    config = parse_args(argv)
    model_options = (f"--model.name={model}", f"--model.flavor={flavor}")
    measured, norm_reductions = _measured_tp_bytes(world_size, argv, model_options)
    parallelism, ac = config.parallelism, config.activation_checkpoint
    expected = tensor_parallel_bytes(
        args,
        tokens=2 * 16,
        activation_bytes=4,
        tp=2,
        sequence_parallel=parallelism.enable_sequence_parallel,
        loss_parallel=not parallelism.disable_loss_parallel,
        recomputed_blocks=recomputed_collective_blocks(args.n_layers, ac.mode, ac.selective_ac_option),
        moe_blocks=args.n_layers if getattr(args, "n_experts", 0) else 0,
    )
    assert measured - norm_reductions == pytest.approx(expected)


def test_tp_8_traffic_by_hand():
    """Llama 3 8B, seq 8192, one sequence per data-parallel rank, TP 2 x FSDP 4 in one node,
    no recomputation: the TP group splits the FLOPs and the weights FSDP moves."""
    args = LLAMA3_FLAVORS["8B"]
    n = count_params(args)
    result = estimate(model_args=args, seq_len=8192, dp_shard=4, tp=2, ac_mode="none", reshard_after_forward="always")
    assert (result.strategy, result.world_size, result.tp_link, result.shard_link) == (
        "FSDP + TP",
        8,
        "intra-node",
        "intra-node",
    )
    activation = 8192 * 4096 * 2  # one [1, 8192, 4096] bf16 activation
    per_block, ends, loss_parallel = 8 * activation, 4 * activation, 3 * 2 * 8192 * 4
    assert result.tp_bytes == pytest.approx((32 * per_block + ends + loss_parallel) / 2)
    assert result.tp_s == pytest.approx(result.tp_bytes / 450e9)
    # FSDP over 4 moves each device's half of the weights: gathered twice (bf16), reduced once (fp32).
    assert result.all_gather_bytes == pytest.approx(2 * n / 2 * 2 * 3 / 4)
    assert result.reduce_scatter_bytes == pytest.approx(n / 2 * 4 * 3 / 4)
    assert result.tokens_per_device_per_step == 4096
    assert result.compute_s == pytest.approx(flops_per_token(args, 8192) * 4096 / (989e12 * 0.5))
    # TP's collectives wait between the matmuls: added to compute, then FSDP overlaps both.
    data_parallel = result.all_gather_s + result.reduce_scatter_s + result.all_reduce_s
    assert result.step_s == pytest.approx(max(result.compute_s + result.tp_s, data_parallel) + data_parallel / 33)
    assert result.comm_s == pytest.approx(data_parallel + result.tp_s)
    # Async TP hides them under the matmuls.
    hidden = estimate(
        model_args=args, seq_len=8192, dp_shard=4, tp=2, ac_mode="none", reshard_after_forward="always", async_tp=True
    )
    assert hidden.step_s == pytest.approx(max(result.compute_s, data_parallel) + data_parallel / 33)


def test_without_loss_parallel_the_logits_are_gathered():
    args = LLAMA3_FLAVORS["8B"]
    with_loss_parallel = estimate(model_args=args, seq_len=8192, dp_shard=1, tp=8)
    gathered = estimate(model_args=args, seq_len=8192, dp_shard=1, tp=8, loss_parallel=False)
    logits = 8192 * 128256 * 2 * 7 / 8  # bf16 [8192, 128256] logits, all-gathered over 8
    assert gathered.tp_bytes - with_loss_parallel.tp_bytes == pytest.approx(logits - 3 * 2 * 8192 * 4 * 7 / 8)
    # Sequence parallel changes which collectives, not their bytes (recomputation aside).
    no_recompute = dict(model_args=args, seq_len=8192, dp_shard=1, tp=8, ac_mode="none")
    assert estimate(**no_recompute).tp_bytes == estimate(**no_recompute, sequence_parallel=False).tp_bytes


@pytest.mark.parametrize(
    "replicate, shard, tp, gpus_per_node, links",
    [
        (1, 4, 2, 8, ("intra-node", "none", "intra-node")),  # 8 GPUs, one node
        (1, 32, 2, 8, ("inter-node", "none", "intra-node")),  # FSDP across 8 nodes, TP pairs inside
        (8, 4, 2, 8, ("intra-node", "inter-node", "intra-node")),  # HSDP + TP: only replicas cross
        (8, 1, 8, 8, ("none", "inter-node", "intra-node")),  # DDP + TP 8: one TP group per node
        (1, 2, 8, 4, ("inter-node", "none", "inter-node")),  # TP 8 on 4-GPU nodes straddles two
    ],
)
def test_link_choice_with_tensor_parallelism(replicate, shard, tp, gpus_per_node, links):
    result = estimate(
        model_args=LLAMA3_FLAVORS["8B"], dp_replicate=replicate, dp_shard=shard, tp=tp, gpus_per_node=gpus_per_node
    )
    assert (result.shard_link, result.replicate_link, result.tp_link) == links


def test_tensor_parallel_degree_must_suit_the_model_and_the_world():
    with pytest.raises(ValueError, match=r"tensor_parallel_degree \(3\) must divide the model's attention heads"):
        estimate(dp_shard=1, tp=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_degree \(16\) must divide the model's key/value heads"):
        estimate(model_args=LLAMA3_FLAVORS["8B"], dp_shard=1, tp=16)
    with pytest.raises(ValueError, match=r"must divide the world size \(12\)"):
        estimate(dp_shard=-1, tp=8, world_size=12)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        estimate(tp=0)


def test_estimate_from_a_job_config_with_tensor_parallelism():
    config = JobConfig()  # llama3 debugmodel: 16 heads, 4 key/value heads
    config.parallelism.tensor_parallel_degree = 4
    config.parallelism.disable_loss_parallel = True
    config.parallelism.enable_sequence_parallel = False
    result = estimate_for_job_config(config, world_size=8, hardware="h100")
    assert (result.strategy, result.dp_shard, result.tp) == ("FSDP + TP", 2, 4)
    assert (result.sequence_parallel, result.loss_parallel, result.async_tp) == (False, False, False)
    assert result.tokens_per_device_per_step == 8 * 2048 / 4
    assert "x 4 TP" in result.describe()


# --- float8 ------------------------------------------------------------------------------


def test_the_step_time_estimate_runs_converted_matmuls_at_the_float8_peak():
    base = ["--model.flavor", "8B", "--training.seq_len", "8192", "--training.local_batch_size", "1"]
    bf16 = estimate_for_job_config(parse_args(base), world_size=8, hardware="h100")
    float8 = estimate_for_job_config(parse_args([*base, "--model.converters", "float8"]), world_size=8, hardware="h100")
    # 8B with selective AC every 2nd block: wq, wo, w1, w2, w3 of every block convert (wk and wv,
    # 1024 outputs, are too small), so 6 + 2 x 1/2 FLOPs per converted weight and token.
    per_block = 2 * 4096 * 4096 + 3 * 4096 * 14336
    converted_flops = (6 + 2 * 0.5) * per_block * 32
    bf16_seconds = converted_flops * 8192 / (bf16.hardware.peak_flops * bf16.efficiency)
    saved = bf16_seconds * (1 - 0.5 * (1 + FLOAT8_CAST_OVERHEAD))
    assert float8.float8_saved_s == pytest.approx(saved, rel=1e-9)
    assert float8.compute_s == pytest.approx(bf16.compute_s - saved, rel=1e-9)
    assert float8.mfu_percent > bf16.mfu_percent and float8.flops_per_token == bf16.flops_per_token
    assert "float8 matmuls take" in float8.describe() and "float8" not in bf16.describe()
    with pytest.raises(ValueError, match="a100 has no float8 matmuls"):
        estimate_for_job_config(parse_args([*base, "--model.converters", "float8"]), world_size=8, hardware="a100")


# --- context parallelism --------------------------------------------------------------------


def test_key_value_bytes_are_what_the_context_parallel_kernel_sends():
    """The estimator's keys and values (from the attention class's kernel_kv_features: the
    tiny Llama's 2 key/value heads of 4 query heads) against the all-gathers and the gradients'
    reduce-scatters the real CP kernel issues over a fake process group, with full AC's
    recomputed forward gathering again."""
    argv = ["--training.seq_len=16", "--training.local_batch_size=2", "--training.mixed_precision_param=float32"]
    argv += ["--parallelism.context_parallel_degree=2", "--activation_checkpoint.mode=full"]
    measured, _ = _measured_tp_bytes(2, argv, ("--model.name=llama3", "--model.flavor=tiny"))
    gathered = kv_gather_bytes(Attention.kernel_kv_features(TINY), 2, 16, tp=1, cp=2, dtype_bytes=4)
    assert gathered == 2 * 16 * 2 * TINY.n_kv_heads * TINY.head_dim * 4
    assert measured == pytest.approx(kv_sent_bytes(gathered, 2, TINY.n_layers, recomputed_blocks=TINY.n_layers))


def test_step_time_under_context_parallelism_by_hand():
    """Llama 3 8B at 131,072 tokens on 64 H100: CP 8 keeps each sequence in a node, FSDP
    shards over dp_shard x cp = 64 as without CP, each rank does seq_len / 8 tokens and 1/8 of
    the causal attention (its kernel skips what the mask drops), and each forward all-gather
    runs behind the attention on the rank's own keys, 1/8 of its attention; under TP 2 the cp
    group spans two nodes."""
    args, seq = LLAMA3_FLAVORS["8B"], 131072
    options = dict(model_args=args, seq_len=seq, world_size=64, ac_mode="full")
    plain = estimate(**options)
    kv = 2 * args.n_kv_heads * args.head_dim
    cp = estimate(**options, cp=8, kv_features=kv)
    assert (cp.strategy, cp.dp_shard, cp.cp, cp.cp_link) == ("FSDP + CP", 8, 8, "intra-node")
    assert (cp.all_gather_bytes, cp.shard_link) == (plain.all_gather_bytes, plain.shard_link)
    assert cp.tokens_per_device_per_step == seq / 8
    gathered = seq * kv * 2  # one sequence's keys and values in bf16, per layer
    assert cp.kv_gathered_bytes == gathered
    assert cp.cp_bytes == pytest.approx((2 + 1) * args.n_layers * gathered * 7 / 8)
    assert cp.compute_s == pytest.approx(plain.compute_s / 8, rel=1e-9)  # the same FLOPs per token
    rate = plain.hardware.peak_flops * plain.efficiency
    gather_s = gathered * 7 / 8 / plain.hardware.intra_node_bw
    own_keys_s = 6 * args.n_heads * args.head_dim * seq / 3 * (seq / 8) / 8 / rate  # a layer's forward, 1/8
    forwards = 2 * args.n_layers  # full AC gathers again in each recomputed forward
    assert cp.cp_hidden_s == pytest.approx(forwards * min(gather_s, own_keys_s))
    assert cp.cp_hidden_s > 0
    assert "CP 8: keys and values all-gathered" in cp.describe()
    assert estimate(**options, cp=8, kv_features=kv, tp=2).cp_link == "inter-node"
    with pytest.raises(ValueError, match="needs kv_features"):
        estimate(**options, cp=8)


def test_the_long_context_config_states_its_own_estimate():
    """train_configs/llama3_8b_128k.toml's comment gives the step-time estimate of its layout on
    64 H100s, the sweep's choice, FSDP 16 x CP 4 (its memory comes from the sweep it names, too
    slow for a test)."""
    path = Path(__file__).resolve().parent.parent / "train_configs" / "llama3_8b_128k.toml"
    comment = " ".join(line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
    result = estimate_for_job_config(parse_args(["--job.config_file", str(path)]), world_size=64, hardware="h100")
    assert (result.pp, result.dp_shard, result.tp, result.cp) == (1, 16, 1, 4)
    figures = f"{result.tokens_per_second_per_device:,.0f} tokens/s/GPU, MFU {result.mfu_percent:.1f}%"
    assert figures in comment, figures
    collectives = f"CP's key/value collectives {result.cp_s * 1e3:.1f} ms of a {result.step_s:.1f} s step"
    assert collectives in comment, collectives
    assert f"{result.cp_hidden_s * 1e3:.1f} ms of them behind the attention" in comment
