"""Pipeline parallelism trains exactly like one process, and no schedule hangs.

Every run trains test_parity's tiny model from the same seed on the same global batches
(8 sequences a step, 5 steps, float32) and must match its single-process reference within
1e-5 in every step's loss and grad norm and in the final weights: PP 2 with each of torch's
schedules (one stage per rank, looped with 2 per rank, V-shaped with 2 per rank), with 1 to 8
micro-batches per step and with gradient accumulation, and PP 2 composed with FSDP 2 (the
zero-bubble schedules too), TP 2 (with and without sequence and loss parallel), DDP 2 and
HSDP 2 x 2, and with compiled blocks; and Qwen3-MoE's tiny_moe at PP 2 x TP 2 against its own single process.
PP 2 in bf16 without FSDP (the schedule under autocast) matches a bf16 single process to
test_parity's bf16 tolerance. PP 2 with the output z-loss (training.z_loss_coef) and
gradient accumulation matches a single process with it, the logged z-loss too. With DDP or
HSDP and gradient accumulation, the
replicas all-reduce once per optimizer step (counted at the dispatcher).

The tiny model's 3 blocks fill 4 stages as [embedding], [block 0], [block 1], [block 2,
norm, output] (test_pipeline_plan checks the split); each rank holds only its stages' weights,
so the weights of a run are the union of its ranks'.

Every run is a job of one launch of 8 rank processes (RUNS, the `runs` fixture): the 8-rank
PP x HSDP job, then the 4- and 2-rank jobs side by side on the launch's ranks.
"""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import full_weights
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_parity import (
    BASE_ARGS,
    BLOCK_CAUSAL,
    BLOCK_CAUSAL_REFERENCE,
    COMPILE,
    CP2,
    FULL_AC,
    MOE_REFERENCE,
    NO_LP,
    NO_SP,
    REFERENCE,
    REPLICATE2,
    SELECTIVE_OP,
    STEPS,
    TINY_MOE,
    TP2,
    assert_same_training,
    train_and_report,
)
from titanlite.config import parse_args
from titanlite.config.parallelism import PIPELINE_SCHEDULES
from titanlite.metrics import tags
from titanlite.train import Trainer

# A schedule that deadlocks must fail the launch, not hang it: under gloo a pipeline's sends
# and receives wait at most init_timeout_seconds (the pp group's timeout when it was made; a
# timeout set later reaches collectives only), the collectives at most the train timeout.
NO_HANG = ["--comm.init_timeout_seconds=60", "--comm.train_timeout_seconds=30"]


class AllReduceCounter(TorchDispatchMode):
    """Counts the all-reduces over one process group where every ProcessGroup's all-reduce
    passes, FSDP's included: c10d's allreduce_ op at the dispatcher."""

    def __init__(self, group):
        super().__init__()
        self.group, self.count = group, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default and dist.ProcessGroup.unbox(args[1]) is self.group:
            self.count += 1
        return func(*args, **(kwargs or {}))


def fsdp_units_with_parameters(part: nn.Module) -> int:
    """The FSDP units of a model part that hold parameters of their own, which each reduce
    their gradients (a stage's root holds none when all its modules are blocks)."""
    units = [module for module in part.modules() if isinstance(module, FSDPModule)]
    count = 0
    for unit in units:
        inner = {id(p) for sub in unit.modules() if sub is not unit and sub in units for p in sub.parameters()}
        count += any(id(p) not in inner for p in unit.parameters())
    return count


def logged_z_losses(trainer: Trainer) -> list:
    """The output z-loss of every logged step, as logged (None without one), once trained."""
    z_losses, log_step = [], trainer.metrics.log_step

    def logged(*args, **kwargs):
        metrics = log_step(*args, **kwargs)
        z_losses.append(metrics.get(tags.Z_LOSS))
        return metrics

    trainer.metrics.log_step = logged
    return z_losses


def train_pipeline(extra_args: list[str], record_matmul_dtypes: bool = False) -> dict:
    """Train with pipeline parallelism; what train_and_report returns, plus which schedule
    class ran, the all-reduces over the replicas' group in each of its runs (with replicas),
    the logged z-loss and, when asked, the dtypes of every Linear's output in them."""
    trainer = Trainer(parse_args(BASE_ARGS + NO_HANG + ["--parallelism.pipeline_parallel_degree=2"] + extra_args))
    z_losses = logged_z_losses(trainer)
    schedule, dims = trainer.pipeline.schedule, trainer.plan.parallel_dims
    replicas = trainer.mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 else None
    step_schedule, replica_all_reduces = schedule.step, []

    def counted_step(*args, **kwargs):
        with AllReduceCounter(replicas) if replicas is not None else contextlib.nullcontext() as counter:
            step_schedule(*args, **kwargs)
        replica_all_reduces.append(counter.count if replicas is not None else 0)

    schedule.step = counted_step
    matmul_dtypes = set()
    if record_matmul_dtypes:
        for linear in (m for part in trainer.pipeline.parts for m in part.modules() if isinstance(m, nn.Linear)):
            linear.register_forward_hook(lambda module, args, output: matmul_dtypes.add(str(output.dtype)))
    max_losses, log_step = [], trainer.metrics.log_step

    def logged(step, loss, max_loss, *args, **kwargs):
        max_losses.append(max_loss)
        return log_step(step, loss, max_loss, *args, **kwargs)

    trainer.metrics.log_step = logged
    records = trainer.train()
    report = {
        "loss": [r.loss for r in records],
        "max_loss": max_losses,
        "z_loss": z_losses,
        "grad_norm": [r.grad_norm for r in records],
        "params": full_weights(trainer.model),
        "schedule": type(schedule).__name__,
        "schedule_steps": len(replica_all_reduces),
        "replica_all_reduces": replica_all_reduces,
        "fsdp_units": sum(fsdp_units_with_parameters(part) for part in trainer.pipeline.parts),
        "matmul_dtypes": sorted(matmul_dtypes),
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


def pp_args(schedule: str, local_batch: int, microbatch: int, *extra: str) -> list[str]:
    """The schedule with local_batch / microbatch micro-batches per step; 8 // local_batch
    accumulation steps (PP alone: one data-parallel rank reads the whole global batch)."""
    return [
        f"--parallelism.pipeline_parallel_schedule={schedule}",
        f"--training.local_batch_size={local_batch}",
        f"--parallelism.pipeline_parallel_microbatch_size={microbatch}",
        *extra,
    ]


# The stages by hand (the command line's form), unlike the default split: 2 blocks on the first.
BY_HAND = ["--parallelism.module_fqns_per_model_part=tok_embeddings,layers.0,layers.1;layers.2,norm,output"]
# The first stage holds a block too, the last only the norm and the output.
OUTPUT_ALONE = [
    "--parallelism.pipeline_parallel_first_stage_less_layers=0",
    "--parallelism.pipeline_parallel_layers_per_stage=1",
]

# PP 2 alone, on 2 ranks: every schedule at least once with accumulation (so it runs 16 times
# in a row), micro-batch counts 1, 2, 4 and 8 between them; activation checkpointing recomputes
# inside the stages of two of them.
PIPELINES = {
    "gpipe_m1_by_hand": pp_args("GPipe", 8, 8, *BY_HAND),
    "gpipe_m4_accum2": pp_args("GPipe", 4, 1),
    "1f1b_m2_accum2": pp_args("1F1B", 4, 2),
    "1f1b_m8": pp_args("1F1B", 8, 1),
    "interleaved1f1b_m1_accum2": pp_args("Interleaved1F1B", 4, 4),
    "interleaved1f1b_m4_selective_ac_op": pp_args("Interleaved1F1B", 8, 2, *SELECTIVE_OP),
    "looped_bfs_m2_accum2": pp_args("LoopedBFS", 4, 2),
    "interleaved_zero_bubble_m4_accum2_output_alone": pp_args("InterleavedZeroBubble", 4, 1, *OUTPUT_ALONE),
    "zbv_zero_bubble_m4_full_ac": pp_args("ZBVZeroBubble", 8, 2, *FULL_AC),
    "zbv_zero_bubble_m1_accum2": pp_args("ZBVZeroBubble", 4, 4),
    "dual_pipe_v_m4_accum2": pp_args("DualPipeV", 4, 1),
}

# PP 2 with the data-parallel and tensor-parallel layouts, on 4 ranks.
COMPOSED = {
    "pp2_fsdp2_interleaved1f1b_m2_accum2": pp_args("Interleaved1F1B", 2, 1),
    "pp2_tp2_1f1b_m2": pp_args("1F1B", 8, 4, *TP2),
    "pp2_tp2_no_sp_no_lp_zbv_m2_accum2": pp_args("ZBVZeroBubble", 4, 2, *TP2, *NO_SP, *NO_LP),
    "pp2_ddp2_gpipe_m2_accum2": pp_args("GPipe", 2, 1, *REPLICATE2),
    "pp2_ddp2_zbv_m2_accum2": pp_args("ZBVZeroBubble", 2, 1, *REPLICATE2),
    "pp2_fsdp2_zbv_m4": pp_args("ZBVZeroBubble", 4, 1),
    "pp2_fsdp2_interleaved_zero_bubble_m2_accum2": pp_args("InterleavedZeroBubble", 2, 1),
    # Each stage's attention all-gathers over its cp group; full AC recomputes the gathers.
    "pp2_cp2_1f1b_m2_full_ac": pp_args("1F1B", 8, 4, "--parallelism.context_parallel_degree=2", *FULL_AC),
}
# PP 2 x HSDP (2 replicas of 2 shards), on 8 ranks: one micro-batch per step, 2 accumulation steps.
HYBRID = {"pp2_hsdp2x2_gpipe_m1_accum2": pp_args("GPipe", 1, 1, *REPLICATE2)}
# The layouts above with replicas (FSDP2's replicate dimension: DDP is HSDP over shard groups of one).
REPLICATED = [name for name in {**COMPOSED, **HYBRID} if "ddp2" in name or "hsdp" in name]

# Qwen3-MoE at PP 2 x TP 2: the attention split over tp, the MoE feed-forward whole on both
# TP ranks of each stage; against the MoE's own single process.
MOE_COMPOSED = {"moe_pp2_tp2_1f1b_m2": pp_args("1F1B", 8, 4, *TP2, *TINY_MOE)}


# Document masking: every stage finds the documents in its micro-batch's tokens, which the
# pipeline hands it besides the previous stage's hidden states; with CP, in the whole
# sequences gathered over cp. Against test_parity's block_causal single process.
BLOCK_CAUSAL_PIPELINES = {
    "block_causal_pp2_1f1b_m2_accum2": (2, pp_args("1F1B", 4, 2, *BLOCK_CAUSAL)),
    "block_causal_pp2_cp2_zbv_m2": (4, pp_args("ZBVZeroBubble", 8, 4, *CP2, *BLOCK_CAUSAL)),
}


# Compiled blocks (and loss) inside the stages: compile per block under PP, checked like
# test_parity's compiled layouts (to 1e-4: the compiled kernels round differently).
COMPILED = {"compiled_pp2_interleaved1f1b_m2_accum2": pp_args("Interleaved1F1B", 4, 2, *COMPILE)}

# bf16 compute without FSDP: the whole schedule under autocast, against a single process
# that autocasts too, to test_parity's bf16 tolerance.
BF16 = ["--training.mixed_precision_param=bfloat16"]
BF16_RTOL = 2e-2
BF16_PIPELINE = {"bf16_zbv_m2_accum2": pp_args("ZBVZeroBubble", 4, 2, *BF16)}
BF16_REFERENCE = Job(1, train_and_report, ([*REFERENCE.args[0], *BF16],))


# The output z-loss (training.z_loss_coef), computed by the last stage's loss in the schedule,
# with 2 accumulation steps of 2 micro-batches: against a single process with the z-loss, which
# logs it from one micro-batch. 1e-2 (100 times the usual coefficient) so that it moves the weights.
Z_LOSS = ["--training.z_loss_coef=1e-2"]
Z_LOSS_PIPELINE = {"z_loss_pp2_1f1b_m2_accum2": pp_args("1F1B", 4, 2, *Z_LOSS)}


def train_one_process_with_z_loss(extra_args: list[str]) -> dict:
    """train_and_report's single process, with the z-loss as logged."""
    trainer = Trainer(parse_args(BASE_ARGS + extra_args))
    z_losses = logged_z_losses(trainer)
    records = trainer.train()
    return {
        "loss": [r.loss for r in records],
        "grad_norm": [r.grad_norm for r in records],
        "params": full_weights(trainer.model),
        "z_loss": z_losses,
    }


Z_LOSS_REFERENCE = Job(1, train_one_process_with_z_loss, ([*REFERENCE.args[0], *Z_LOSS],))


def whole_weights(rank_runs: list[dict], ref: dict) -> dict:
    """The weights of a run, each rank's stages' together; checks that no rank holds them all
    (a rank holding the whole model would not be pipelining)."""
    for run in rank_runs:
        assert 0 < len(run["params"]) < len(ref["params"])
    return {name: value for run in rank_runs for name, value in run["params"].items()}


def assert_pipeline_trains_like_one_process(rank_runs: list[dict], ref: dict, rtol: float = 1e-5) -> None:
    everyones = whole_weights(rank_runs, ref)
    for run in rank_runs:  # every rank must agree, not only rank 0
        # Its own weights, completed by the other stages' ranks' to the whole model's names.
        assert_same_training({**run, "params": {**everyones, **run["params"]}}, ref, rtol=rtol)


@pytest.mark.parametrize("layout", [*PIPELINES, *COMPOSED, *HYBRID])
def test_pipeline_matches_single_process(runs, layout):
    assert_pipeline_trains_like_one_process(runs[layout], runs["reference"][0])


@pytest.mark.parametrize("layout", MOE_COMPOSED)
def test_moe_pipeline_with_tensor_parallelism_matches_single_process(runs, layout):
    assert_pipeline_trains_like_one_process(runs[layout], runs["moe reference"][0])


@pytest.mark.parametrize("layout", BLOCK_CAUSAL_PIPELINES)
def test_block_causal_pipeline_matches_single_process(runs, layout):
    assert_pipeline_trains_like_one_process(runs[layout], runs["block causal reference"][0])


@pytest.mark.parametrize("layout", COMPILED)
def test_compiled_pipeline_matches_single_process(runs, layout):
    assert_pipeline_trains_like_one_process(runs[layout], runs["reference"][0], rtol=1e-4)


def test_the_z_loss_under_pipeline_parallelism_matches_one_process(runs):
    ref, plain = runs["z-loss reference"][0], runs["reference"][0]
    # The z-loss trains: the same first loss (the logged loss is the cross-entropy), other weights.
    assert ref["loss"][0] == plain["loss"][0]
    assert max((ref["params"][name] - value).abs().max() for name, value in plain["params"].items()) > 1e-3
    assert all(z > 0 for z in ref["z_loss"]) and len(ref["z_loss"]) == STEPS
    for name, rank_runs in ((name, runs[name]) for name in Z_LOSS_PIPELINE):
        assert_pipeline_trains_like_one_process(rank_runs, ref)
        for run in rank_runs:  # the first stage's rank too: the log's value is the global one
            torch.testing.assert_close(torch.tensor(run["z_loss"]), torch.tensor(ref["z_loss"]), rtol=1e-5, atol=0)
            assert run["max_loss"] == pytest.approx(run["loss"], rel=1e-6), name


def test_replicas_all_reduce_once_per_optimizer_step(runs):
    # Counted at the dispatcher in each pipeline run (2 accumulation steps of 8 optimizer
    # steps): torch's stage turns the replicas' all-reduce on for every run; only the last
    # run of a step makes it, one per FSDP unit of the rank's stages that holds parameters.
    for name in REPLICATED:
        for run in runs[name]:
            assert run["fsdp_units"] > 0
            assert run["replica_all_reduces"] == [0, run["fsdp_units"]] * STEPS, name


def test_bf16_pipeline_without_fsdp_autocasts_and_matches_single_process(runs):
    ref = runs["bf16 reference"][0]
    for name, rank_runs in ((name, runs[name]) for name in BF16_PIPELINE):
        for run in rank_runs:
            # Every Linear of every stage computed in bf16: the schedule ran under autocast.
            assert run["matmul_dtypes"] == ["torch.bfloat16"], name
            assert run["loss"] == pytest.approx(ref["loss"], rel=BF16_RTOL)
            assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=BF16_RTOL)
        everyones = whole_weights(rank_runs, ref)
        assert everyones.keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            # A tensor's difference against its size: one wrong Adam update (up to lr = 3e-3
            # an entry) moves a block's matrix (entries of about 1.5e-2) by some 20 %.
            assert (everyones[key] - value).norm() <= BF16_RTOL * value.norm(), (name, key)


def test_the_largest_data_parallel_loss_counts_the_stage_that_holds_the_loss(runs):
    # PP alone has one data-parallel rank: its mean loss is the loss. Only the last stage's
    # ranks hold a share, so counting every pp rank as a data-parallel rank would double it.
    for name in PIPELINES:
        for run in runs[name]:
            assert run["max_loss"] == pytest.approx(run["loss"], rel=1e-6), name
    # With 2 data-parallel ranks the largest of their means is at least the global mean and
    # below twice it.
    for run in runs["pp2_fsdp2_interleaved1f1b_m2_accum2"]:
        for loss, largest in zip(run["loss"], run["max_loss"], strict=True):
            assert loss <= largest * (1 + 1e-6) and largest < 2 * loss


def test_v_schedules_hold_the_embedding_and_the_output_on_rank_zero(runs):
    # Down the V and back up: stages 0 and 3 on rank 0, stages 1 and 2 on rank 1.
    for name in ("zbv_zero_bubble_m4_full_ac", "dual_pipe_v_m4_accum2"):
        first, second = (set(run["params"]) for run in runs[name])
        assert {"tok_embeddings.weight", "output.weight", "layers.2.attention.wq.weight"} <= first
        assert {"layers.0.attention.wq.weight", "layers.1.attention.wq.weight"} <= second
        assert not first & second


def test_every_schedule_runs_ten_times_in_a_row_without_hanging(runs):
    # Each job ran its schedule every accumulation step of 8 optimizer steps under NO_HANG's
    # timeouts: a deadlock would have failed the launch, naming the job.
    ran = {}
    for name in PIPELINES:
        for run in runs[name]:
            ran[run["schedule"]] = max(ran.get(run["schedule"], 0), run["schedule_steps"])
    assert {name.removeprefix("Schedule") for name in ran} == set(PIPELINE_SCHEDULES)
    assert min(ran.values()) >= 10, ran


# --- a schedule whose peer stops fails within the timeout ----------------------------------

STUCK_TIMEOUT = 3  # seconds


def counted_in(store, key: str, count: int) -> None:
    """Wait until `key` in the job's store has counted `count` ranks in (polling: the store's
    own waits give up after STUCK_TIMEOUT)."""
    while store.add(key, 0) < count:
        time.sleep(0.05)


def stuck_peer(extra_args: list[str]) -> dict:
    """Every rank takes one step; then the second stage's ranks stop taking part (waiting for
    word from the first's) while the first stage's take another. Returns what that step did
    on a first-stage rank and how long it took."""
    args = BASE_ARGS + ["--parallelism.pipeline_parallel_degree=2", f"--comm.init_timeout_seconds={STUCK_TIMEOUT}"]
    trainer = Trainer(parse_args(args + extra_args))
    store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    # Start the first step together: a rank still building its model must not time it out.
    store.add("built", 1)
    counted_in(store, "built", world)
    trainer.train_step()
    outcome = {}
    if trainer.pipeline.has_first:
        start = time.monotonic()
        try:
            trainer.train_step()
            outcome["error"] = None
        except RuntimeError as error:
            outcome["error"] = str(error)
        outcome["seconds"] = time.monotonic() - start
        store.add("first stage done", 1)
    else:
        counted_in(store, "first stage done", world // 2)
    dist.destroy_process_group()
    return outcome


def test_a_schedule_whose_peer_stops_fails_within_the_timeout(runs):
    # PP x DDP: nothing but the pipeline's sends and receives talks before the last
    # micro-batch, and the pp group is not the default one.
    for outcome in runs["stuck peer"][:2]:
        assert outcome["error"] is not None, "the step went on without its peer"
        # Failed by the timeout, not at once (a peer that died) and not after torch's
        # 30-minute default for a new group.
        assert STUCK_TIMEOUT - 0.5 < outcome["seconds"] < STUCK_TIMEOUT + 20, outcome


RUNS = {
    # The largest jobs first: the smaller ones and the references then share the ranks evenly.
    **{name: Job(8, train_pipeline, (args,)) for name, args in HYBRID.items()},
    **{name: Job(4, train_pipeline, (args,)) for name, args in {**COMPOSED, **MOE_COMPOSED}.items()},
    "stuck peer": Job(4, stuck_peer, (pp_args("GPipe", 2, 1, *REPLICATE2),)),
    "reference": REFERENCE,
    "moe reference": MOE_REFERENCE,
    "bf16 reference": BF16_REFERENCE,
    "block causal reference": BLOCK_CAUSAL_REFERENCE,
    "z-loss reference": Z_LOSS_REFERENCE,
    **{name: Job(n, train_pipeline, (args,)) for name, (n, args) in BLOCK_CAUSAL_PIPELINES.items()},
    **{name: Job(2, train_pipeline, (args,)) for name, args in {**PIPELINES, **COMPILED, **Z_LOSS_PIPELINE}.items()},
    **{name: Job(2, train_pipeline, (args, True)) for name, args in BF16_PIPELINE.items()},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    return run_jobs_on_ranks(8, RUNS)
