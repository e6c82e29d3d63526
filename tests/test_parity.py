"""Every parallel layout trains exactly like one process.

Each run trains the same tiny model from the same seed on the same global batches
(8 sequences per step) for 5 steps in float32; the per-step loss and global grad norm
of FSDP, HSDP, DDP, SHARD_GRAD_OP, tensor parallelism (alone, with FSDP and with DDP; with
and without sequence and loss parallel), gradient accumulation, activation checkpointing
and compile must equal a single process without any FSDP.

Every run of the module is a job of one launch of 4 rank processes (RUNS, the `runs`
fixture): starting processes costs more than training the tiny model, and jobs of 1 or 2
ranks run side by side on blocks of those 4.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.helpers import TINY, full_weights, tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_document_mask import SHORT_DOCUMENTS, block_causal_logits_at_cp2
from titanlite.config import parse_args
from titanlite.models.llama.model import Attention
from titanlite.parallel import clip_grad_norm_
from titanlite.train import Trainer

STEPS = 5
GLOBAL_BATCH = 8
BASE_ARGS = tiny_args(
    {
        "training.local_batch_size": None,  # each layout sets its own
        "training.global_batch_size": GLOBAL_BATCH,
        "training.steps": STEPS,
        # Clip hard so that clipping (with the global norm) changes every step.
        "training.max_norm": 0.5,
        "optimizer.lr": 3e-3,
        "lr_scheduler.warmup_steps": 2,
    }
)


def train_and_report(extra_args: list[str]) -> dict:
    trainer = Trainer(parse_args(BASE_ARGS + extra_args))
    records = trainer.train()
    # state_dict(), not named_parameters(): its keys are the checkpoint format and must
    # not change with activation checkpointing or compile wrappers.
    full_params = full_weights(trainer.model)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "loss": [r.loss for r in records],
        "grad_norm": [r.grad_norm for r in records],
        "params": full_params,
        "float8_layers": sum(type(module).__name__ == "Float8Linear" for module in trainer.model.modules()),
    }


REFERENCE = Job(1, train_and_report, ([f"--training.local_batch_size={GLOBAL_BATCH}"],))
"""A single process, no FSDP, the whole global batch in one micro-batch."""


# The weights' bound after the last step, whatever the layout. Every layout sums in another order
# than one process (FSDP's reduce-scatter, TP's and CP's split attention, EP's all-to-all), so
# gradients differ in their last bits, and Adam divides each gradient by its own running scale:
# where an element's gradient is itself at that rounding level its update still moves by up to
# a learning rate. Measured over every parity case of the suite on an AVX-512 Intel host, with
# ATen's default kernels and as an AVX2 host (run_tests.sh's ATEN_CPU_CAPABILITY=avx2), the
# weights came within 1.02e-5 and 9.6e-6 (docs/performance.md, "Any-host numerics"; an AMD host
# had given 5e-7), while losses and grad norms stayed within 3e-7. 5e-5 is 5 times the largest,
# and 40 times below the learning rate (2e-3) by which one Adam step moves a weight; a wrong
# gradient on a shard shows in the losses and grad norms, held to `rtol`.
WEIGHTS_ATOL = 5e-5


def assert_same_training(run: dict, ref: dict, rtol: float) -> None:
    """Losses and grad norms within `rtol` of the reference, the weights after the last step
    within WEIGHTS_ATOL (or `rtol`, where that is looser: compiled and bf16 runs)."""
    assert len(run["loss"]) == len(ref["loss"]) == STEPS
    torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(ref["loss"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(run["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=rtol, atol=0)
    assert run["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=0, atol=max(rtol, WEIGHTS_ATOL), msg=name)


def test_reference_learns(runs):
    # Guards the comparisons below: a run whose loss does not move would match trivially.
    ref = runs["reference"][0]
    assert ref["loss"][-1] < ref["loss"][0] - 0.1
    assert all(norm > 0.5 for norm in ref["grad_norm"])  # clipping at 0.5 really acts


# Overrides the layouts below combine.
TP2 = ["--parallelism.tensor_parallel_degree=2"]
REPLICATE2 = ["--parallelism.data_parallel_replicate_degree=2"]  # DDP, or HSDP with shards
NO_SP = ["--parallelism.enable_sequence_parallel=false"]
NO_LP = ["--parallelism.disable_loss_parallel"]
FULL_AC = ["--activation_checkpoint.mode=full"]
SELECTIVE_2ND = ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2"]
SELECTIVE_OP = ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]
CP2 = ["--parallelism.context_parallel_degree=2"]
NO_LOAD_BALANCER = ["--parallelism.context_parallel_load_balancer=none"]

LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size=4"]),
    "fsdp4": (4, ["--training.local_batch_size=2"]),
    "hsdp2x2": (4, ["--training.local_batch_size=2", *REPLICATE2]),
    # DDP with 2 micro-batches: only the last one all-reduces across replicas.
    "ddp2_accum": (2, ["--training.local_batch_size=2", *REPLICATE2]),
    "shard_grad_op2_accum": (2, ["--training.local_batch_size=2", "--parallelism.fsdp_reshard_after_forward=never"]),
    "single_accum4": (1, ["--training.local_batch_size=2"]),
    "fsdp2_cpu_offload": (2, ["--training.local_batch_size=4", "--training.enable_cpu_offload"]),
    "fsdp2_full_ac": (2, ["--training.local_batch_size=4", *FULL_AC]),
    "fsdp2_selective_ac_every_2nd": (2, ["--training.local_batch_size=4", *SELECTIVE_2ND]),
    "fsdp2_selective_ac_op": (2, ["--training.local_batch_size=4", *SELECTIVE_OP]),
    # Tensor parallelism: two cases per layout, which between them switch each of sequence
    # parallel, loss parallel, activation checkpointing and accumulation on and off, in a
    # different pairing on each layout; every AC mode appears once.
    "tp2": (2, ["--training.local_batch_size=8", *TP2]),
    "tp2_no_sp_no_lp_selective_ac_op_accum": (
        2,
        ["--training.local_batch_size=4", *TP2, *NO_SP, *NO_LP, *SELECTIVE_OP],
    ),
    "tp2_fsdp2_no_lp_accum": (4, ["--training.local_batch_size=2", *TP2, *NO_LP]),
    "tp2_fsdp2_no_sp_full_ac": (4, ["--training.local_batch_size=4", *TP2, *NO_SP, *FULL_AC]),
    "tp2_ddp2_selective_ac_every_2nd_accum": (4, ["--training.local_batch_size=2", *TP2, *REPLICATE2, *SELECTIVE_2ND]),
    "tp2_ddp2_no_sp_no_lp": (4, ["--training.local_batch_size=4", *TP2, *REPLICATE2, *NO_SP, *NO_LP]),
    # Context parallelism: each sequence split over the cp ranks (headtail, or contiguous
    # chunks), alone, with FSDP, with TP (sequence parallel splitting each cp chunk further)
    # and over 4 ranks (8 chunks of 4 tokens), where activation checkpointing recomputes the
    # all-gathers.
    "cp2": (2, ["--training.local_batch_size=8", *CP2]),
    "cp2_no_load_balancer_accum": (2, ["--training.local_batch_size=4", *CP2, *NO_LOAD_BALANCER]),
    "cp2_fsdp2": (4, ["--training.local_batch_size=4", *CP2]),
    "cp2_tp2": (4, ["--training.local_batch_size=8", *CP2, *TP2]),
    "cp4_full_ac": (4, ["--training.local_batch_size=8", "--parallelism.context_parallel_degree=4", *FULL_AC]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(runs, layout):
    for rank_run in runs[f"layout {layout}"]:  # every rank must agree, not only rank 0
        assert_same_training(rank_run, runs["reference"][0], rtol=1e-5)


# Qwen3-MoE's attention split over 2 TP ranks, its MoE router and experts held whole on both,
# each routing its half of the sequence (their gradients summed over tp by FSDP), FSDP over
# the other 2 (the 2-rank TP cases are in test_qwen3_moe's launch).
TINY_MOE = ["--model.name=qwen3", "--model.flavor=tiny_moe"]
MOE_REFERENCE = Job(1, train_and_report, ([*REFERENCE.args[0], *TINY_MOE],))
MOE_LAYOUTS = {
    "tp2_fsdp2_no_sp_full_ac": (4, ["--training.local_batch_size=4", *TP2, *NO_SP, *FULL_AC, *TINY_MOE]),
    # Qwen3's per-head q/k norms and its MoE layers with each sequence split over cp (every
    # rank routes its chunks; the balancing loss and counts add up over the ranks).
    "cp2_fsdp2": (4, ["--training.local_batch_size=4", *CP2, *TINY_MOE]),
}


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_layout_matches_single_process(runs, layout):
    for rank_run in runs[f"moe layout {layout}"]:
        assert_same_training(rank_run, runs["moe reference"][0], rtol=1e-5)


# Document masking: CP 2 (each rank's chunks masked by global positions and the documents of
# the whole sequence) trains like one process, and its logits equal each document run alone.
BLOCK_CAUSAL = ["--model.attn_mask_type=block_causal", *SHORT_DOCUMENTS]
BLOCK_CAUSAL_REFERENCE = Job(1, train_and_report, ([*REFERENCE.args[0], *BLOCK_CAUSAL],))
# The same short documents without the mask: the mask must change the training.
CAUSAL_ON_SHORT_DOCUMENTS = Job(1, train_and_report, ([*REFERENCE.args[0], *SHORT_DOCUMENTS],))
BLOCK_CAUSAL_LAYOUTS = {"cp2_fsdp2": (4, ["--training.local_batch_size=4", *CP2, *BLOCK_CAUSAL])}


@pytest.mark.parametrize("layout", BLOCK_CAUSAL_LAYOUTS)
def test_block_causal_layout_matches_single_process(runs, layout):
    reference = runs["block causal reference"][0]
    causal = runs["causal on short documents"][0]
    assert max(abs(a - b) for a, b in zip(reference["loss"], causal["loss"], strict=True)) > 1e-3
    for rank_run in runs[f"block causal {layout}"]:
        assert_same_training(rank_run, reference, rtol=1e-5)


def held_out_loss(extra_args: list[str]) -> dict:
    """The held-out loss of the freshly initialised model (the same weights in every layout)."""
    validation = ["--validation.enable", "--validation.steps=2", "--validation.local_batch_size=4"]
    trainer = Trainer(parse_args(BASE_ARGS + validation + extra_args))
    result = trainer.validator.validate(trainer.model)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def test_the_held_out_loss_under_cp_is_one_processs(runs):
    reference = runs["held out 1"][0]
    for rank_result in runs["held out cp2_fsdp2"]:  # each rank's chunks' losses and tokens add up
        assert rank_result["tokens"] == reference["tokens"] == 2 * 4 * 32
        assert rank_result["loss"] == pytest.approx(reference["loss"], rel=1e-6)


def test_block_causal_logits_at_cp2_equal_each_document_run_separately(runs):
    first, second = runs["block causal logits cp2"]
    assert sorted(first["positions"] + second["positions"]) == list(range(32))
    assert max(first["difference"], second["difference"]) < 1e-5


COMPILED_LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size=4"]),
    # The compiled blocks hold TP's collectives and DTensor code; loss parallel's too. Full AC
    # recomputes each whole block, attention included, which torch 2.13 cannot compile as one
    # graph with DTensors inside (apply_compile). Large models add FSDP over other ranks, which
    # wraps each compiled block from outside (fsdp2 above); 2 ranks, not 4, halve the compile
    # work of the suite's slowest job. 2 accumulation steps of 4, as fsdp2's ranks take them.
    "tp2_full_ac_accum": (2, ["--training.local_batch_size=4", *TP2, *FULL_AC]),
}


COMPILE = ["--compile.enable", "--compile.components=model,loss"]


@pytest.mark.parametrize("layout", COMPILED_LAYOUTS)
def test_compile_matches_single_process(runs, layout):
    for rank_run in runs[f"compiled {layout}"]:
        assert_same_training(rank_run, runs["reference"][0], rtol=1e-4)


# --- float8 (torchao's, emulated on the CPU) --------------------------------------------
# Every linear layer but the output converted (the tiny model's are all below torchao's size
# thresholds, which a GPU run would apply). Float8 scales each tensor it casts by that tensor's
# own largest value, so a layout is held against a single process that casts the same tensors:
# FSDP's ranks each cast their half of the batch, as a single process accumulating two
# micro-batches of 4 does; TP's casts take their scales over the whole mesh, as a single
# process of one micro-batch of 8 does. The 50-step comparison with bf16 on the debug model is
# a figure in docs/performance.md.
FLOAT8 = [
    "--model.converters=float8",
    "--quantize.linear.float8.emulate",
    "--quantize.linear.float8.skip_small_layers=false",
]
FLOAT8_ALL_GATHER = [
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
]
FLOAT8_REFERENCES = {
    "one_batch": [f"--training.local_batch_size={GLOBAL_BATCH}"],
    "accum2": ["--training.local_batch_size=4"],
}
FLOAT8_LAYOUTS = {  # name: (ranks, overrides, the reference it matches)
    "fsdp2_selective_ac_op": (2, ["--training.local_batch_size=4", *SELECTIVE_OP], "accum2"),
    "fsdp2_float8_all_gather": (2, ["--training.local_batch_size=4", *FLOAT8_ALL_GATHER], "accum2"),
    "tp2": (2, ["--training.local_batch_size=8", *TP2], "one_batch"),
}  # fmt: skip


def test_float8_reference_learns_in_float8(runs):
    ref, plain = runs["float8 reference one_batch"][0], runs["reference"][0]
    assert ref["float8_layers"] == 7 * TINY.n_layers  # wq, wk, wv, wo, w1, w2, w3 of every block
    assert ref["loss"][-1] < ref["loss"][0] - 0.1
    # Float8 rounding moves the loss, but not far from the float32 run's.
    gaps = [abs(a / b - 1) for a, b in zip(ref["loss"], plain["loss"], strict=True)]
    assert 0 < max(gaps) < 0.02, gaps


@pytest.mark.parametrize("layout", FLOAT8_LAYOUTS)
def test_float8_layout_matches_its_single_process_run(runs, layout):
    reference = runs[f"float8 reference {FLOAT8_LAYOUTS[layout][2]}"][0]
    for rank_run in runs[f"float8 {layout}"]:
        assert rank_run["float8_layers"] == reference["float8_layers"]
        assert_same_training(rank_run, reference, rtol=1e-4)


# --- the global grad norm -------------------------------------------------------------


def grad_norms_after_one_backward(extra_args: list[str]) -> dict:
    trainer = Trainer(parse_args(BASE_ARGS + extra_args))
    inputs, labels = trainer.loader.next_batch()
    logits = trainer.model(inputs)
    # The mean over the global batch: every rank holds 1/world of it.
    loss = trainer.loss_fn(logits, labels) / (GLOBAL_BATCH * 32)
    loss.backward()
    params = list(trainer.model.parameters())
    norms = {
        "inf": clip_grad_norm_(params, max_norm=0, norm_type=float("inf")).item(),
        "2": clip_grad_norm_(params, max_norm=0, norm_type=2.0).item(),
    }
    # The norm of this rank's shard alone: what a naive implementation would report.
    local = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params]
    norms["local_2"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in local])).item()
    if dist.is_initialized():
        dist.destroy_process_group()
    return norms


def test_global_grad_norm_equals_single_process(runs):
    single = runs["grad norms 1"][0]
    for rank_norms in runs["grad norms 4"]:
        assert rank_norms["2"] == pytest.approx(single["2"], rel=1e-5)
        assert rank_norms["inf"] == pytest.approx(single["inf"], rel=1e-5)
        # A shard's own norm is visibly smaller: the test would catch a local-only norm.
        assert rank_norms["local_2"] < 0.9 * single["2"]


# --- the model really is sharded ------------------------------------------------------


def sharding_report(extra_args: list[str]) -> dict:
    trainer = Trainer(parse_args(BASE_ARGS + extra_args))
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in trainer.model.parameters()
    )
    total_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    report = {
        "local_bytes": local_bytes,
        "total_bytes": total_bytes,
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in trainer.model.modules()),
        "largest_dim0_row_bytes": max(p.numel() // p.shape[0] * p.element_size() for p in trainer.model.parameters()),
        "n_params": len(list(trainer.model.parameters())),
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameters_are_sharded(runs, world_size):
    reports = runs[f"sharding {world_size}"]
    total = reports[0]["total_bytes"]
    # torch.chunk gives each rank ceil(rows / world) rows or fewer: at most one row of
    # each parameter separates a rank's share from the exact 1/world.
    slack = reports[0]["n_params"] * reports[0]["largest_dim0_row_bytes"]
    for report in reports:
        assert report["fsdp_units"] == TINY.n_layers + 1
        assert abs(report["local_bytes"] - total / world_size) <= slack
    assert sum(r["local_bytes"] for r in reports) == total


# --- mixed precision reaches the matmuls ----------------------------------------------


def precision_report(extra_args: list[str]) -> dict:
    trainer = Trainer(parse_args(BASE_ARGS + extra_args + ["--training.mixed_precision_param=bfloat16"]))
    seen = {}

    def record_dtypes(module, inputs, output):
        seen["weight"], seen["output"] = module.weight.dtype, output.dtype

    trainer.model.layers["0"].attention.wq.register_forward_hook(record_dtypes)
    loss_share, grad_norm = trainer.train_step()
    report = {
        "matmul_weight": str(seen["weight"]),
        "matmul_output": str(seen["output"]),
        "master_params": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "optimizer_state": sorted(
            {str(v.dtype) for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"}
        ),
        "loss": trainer.global_loss(loss_share)[0],
        "grad_norm": grad_norm.item(),
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


@pytest.mark.parametrize("world_size", [1, 2])
def test_bf16_compute_with_fp32_master_weights(runs, world_size):
    report = runs[f"bf16 {world_size}"][0]
    assert report["matmul_output"] == "torch.bfloat16"
    if world_size > 1:  # FSDP gathers the parameters in bf16; a single process autocasts
        assert report["matmul_weight"] == "torch.bfloat16"
    assert report["master_params"] == ["torch.float32"]
    assert report["optimizer_state"] == ["torch.float32"]
    assert torch.isfinite(torch.tensor([report["loss"], report["grad_norm"]])).all()
    # bf16 compute stays close to the float32 reference's first step.
    assert report["loss"] == pytest.approx(runs["reference"][0]["loss"][0], rel=2e-2)


# --- the RoPE tables stay float32 on every layout -------------------------------------


def rope_table_dtypes(extra_args: list[str]) -> dict:
    """Train one bf16 step; report every dtype the blocks' attention saw for x, cos and sin,
    recomputation in backward included."""
    trainer = Trainer(parse_args(BASE_ARGS + extra_args + ["--training.mixed_precision_param=bfloat16"]))
    seen = {"x": set(), "cos": set(), "sin": set()}

    def record_dtypes(module, args):
        x, cos, sin = args
        for key, tensor in zip(seen, (x, cos, sin), strict=True):
            seen[key].add(str(tensor.dtype))

    attentions = [m for m in trainer.model.modules() if isinstance(m, Attention)]
    for attention in attentions:
        attention.register_forward_pre_hook(record_dtypes)
    trainer.train_step()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"n_attentions": len(attentions), **{key: sorted(dtypes) for key, dtypes in seen.items()}}


ROPE_LAYOUTS = {
    "single": (1, [f"--training.local_batch_size={GLOBAL_BATCH}"]),
    "fsdp2": (2, ["--training.local_batch_size=4"]),
    "fsdp2_cpu_offload": (2, ["--training.local_batch_size=4", "--training.enable_cpu_offload"]),
    "fsdp2_full_ac": (2, ["--training.local_batch_size=4", *FULL_AC]),
}


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_rope_tables_reach_attention_in_float32(runs, layout):
    # FSDP casts a block's floating-point forward arguments to the param dtype unless told
    # not to; the tables are such arguments, and bf16 keeps 8 significant bits of each value.
    reports = runs[f"rope {layout}"]
    for report in reports:
        assert report["n_attentions"] == TINY.n_layers
        assert report["cos"] == report["sin"] == ["torch.float32"]
        if len(reports) > 1:
            # bf16 compute still reaches attention without that cast: the hidden state is
            # bf16 from the embedding on, whose weight FSDP gathers in bf16.
            assert report["x"] == ["torch.bfloat16"]


# --- every run above, in one launch ---------------------------------------------------


def batch_per_rank(world_size: int) -> list[str]:
    return [f"--training.local_batch_size={GLOBAL_BATCH // world_size}"]


RUNS = {
    # Compiling is the slowest job: first, so that its ranks do not wait for it at the end.
    **{
        f"compiled {name}": Job(n, train_and_report, ([*extra, *COMPILE],))
        for name, (n, extra) in COMPILED_LAYOUTS.items()
    },
    "reference": REFERENCE,
    **{f"layout {name}": Job(n, train_and_report, (extra,)) for name, (n, extra) in LAYOUTS.items()},
    "moe reference": MOE_REFERENCE,
    **{
        f"float8 reference {name}": Job(1, train_and_report, ([*extra, *FLOAT8],))
        for name, extra in FLOAT8_REFERENCES.items()
    },
    **{
        f"float8 {name}": Job(n, train_and_report, ([*extra, *FLOAT8],))
        for name, (n, extra, _) in FLOAT8_LAYOUTS.items()
    },
    **{f"moe layout {name}": Job(n, train_and_report, (extra,)) for name, (n, extra) in MOE_LAYOUTS.items()},
    "block causal reference": BLOCK_CAUSAL_REFERENCE,
    "causal on short documents": CAUSAL_ON_SHORT_DOCUMENTS,
    **{f"block causal {name}": Job(n, train_and_report, (extra,)) for name, (n, extra) in BLOCK_CAUSAL_LAYOUTS.items()},
    "block causal logits cp2": Job(2, block_causal_logits_at_cp2),
    "held out 1": Job(1, held_out_loss, (["--training.local_batch_size=8"],)),
    "held out cp2_fsdp2": Job(
        4, held_out_loss, (["--training.local_batch_size=4", "--validation.local_batch_size=2", *CP2],)
    ),
    "grad norms 1": Job(1, grad_norms_after_one_backward, (batch_per_rank(1),)),
    "grad norms 4": Job(4, grad_norms_after_one_backward, (batch_per_rank(4),)),
    **{f"sharding {n}": Job(n, sharding_report, (batch_per_rank(n),)) for n in (2, 4)},
    **{f"bf16 {n}": Job(n, precision_report, (batch_per_rank(n),)) for n in (1, 2)},
    **{f"rope {name}": Job(n, rope_table_dtypes, (extra,)) for name, (n, extra) in ROPE_LAYOUTS.items()},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return run_jobs_on_ranks(4, RUNS)
