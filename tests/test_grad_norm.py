"""total_grad_norm on gradients split every way one (dp, tp) mesh splits them.

Under FSDP x TP a run's gradients are DTensors sharded over both mesh dimensions, over one
and replicated over the other, or replicated over both, plus plain tensors every rank holds
whole. Each rank adds up |g|^p of its own pieces divided by how many ranks hold the same
piece; the sum over ranks must count every element once. A 2 x 2 mesh, so that a wrong
replica count on either dimension shows.

Both multi-rank runs are jobs of one launch (the `runs` fixture).
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.helpers import tiny_args
from tests.rank_jobs import Job, run_jobs_on_ranks
from titanlite.config import parse_args
from titanlite.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from titanlite.train import Trainer

NORM_TYPES = (2.0, 3.0, math.inf)
# (shape, placements over (dp, tp)); None: a plain tensor. Odd sizes shard unevenly.
GRADIENTS = (
    ((6, 5), (Shard(0), Shard(1))),  # FSDP x TP: a matrix split both ways
    ((7,), (Shard(0), Replicate())),  # a norm's weight: FSDP shards it, TP ranks repeat it
    ((4, 6), (Replicate(), Shard(0))),  # DDP x TP: TP splits it, replicas repeat it
    ((3, 3), (Replicate(), Replicate())),
    ((5,), None),
)


def full_gradients() -> list[torch.Tensor]:
    """The same values on every rank; the largest in magnitude lies in one rank's shard only."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) for shape, _ in GRADIENTS]
    grads[0][-1, -1] = -6.0  # dp rank 1 x tp rank 1: rank 3 alone holds it
    return grads


def norms_on_rank() -> dict:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    grads = [
        full.clone() if placements is None else distribute_tensor(full, mesh, list(placements))
        for full, (_, placements) in zip(full_gradients(), GRADIENTS, strict=True)
    ]
    report = {p: total_grad_norm(grads, p).item() for p in NORM_TYPES}
    # Each rank's pieces summed as they are, repeated pieces counted once per rank that
    # holds them: the answer a missing division would give, to show the test would see it.
    local = torch.stack([(g.to_local() if isinstance(g, DTensor) else g).square().sum() for g in grads])
    dist.all_reduce(local)
    report["without_division_2"] = local.sum().sqrt().item()
    # A gradient still to be summed over dp has no norm yet: refused before any collective.
    pending = DTensor.from_local(torch.ones(2), mesh, [Partial(), Replicate()])
    try:
        total_grad_norm([*grads, pending])
        report["partial_refused"] = False
    except ValueError:
        report["partial_refused"] = True
    dist.destroy_process_group()
    return report


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list]:
    dump = str(tmp_path_factory.mktemp("tp_gradients"))
    jobs = {"norms": Job(4, norms_on_rank), "tp gradients": Job(2, tensor_parallel_gradients_after_clipping, (dump,))}
    return run_jobs_on_ranks(4, jobs)


def test_grad_norm_counts_each_element_once(runs):
    every_element = torch.cat([g.flatten() for g in full_gradients()])
    expected = {p: torch.linalg.vector_norm(every_element, p).item() for p in NORM_TYPES}
    assert expected[math.inf] == 6.0
    for report in runs["norms"]:  # every rank gets the same norm
        for p in NORM_TYPES:
            assert report[p] == pytest.approx(expected[p], rel=1e-6), p
        assert report["without_division_2"] > 1.2 * expected[2.0]
        assert report["partial_refused"]


def tensor_parallel_gradients_after_clipping(dump: str) -> dict:
    """One backward of a TP 2 run without FSDP, then clipping: what each gradient became, and
    the global norm before and after clipping."""
    trainer = Trainer(parse_args(tiny_args({"parallelism.tensor_parallel_degree": 2, "job.dump_folder": dump})))
    inputs, labels = trainer.loader.next_batch()
    with trainer.loss_context():
        trainer.loss_fn(trainer.model(inputs), labels).backward()
    before = clip_grad_norm_(trainer.model.parameters(), max_norm=1.0).item()
    after = total_grad_norm([p.grad for p in trainer.model.parameters()]).item()
    layouts = {}
    for name, param in trainer.model.named_parameters():
        local = param.grad.to_local()
        layouts[name] = {
            "same_placements": tuple(param.grad.placements) == tuple(param.placements),
            "same_local_shape": local.shape == param.to_local().shape,
            "storage_is_the_shard": local.untyped_storage().nbytes() == local.numel() * local.element_size(),
        }
    dist.destroy_process_group()
    return {"layouts": layouts, "norms": (before, after)}


def test_clipping_scales_every_shard_to_the_max_norm(runs):
    # Clipping multiplies each rank's local shards; the parity tests clip alike on both
    # sides, so only this shows that the scale reached the DTensors' data at all.
    before, after = runs["tp gradients"][0]["norms"]
    assert before > 1.5 and after == pytest.approx(1.0, rel=1e-5)


def test_tensor_parallel_gradients_end_in_their_parameters_layout(runs):
    # Without FSDP, TP leaves the norms' gradients as partial sums and the vocabulary-split
    # embedding's gradient whole; the optimizer must see them laid out like the parameters,
    # and the whole embedding gradient must not stay alive behind a slice.
    layouts = runs["tp gradients"][0]["layouts"]
    assert "tok_embeddings.weight" in layouts and "layers.0.attention_norm.weight" in layouts
    for name, layout in layouts.items():
        assert all(layout.values()), (name, layout)


def test_cpu_norm_of_a_large_gradient_does_not_depend_on_its_split():
    """A layout that splits a gradient must measure the same norm as one that does not: on
    CPU a float32 sum of 4 M squares is about 1e-4 off, by an amount that changes with the
    split (FSDP 2 against one process read 1e-4 apart on the debug model)."""
    gradient = torch.randn(4 * 1024 * 1024, generator=torch.Generator().manual_seed(0))
    exact = gradient.double().norm().item()
    whole = total_grad_norm([gradient]).item()
    halves = total_grad_norm(list(gradient.chunk(2))).item()
    assert whole == pytest.approx(exact, rel=1e-7)
    assert halves == pytest.approx(whole, rel=1e-7)
