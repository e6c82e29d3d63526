"""The memory estimator: exact model-state figures for Llama 2 7B on 8 ranks and Llama 3 8B
under FSDP x TP, agreement with real CPU tensors on the tiny model (FSDP, TP, FSDP x TP), the
trainer's floor under TP, and "does not fit" as an answer."""

import dataclasses
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.helpers import TINY, tiny_args
from tests.rank_jobs import Job, run_jobs_in_fewest_launches
from titanlite import train
from titanlite.config import ConfigError, parse_args
from titanlite.estimate import (
    EstimateError,
    check_memory_floor,
    estimate_memory,
    exact_model_state_bytes,
    fits,
    measure_real_memory,
    simulation,
    step_floor_bytes,
)
from titanlite.estimate.floor import fullest_floor
from titanlite.estimate.memory import ALLOCATOR_SLACK
from titanlite.models.llama import Transformer
from titanlite.plan import plan_run
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
    estimate = llama7b_on_8
    # What must fit is what the caching allocator reserves: the tensors at the peak and a
    # fifth of the step's own (activations and temporaries) beside them.
    transient = estimate.peak["activations"] + estimate.peak["temporary"]
    assert estimate.reserved_bytes == estimate.peak_bytes + int(ALLOCATOR_SLACK * transient)
    ok, headroom = fits(estimate, 80 * GIB)
    assert ok and headroom == 80 * GIB - estimate.reserved_bytes
    ok, headroom = fits(estimate, 16 * GIB)
    assert not ok and headroom < 0
    ok, _ = fits(estimate, estimate.reserved_bytes)
    assert ok
    ok, _ = fits(estimate, estimate.reserved_bytes - 1)  # the tensors fit; the allocator's reserve does not
    assert not ok and estimate.peak_bytes < estimate.reserved_bytes - 1
    # A reserve for the CUDA context and NCCL counts against the memory too.
    ok, _ = fits(estimate, estimate.reserved_bytes, reserve_bytes=GIB)
    assert not ok
    # No caching allocator on the CPU: the tensors alone.
    assert dataclasses.replace(estimate, device_type="cpu").reserved_bytes == estimate.peak_bytes


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


def _estimate_against_real(world_size: int, argv: list[str], real: list[dict], activations_rel: float = 0.0):
    """Rank 0's estimate against ``real``, what every gloo rank measured for the same config
    (the real_memory fixture). What the simulation tracked must be what rank 0 really holds;
    the arithmetic must give the same parameters and optimizer state; no rank may hold more
    than rank 0; the activations must agree to ``activations_rel``. Returns (estimate, rank 0)."""
    estimate = estimate_memory(parse_args(argv), world_size=world_size)
    assert len(real) == world_size
    rank0 = real[0]
    for name in ("parameters", "gradients", "optimizer_state"):
        assert rank0[name] == getattr(estimate.measured, name), name
    assert rank0["parameters"] == estimate.exact.parameters
    assert rank0["optimizer_state"] == estimate.exact.optimizer_state
    # Rank 0 holds the largest shard: no rank needs more.
    assert all(r["parameters"] + r["optimizer_state"] <= rank0["parameters"] + rank0["optimizer_state"] for r in real)
    if activations_rel:
        assert estimate.activations == pytest.approx(rank0["activations"], rel=activations_rel)
    print(
        f"\n{estimate.strategy} on {world_size} rank(s): activations estimated {estimate.activations} B, measured "
        f"{rank0['activations']} B; peak estimated {estimate.peak_bytes} B, measured {rank0['peak']} B"
    )
    return estimate, rank0


TINY_CASES = [
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
]


@pytest.mark.parametrize("world_size, extra", TINY_CASES)
def test_tiny_estimate_matches_real_tensors(real_memory, world_size, extra):
    real = real_memory[_case_name(world_size, extra)]
    estimate, rank0 = _estimate_against_real(world_size, TINY_ARGS + extra, real, activations_rel=0.15)
    assert rank0["gradients"] == estimate.exact.gradients


def test_fused_adam_in_groups_of_a_few_tensors_holds_what_one_group_holds(monkeypatch):
    # The simulation splits fused Adam's tensors into groups (simulation._parameter_groups):
    # the tiny model's 30 tensors into 2, whose estimate must be the one group's, byte for byte.
    # With one sequence of 8 tokens the optimizer step makes the step's peak, so a kernel
    # whose temporaries span its group (foreach: 1,791,360 bytes in groups, 1,810,044 in one) fails.
    with torch.device("meta"):
        assert len(list(Transformer(TINY).parameters())) > simulation.FUSED_GROUP_TENSORS
    argv = ["--model.name=llama3", "--model.flavor=tiny", "--training.seq_len=8", "--training.local_batch_size=1"]
    config = parse_args([*argv, "--optimizer.implementation=fused"])
    grouped = estimate_memory(config, world_size=2)
    monkeypatch.setattr(simulation, "FUSED_GROUP_TENSORS", 1000)
    whole = estimate_memory(config, world_size=2)
    assert dataclasses.replace(grouped, seconds=0) == dataclasses.replace(whole, seconds=0)


def test_refuses_inside_a_real_process_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(EstimateError, match="process group"):
            estimate_memory(parse_args(LLAMA7B), world_size=8)
    finally:
        dist.destroy_process_group()


# --- tensor parallelism -----------------------------------------------------------------------


def _norms_and_matrices(model) -> tuple[int, int]:
    """(elements of the 1-D norm weights, elements of every matrix) of an unsharded model."""
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    return norms, sum(p.numel() for p in model.parameters()) - norms


def test_8b_fsdp4_x_tp2_holds_an_eighth_of_every_matrix_and_a_quarter_of_every_norm():
    """By hand: TP splits every matrix in 2 and FSDP the piece in 4 (every dimension of Llama 3
    8B divides: vocabulary 128256, dim 4096, FFN 14336, key/value 1024), while the norms, which
    TP replicates, are only split in 4."""
    argv = ["--model.name=llama3", "--model.flavor=8B", "--training.seq_len=256", "--training.local_batch_size=1"]
    estimate = estimate_memory(parse_args([*argv, "--parallelism.tensor_parallel_degree=2"]), world_size=8)
    with torch.device("meta"):
        model = Transformer(get_model_args("llama3", "8B"))
    norms, matrices = _norms_and_matrices(model)
    assert norms == (2 * 32 + 1) * 4096
    n_tensors = len(list(model.parameters()))
    fp32 = 4
    per_rank = (matrices // 8 + norms // 4) * fp32
    assert (estimate.strategy, estimate.dp_shard, estimate.tp) == ("FSDP + TP", 4, 2)
    for figures in (estimate.measured, estimate.exact):
        assert figures.parameters == figures.gradients == per_rank
        assert figures.optimizer_state == 2 * per_rank + n_tensors * fp32
    # The acceptance: per-rank parameter + gradient + optimizer bytes = total / (dp_shard x tp).
    total = (matrices + norms) * fp32 * 4 + n_tensors * fp32
    state = estimate.exact.parameters + estimate.exact.gradients + estimate.exact.optimizer_state
    assert state / (total / 8) == pytest.approx(1, abs=0.0001)
    assert estimate.notes == []


TP_CASES = [
    # TP alone: sequence parallel, loss parallel, per-op selective AC, bf16 autocast.
    (2, ["--parallelism.tensor_parallel_degree=2", "--activation_checkpoint.selective_ac_option=op"]),
    # TP alone without sequence parallel or loss parallel, full AC, float32.
    (
        2,
        [
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.enable_sequence_parallel=false",
            "--parallelism.disable_loss_parallel=true",
            "--activation_checkpoint.mode=full",
            "--training.mixed_precision_param=float32",
        ],
    ),
    # FSDP 2 x TP 2 on the 3-D mesh, uneven vocabulary (258 -> 129 -> 65 + 64), bf16.
    (4, ["--parallelism.tensor_parallel_degree=2", "--activation_checkpoint.mode=none"]),
]


@pytest.mark.parametrize("world_size, extra", TP_CASES)
def test_tensor_parallel_estimate_matches_real_tensors(real_memory, world_size, extra):
    estimate, rank0 = _estimate_against_real(world_size, TINY_ARGS + extra, real_memory[_case_name(world_size, extra)])
    # The same tensors in the same order: the activations (sequence-split, all-gathered, the
    # vocabulary-split or gathered logits) and the peak usually agree to the byte. A real gloo
    # collective's output is freed only once gloo's own thread lets go of it, so under load the
    # real run may still hold the largest one at the peak (the gathered logits without loss
    # parallel, an all-gathered [4, 128, 64] activation with it; float32 covers bf16) and a few
    # small tensors (the int64 labels, the loss): 8 KiB.
    config = parse_args(TINY_ARGS + extra)
    gathered = TINY.vocab_size if config.parallelism.disable_loss_parallel else TINY.dim
    in_flight = config.training.local_batch_size * config.training.seq_len * gathered * 4 + 8192
    for name, estimated in (("activations", estimate.activations), ("peak", estimate.peak_bytes)):
        assert estimated <= rank0[name] <= estimated + in_flight, name
    # Every gradient ends the step in its parameter's layout, FSDP or not (without FSDP the
    # vocabulary-split embedding's gradient comes back whole and clipping slices it).
    assert estimate.measured.gradients == estimate.exact.gradients


CP_CASES = [
    # CP 2 alone: each rank runs 32 of the 64 tokens, all-gathers the keys and values; bf16.
    (2, ["--parallelism.context_parallel_degree=2", "--training.seq_len=64", "--activation_checkpoint.mode=none"]),
    # CP 2 x FSDP 2 (FSDP over dp_shard x cp = 4), full AC (the all-gather again in recompute), float32.
    (
        4,
        [
            "--parallelism.context_parallel_degree=2",
            "--activation_checkpoint.mode=full",
            "--training.mixed_precision_param=float32",
        ],
    ),
]


@pytest.mark.parametrize("world_size, extra", CP_CASES)
def test_context_parallel_estimate_matches_real_tensors(real_memory, world_size, extra):
    """The simulated cp rank (its columns, the keys and values the fake all-gather hands it,
    FSDP over dp_shard x cp) against what a real CP run's rank 0 holds."""
    estimate, rank0 = _estimate_against_real(
        world_size, TINY_ARGS + extra, real_memory[_case_name(world_size, extra)], activations_rel=0.01
    )
    assert estimate.peak_bytes == pytest.approx(rank0["peak"], rel=0.01)
    assert estimate.exact.gradients == rank0["gradients"]


def _case_name(world_size: int, extra: list[str]) -> str:
    return " ".join([f"{world_size} rank(s):", *extra])


@pytest.fixture(scope="module")
def real_memory() -> dict[str, list[dict]]:
    """What every rank of each case above really holds (_measure_on_rank), by _case_name. One
    launch of 4 ranks measures the cases of 1, 2 and 4 ranks side by side and a second one the
    3-rank case: starting rank processes costs more than measuring the tiny model."""
    cases = TINY_CASES + TP_CASES + CP_CASES
    jobs = {_case_name(n, extra): Job(n, _measure_on_rank, (TINY_ARGS + extra,)) for n, extra in cases}
    return run_jobs_in_fewest_launches(jobs)


def test_every_rank_of_fsdp_x_tp_is_estimated_as_it_holds():
    """The estimate of rank 3 (shard 1, TP rank 1) is its own: the vocabulary 258 splits 129
    per TP rank, then 65 / 64 per FSDP shard, and Adam's moments follow the unpadded 64."""
    config = parse_args([*TINY_ARGS, "--parallelism.tensor_parallel_degree=2", "--activation_checkpoint.mode=none"])
    rank0, rank3 = (estimate_memory(config, world_size=4, rank=rank) for rank in (0, 3))
    assert rank3.measured == rank3.exact
    assert rank3.exact.parameters == rank0.exact.parameters  # FSDP pads the storage to the first shard
    embedding_row = 64 * 4
    assert rank0.exact.optimizer_state - rank3.exact.optimizer_state == 2 * embedding_row * 2  # embedding, output
    with pytest.raises(ConfigError, match="rank 4 is not one of the 4 rank"):
        estimate_memory(config, world_size=4, rank=4)


def test_floor_under_tensor_parallelism_stays_below_what_rank_0_holds():
    argv = [*TINY_ARGS, "--parallelism.tensor_parallel_degree=2", "--training.mixed_precision_param=float32"]
    estimate = estimate_memory(parse_args(argv), world_size=4)
    with torch.device("meta"):
        model = Transformer(TINY)
    floor = step_floor_bytes(model, TINY.vocab_size, 2, 4, 128, 4, cpu_offload=False, tp=2)
    held = estimate.exact.parameters + estimate.exact.optimizer_state
    norms, _ = _norms_and_matrices(model)
    # Below rank 0's state by at most the norms' TP half (replicated, counted as split) and
    # the vocabulary's rounding (258 -> 65 rows per rank, not 64.5) and the step counters.
    assert held - 3 * (norms // 4 * 4) - 3 * 64 * 4 * 2 - 30 * 4 <= floor["weights and Adam state"] <= held
    # Loss parallel: each rank holds its 129 vocabulary columns of the logits; without, all 258.
    assert floor["logits"] == 4 * 128 * 129 * (4 + 4)
    whole = step_floor_bytes(model, TINY.vocab_size, 2, 4, 128, 4, cpu_offload=False, tp=2, loss_parallel=False)
    assert whole["logits"] == 4 * 128 * 258 * (4 + 4)


def test_floor_names_the_tensor_parallel_degree(monkeypatch):
    config = parse_args(["--model.name=llama3", "--model.flavor=8B", "--parallelism.tensor_parallel_degree=2"])
    monkeypatch.setattr("titanlite.estimate.floor.device_memory_bytes", lambda *_: (2**30, "a 1 GiB test device"))
    with pytest.raises(ConfigError, match=r"model llama3 8B on 2 shard\(s\) x 2 tensor-parallel rank\(s\)") as error:
        check_memory_floor(config, plan_run(config, 4))
    assert "parallelism.tensor_parallel_degree" in str(error.value)


def test_floor_under_context_parallelism_is_a_cp_rank_s(monkeypatch):
    """The preflight's floor of a cp rank: the model sharded over dp_shard x cp, the logits of its
    seq_len / cp tokens; one sequence a rank that does not fit is told to raise the cp degree."""
    argv = ["--model.name=llama3", "--model.flavor=8B", "--training.local_batch_size=1"]
    long, short = [*argv, "--training.seq_len=131072"], [*argv, "--training.seq_len=64"]
    cp = ["--parallelism.context_parallel_degree=4"]
    monkeypatch.setattr("titanlite.estimate.floor.device_memory_bytes", lambda *_: (2**30, "a 1 GiB test device"))
    with pytest.raises(ConfigError, match=r"local_batch_size 1 \(x seq_len 131072\)") as error:
        check_memory_floor(parse_args(long), plan_run(parse_args(long), 2))
    assert "raise parallelism.context_parallel_degree" in str(error.value)
    plan = plan_run(parse_args(long + cp), 8)
    _, cp_floor = fullest_floor(parse_args(long + cp), plan)
    assert cp_floor["logits"] == 131072 // 4 * plan.model_args.vocab_size * (2 + 4)  # bf16 logits, fp32 loss
    with pytest.raises(ConfigError, match=r"model llama3 8B on 8 shard\(s\)"):  # dp_shard 2 x cp 4
        check_memory_floor(parse_args(short + cp), plan_run(parse_args(short + cp), 8))


def test_validate_only_without_a_gpu_checks_the_gpu_the_config_is_for(monkeypatch, capsys, tmp_path):
    """On a host without a GPU (a login node) validate_only compares the floor with the GPU of
    job.validate_hardware: Llama 3 8B in float32 on one rank needs about 90 GiB, which a b200
    (180 GiB) holds and the default h100 (80 GiB) does not."""
    for name in ("RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)  # job.dump_folder "./outputs" holds no other run's checkpoint
    argv = [*tiny_args({"model.flavor": "8B"}), "--job.validate_only"]
    assert train.main([*argv, "--job.validate_hardware", "b200"]) == 0
    ok_line = capsys.readouterr().out.splitlines()[-1]
    assert re.search(
        r", memory floor (8\d|9\d)\.\d GiB a rank, within 180\.0 GiB: the b200 of job\.validate_hardware$", ok_line
    )
    assert train.main(argv) == 2
    error = capsys.readouterr().err
    assert "model llama3 8B on 1 shard(s): one rank needs at least " in error
    assert "more than the h100 of job.validate_hardware holds (80.0 GiB)" in error
