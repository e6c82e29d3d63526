"""The memory estimator: exact model-state figures for Llama 2 7B on 8 ranks, agreement with
real CPU tensors on the tiny model, and "does not fit" as an answer."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers import TINY
from tests.multiprocess import run_on_ranks
from titanlite.config import parse_args
from titanlite.estimate import EstimateError, estimate_memory, exact_model_state_bytes, fits, measure_real_memory
from titanlite.models.llama import Transformer
from titanlite.registry import get_model_args

GIB = 2**30
LLAMA7B = ["--job.config_file", "train_configs/llama7b.toml"]
TINY_ARGS = ["--model.name=llama3", "--model.flavor=tiny", "--training.seq_len=128", "--training.local_batch_size=4"]


@pytest.fixture(scope="module")
def llama7b_on_8():
    return estimate_memory(parse_args(LLAMA7B), world_size=8)


def test_7b_on_8_ranks_model_state_is_the_arithmetic(llama7b_on_8):
    with torch.device("meta"):
        model = Transformer(get_model_args("llama2", "7B"))
    params = list(model.parameters())
    # Every dim 0 of Llama 2 7B (4096, 11008, 32000) splits evenly over 8 ranks, so FSDP
    # pads nothing and each rank holds exactly 1/8 of every parameter.
    assert all(p.shape[0] % 8 == 0 for p in params)
    numel = sum(p.numel() for p in params)
    assert 6.7e9 < numel < 6.8e9
    fp32 = 4
    expected_params = numel * fp32 // 8  # float32 master weights
    expected_grads = numel * fp32 // 8  # gradients reduced into the float32 shards
    expected_adam = 2 * numel * fp32 // 8 + len(params) * fp32  # two moments + a float32 step each

    estimate = llama7b_on_8
    for figures in (estimate.measured, estimate.exact):
        assert figures.parameters == expected_params
        assert figures.gradients == expected_grads
        assert figures.optimizer_state == expected_adam
    assert estimate.num_params == numel
    # The resident state is all there at the peak, except gradients mid-backward.
    assert estimate.peak["parameters"] == expected_params
    assert estimate.peak["optimizer_state"] == expected_adam
    assert estimate.activations > 0 and estimate.peak["temporary"] > 0
    assert estimate.peak_bytes == sum(estimate.peak[k] for k in estimate.peak if k != "total")
    print("\n".join(estimate.lines()) + f"\n  estimated in {estimate.seconds:.1f} s")


def test_does_not_fit_is_an_answer(llama7b_on_8):
    ok, headroom = fits(llama7b_on_8, 80 * GIB)
    assert ok and headroom == 80 * GIB - llama7b_on_8.peak_bytes
    ok, headroom = fits(llama7b_on_8, 16 * GIB)
    assert not ok and headroom < 0
    # A reserve for the CUDA context and fragmentation counts against the memory.
    ok, _ = fits(llama7b_on_8, llama7b_on_8.peak_bytes, reserve_bytes=GIB)
    assert not ok


def test_padding_arithmetic_follows_fsdp():
    """On 3 ranks dim 64 splits 22/22/20: parameters and gradients keep padded storages,
    Adam's moments follow the unpadded local shard, so the last rank holds less."""
    with torch.device("meta"):
        model = Transformer(TINY)
    rank0 = exact_model_state_bytes(model, shards=3, rank=0)
    rank2 = exact_model_state_bytes(model, shards=3, rank=2)
    padded = sum(math.ceil(p.shape[0] / 3) * (p.numel() // p.shape[0]) * 4 for p in model.parameters())
    assert rank0.parameters == rank2.parameters == rank0.gradients == padded
    assert rank2.optimizer_state < rank0.optimizer_state


def _measure_on_rank(argv: list[str]) -> dict:
    dist.init_process_group("gloo")
    try:
        return measure_real_memory(parse_args(argv))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world_size, extra",
    [
        # The 7B config's settings: per-op selective AC, bf16 compute.
        (2, ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]),
        # Uneven shards (padding), whole-block AC, float32, fused Adam, ZeRO-2.
        (
            3,
            [
                "--activation_checkpoint.mode=full",
                "--training.mixed_precision_param=float32",
                "--optimizer.implementation=fused",
                "--parallelism.fsdp_reshard_after_forward=never",
            ],
        ),
        # One process: no FSDP, autocast, every 2nd block checkpointed.
        (1, ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"]),
    ],
)
def test_tiny_estimate_matches_real_tensors(world_size, extra):
    argv = TINY_ARGS + extra
    estimate = estimate_memory(parse_args(argv), world_size=world_size)
    real = run_on_ranks(world_size, _measure_on_rank, argv)
    rank0 = real[0]
    assert rank0["parameters"] == estimate.measured.parameters == estimate.exact.parameters
    assert rank0["gradients"] == estimate.measured.gradients == estimate.exact.gradients
    assert rank0["optimizer_state"] == estimate.measured.optimizer_state == estimate.exact.optimizer_state
    # Rank 0 holds the largest shard: no rank needs more.
    assert all(r["parameters"] + r["optimizer_state"] <= rank0["parameters"] + rank0["optimizer_state"] for r in real)
    assert estimate.activations == pytest.approx(rank0["activations"], rel=0.15)
    print(
        f"\n{world_size} rank(s): activations estimated {estimate.activations} B, measured {rank0['activations']} B; "
        f"peak estimated {estimate.peak_bytes} B, measured {rank0['peak']} B"
    )


def test_refuses_inside_a_real_process_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(EstimateError, match="process group"):
            estimate_memory(parse_args(LLAMA7B), world_size=8)
    finally:
        dist.destroy_process_group()
