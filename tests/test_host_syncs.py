"""Quiet steps never make the host wait for the device, with every feature of a step on.

A quiet step is one that does not log, read the unread steps (SYNC_EVERY), save or
validate. Between such steps the CPU should queue work ahead of the GPU; one host sync
drains that queue. tests/host_syncs.py counts syncs at the dispatcher (a TorchDispatchMode),
so it sees those made inside C++ as well as Python's ``.item()``, on the CPU too.

The run: 4 ranks, FSDP 2 x TP 2 (sequence and loss parallel), 2 micro-batches a step,
clipping, fused AdamW, EMA, training.skip_nonfinite_steps with a NaN step, spike skipping,
the output z-loss, validation and asynchronous checkpoints on other steps. One run covers the cases:
- steps 2, 3 and 5 (after a log line, before a validation, after one): no sync, and the
  mode saw each feature's operators; step 5 is non-finite, skipped without the host
  knowing (it learns at the save point of step 6);
- step 7, right after an asynchronous save, with an EMA update of old (a 0-d tensor weight
  passed to _foreach_lerp_): the mode counts its one sync, so the count can fail.
"""

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from tests.helpers import tiny_args
from tests.host_syncs import HostSyncs, is_host_sync
from tests.rank_jobs import Job, run_jobs_on_ranks
from titanlite.config import parse_args
from titanlite.loss import IGNORED_LABEL, cross_entropy_and_z_sums
from titanlite.nonfinite import SYNC_EVERY
from titanlite.train import Trainer

aten = torch.ops.aten

STEPS = 8
QUIET = (2, 3, 5)  # steps 1 and 8 log, 4 and 8 validate, 6 and 8 save
NAN_STEP = 5
PLANTED_STEP = 7
EMA_DECAY = 0.9
ARGS = tiny_args(
    {
        "training.steps": STEPS,
        "training.local_batch_size": 2,
        "training.global_batch_size": 8,  # dp 2 x local 2 x 2 micro-batches
        "training.max_norm": 0.5,  # below the norms of this run: clipping scales every step
        "training.skip_nonfinite_steps": 1,
        # Judged every step, but with so wide a margin that only the NaN step is skipped here
        # (tests/test_spikes.py skips spikes); the window is active from step 3 on.
        "training.skip_spike_steps": True,
        "training.spike_window": 4,
        "training.spike_sigmas": 1e4,
        "training.z_loss_coef": 1e-4,  # under loss parallel: a logsumexp over the vocabulary slices
        "parallelism.tensor_parallel_degree": 2,
        "optimizer.implementation": "fused",
        "ema.enable": True,
        "ema.decay": EMA_DECAY,
        "metrics.log_freq": 100,
        "validation.enable": True,
        "validation.freq": 4,
        "validation.steps": 1,
        "checkpoint.enable": True,
        "checkpoint.interval": 6,
        "checkpoint.async_mode": "async",
    }
)
assert SYNC_EVERY > STEPS  # no step reads the unread steps but the log and save steps

# Operators each feature runs in a step: the mode must have seen them all in every quiet
# step, or the zero it counted proves nothing.
FEATURE_OPS = {
    "FSDP's all-gathers": "fsdp.all_gather_copy_in",
    "TP's sequence-parallel collectives": "_c10d_functional.reduce_scatter_tensor",
    "the global gradient norm": "aten._foreach_norm",
    "clipping": "aten._foreach_mul_",
    "fused AdamW": "aten._fused_adamw_",
    "the EMA": "aten._fused_sgd_",
    "the non-finite flag": "aten.bitwise_not",
    "the spike window's ring": "aten.remainder",
    "the global loss the spike test reads, the z-loss's maximum and sum": "c10d.allreduce_",
}


def local_lists(ema) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The EMA's local averages and weights, in the order of its state dict."""
    averages = [average.to_local() for average in ema.averages.values()]
    return averages, [ema.weights[name].to_local() for name in ema.averages]


def old_ema_update(ema, skip):
    """The EMA's update before it kept its weight on the device: a sync inside C++."""
    weight = (~skip).to(torch.float32) * (1.0 - ema.decay)
    torch._foreach_lerp_(*local_lists(ema), weight)


def local_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def mode_reports(modes: dict[int, HostSyncs]) -> dict:
    """Per step: the syncs counted, where they were made, and the other operators seen."""
    return {
        "syncs": {step: dict(mode.syncs) for step, mode in modes.items()},
        "where": {step: mode.report() for step, mode in modes.items()},
        "ops": {step: dict(mode.other_ops) for step, mode in modes.items()},
    }


def quiet_steps_report(dump: str) -> dict:
    trainer = Trainer(parse_args([*ARGS, f"--job.dump_folder={dump}"]))
    modes = {step: HostSyncs() for step in (*QUIET, PLANTED_STEP)}
    # The EMA's local averages and weights before each step whose EMA update a test reads.
    snapshots, validated, saved, warnings = {}, [], [], []

    def watched(method, step_of):
        def run(*args):
            step = step_of()
            if method.__name__ == "_one_step" and step in (3, 4, NAN_STEP, NAN_STEP + 1):
                snapshots[step] = tuple(map(local_copies, local_lists(trainer.ema)))
            if step not in modes:
                return method(*args)
            if step == PLANTED_STEP:
                trainer.ema.update = lambda skip: old_ema_update(trainer.ema, skip)
            try:
                with modes[step]:
                    return method(*args)
            finally:
                trainer.ema.__dict__.pop("update", None)

        return run

    # The step a method's work belongs to: _one_step runs the next one, the others follow it.
    trainer._one_step = watched(trainer._one_step, lambda: trainer.step + 1)
    trainer._validate_if_due = watched(trainer._validate_if_due, lambda: trainer.step)
    trainer._save_or_stop = watched(trainer._save_or_stop, lambda: trainer.step)
    validate = trainer.validator.validate
    trainer.validator.validate = lambda model: (validated.append(trainer.step), validate(model))[1]
    save = trainer.checkpointer.save
    trainer.checkpointer.save = lambda step, **kwargs: (saved.append(step), save(step, **kwargs))[1]
    model_forward = trainer.model.forward

    def forward(tokens):  # NaN logits in every training micro-batch of NAN_STEP
        logits = model_forward(tokens)
        return logits * float("nan") if trainer.step == NAN_STEP - 1 and trainer.model.training else logits

    trainer.model.forward = forward
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("titanlite").addHandler(handler)
    trainer.train()
    weights = trainer.ema.weights.values()
    # (mesh, split over dp_shard, split over tp): FSDP's placements may be strided shards.
    layouts = {(w.device_mesh.mesh_dim_names, *(not p.is_replicate() for p in w.placements)) for w in weights}
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        **mode_reports(modes),
        "snapshots": snapshots,
        "validated": validated,
        "saved": saved,
        "warnings": warnings,
        "layouts": sorted(layouts),
    }


# Pipeline parallelism: PP 2 x FSDP 2, two stages per rank (Interleaved1F1B), two
# micro-batches a step, fused AdamW, clipping and the EMA; steps 1 and 4 log.
PP_ARGS = tiny_args(
    {
        "training.steps": 4,
        "training.local_batch_size": 2,
        "parallelism.pipeline_parallel_degree": 2,
        "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
        "training.max_norm": 0.5,
        "training.skip_spike_steps": True,  # the global loss from the last stage's ranks
        "training.spike_sigmas": 1e4,
        "training.z_loss_coef": 1e-4,  # on the last stage, in the schedule's loss
        "optimizer.implementation": "fused",
        "ema.enable": True,
        "metrics.log_freq": 100,
    }
)
PP_QUIET = (2, 3)
PP_FEATURE_OPS = {
    "the pipeline's sends": "c10d.send",
    "the pipeline's receives": "c10d.recv_",
    "FSDP's all-gathers": "fsdp.all_gather_copy_in",
    "the global gradient norm": "aten._foreach_norm",
    "fused AdamW": "aten._fused_adamw_",
    "the EMA": "aten._fused_sgd_",
    "the spike window's ring": "aten.remainder",
}


def pipeline_quiet_steps_report() -> dict:
    trainer = Trainer(parse_args(PP_ARGS))
    modes = {step: HostSyncs() for step in PP_QUIET}
    one_step = trainer._one_step

    def counted(*args):
        mode = modes.get(trainer.step + 1)
        if mode is None:
            return one_step(*args)
        with mode:
            return one_step(*args)

    trainer._one_step = counted
    trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()
    return mode_reports(modes)


# The output z-loss under loss parallel (riding this launch, which runs it in training above):
# logits split by vocabulary over TP 2, against the same logits whole in the same process.
Z_LOSS_COEF = 0.1


def z_loss_under_loss_parallel_report() -> dict:
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        torch.manual_seed(0)  # the same logits and labels on both ranks
        logits = torch.randn(2, 6, 20) * 4
        labels = torch.randint(0, 20, (2, 6))
        labels[1, 2] = IGNORED_LABEL
        whole = logits.clone().requires_grad_()
        cross_entropy, z_sum = cross_entropy_and_z_sums(whole, labels)
        (cross_entropy + Z_LOSS_COEF * z_sum).backward()
        split = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        with loss_parallel():
            split_cross_entropy, split_z_sum = cross_entropy_and_z_sums(split, labels)
            (split_cross_entropy + Z_LOSS_COEF * split_z_sum).backward()
        kept = labels != IGNORED_LABEL
        return {
            "whole": (cross_entropy.item(), z_sum.item(), whole.grad),
            "split": (split_cross_entropy.item(), split_z_sum.item(), split.grad.full_tensor()),
            "by_hand": (torch.logsumexp(logits, dim=-1).square() * kept).sum().item(),
            "local_vocab": split.to_local().shape[-1],
        }
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict[str, list[dict]]:
    jobs = {
        "fsdp_tp": Job(4, quiet_steps_report, (str(tmp_path_factory.mktemp("host_syncs")),)),
        "pipeline": Job(4, pipeline_quiet_steps_report),
        "z_loss_tp": Job(2, z_loss_under_loss_parallel_report),
    }
    return run_jobs_on_ranks(4, jobs)


@pytest.fixture(scope="module")
def ranks(launch) -> list[dict]:
    return launch["fsdp_tp"]


def test_quiet_pipeline_steps_make_no_host_sync(launch):
    for rank, report in enumerate(launch["pipeline"]):
        for step in PP_QUIET:
            assert report["syncs"][step] == {}, f"rank {rank} step {step}: {report['where'][step]}"
            ops = report["ops"][step]
            for feature, op in PP_FEATURE_OPS.items():
                assert ops.get(op, 0) > 0, f"rank {rank} step {step}: no {op} ({feature}); saw {sorted(ops)}"


def test_quiet_steps_make_no_host_sync(ranks):
    for rank, report in enumerate(ranks):
        for step in QUIET:
            assert report["syncs"][step] == {}, f"rank {rank} step {step}: {report['where'][step]}"


def test_the_quiet_steps_ran_every_feature_under_the_counter(ranks):
    for rank, report in enumerate(ranks):
        # Every weight sharded by FSDP; TP splits some, and replicates the others (the norms).
        assert report["layouts"] == [(("dp_shard", "tp"), True, False), (("dp_shard", "tp"), True, True)]
        for step in QUIET:
            ops = report["ops"][step]
            for feature, op in FEATURE_OPS.items():
                assert ops.get(op, 0) > 0, f"rank {rank} step {step}: no {op} ({feature})"
            assert ops["aten.nll_loss_forward"] == 2, "two micro-batches, each with its loss"
            # The norm's, the spike test's global loss, and each micro-batch's z-loss maximum and sum.
            assert ops["c10d.allreduce_"] == 1 + 1 + 2 * 2
        # Validation and the saves happened, on their own steps.
        assert report["validated"] == [4, 8]
        assert report["saved"] == [6, 8]
        assert any("step 5 skipped" in line for line in report["warnings"]), report["warnings"]


def test_the_z_loss_under_loss_parallel_equals_one_process(launch):
    for report in launch["z_loss_tp"]:
        assert report["local_vocab"] == 10  # each rank held half the vocabulary
        cross_entropy, z_sum, grad = report["whole"]
        split_cross_entropy, split_z_sum, split_grad = report["split"]
        assert z_sum == pytest.approx(report["by_hand"], rel=1e-6)
        assert split_cross_entropy == pytest.approx(cross_entropy, rel=1e-6)
        assert split_z_sum == pytest.approx(z_sum, rel=1e-6)
        torch.testing.assert_close(split_grad, grad, rtol=1e-5, atol=1e-6)


def test_the_counter_fires_on_the_planted_sync(ranks):
    for report in ranks:
        assert report["syncs"][PLANTED_STEP] == {"aten._local_scalar_dense.default": 1}
        assert "old_ema_update" in report["where"][PLANTED_STEP]


def test_the_ema_under_fsdp_and_tp_is_the_lerp_by_a_number_or_skips(ranks):
    weight = 1.0 - EMA_DECAY
    for report in ranks:
        # A finite quiet step: bit for bit what the Python-number overload computes.
        averages_before, _ = report["snapshots"][3]
        averages_after, weights_after = report["snapshots"][4]
        expected = local_copies(averages_before)
        torch._foreach_lerp_(expected, weights_after, weight)
        for got, want in zip(averages_after, expected, strict=True):
            assert torch.equal(got, want)
        assert any(not torch.equal(a, b) for a, b in zip(averages_before, averages_after, strict=True))
        # The non-finite step: neither the weights nor their average moved.
        for before, after in zip(report["snapshots"][NAN_STEP], report["snapshots"][NAN_STEP + 1], strict=True):
            for got, want in zip(after, before, strict=True):
                assert torch.equal(got, want)


# --- the counter itself, in this process -----------------------------------------------------


def count(fn) -> dict:
    with HostSyncs() as mode:
        fn()
    return dict(mode.syncs)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("item", lambda t: t.sum().item()),
        ("tolist", lambda t: t.tolist()),
        ("bool", lambda t: bool(t.sum() > 0)),
        ("float", lambda t: float(t.sum())),
        ("number argument", lambda t: torch.full((2,), t.sum())),
        ("nonzero", lambda t: t.nonzero()),
        ("boolean mask read", lambda t: t[t > 0]),
        ("boolean mask write of a computed value", lambda t: t.__setitem__(t > 0, t[0])),
        ("masked_select", lambda t: t.masked_select(t > 0)),
        ("unique", lambda t: t.unique()),
        ("equal", lambda t: torch.equal(t, t)),
        ("allclose", lambda t: torch.allclose(t, t)),
    ],
)
def test_each_kind_of_sync_is_counted(name, fn):
    tensor = torch.arange(-3.0, 5.0)
    assert sum(count(lambda: fn(tensor)).values()) >= 1, name


def test_work_that_stays_on_the_device_is_not_counted():
    tensor = torch.arange(-3.0, 5.0)

    def work():
        tensor[tensor > 0] = 0  # a masked_fill_, also on CUDA
        torch.where(tensor > 0, tensor, 1.0).mul_(2).sum()
        tensor.to(torch.float64)

    assert count(work) == {}


def test_copies_count_when_they_leave_the_device():
    # No accelerator here: the rule is shown on the meta device, whose tensors live nowhere.
    meta, cpu = torch.empty(3, device="meta"), torch.empty(3)
    assert is_host_sync(aten._to_copy.default, (meta,), {"device": torch.device("cpu")})
    assert is_host_sync(aten.copy_.default, (cpu, meta), {})
    assert not is_host_sync(aten.copy_.default, (meta, cpu), {})  # host to device: queued
    assert not is_host_sync(aten._to_copy.default, (cpu,), {"dtype": torch.float64})
    assert not is_host_sync(aten._to_copy.default, (cpu,), {"device": torch.device("cpu")})
