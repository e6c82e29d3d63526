"""Expert parallelism at the layer (titanlite/parallel/expert_parallel.py) against the
unsharded layer: on 2 gloo ranks, each rank's EP 2 forward and backward on its own tokens
equal the whole layer's on the same tokens with the same weights, the experts' gradients
equal the whole layer's summed over both ranks' tokens, also when one expert gets every
token and when the ranks hold different numbers of tokens; in bf16 (as FSDP gives it, and
under autocast) through the grouped GEMM, also on a rank whose experts receive no rows. All
cases run in one launch."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from tests.host_syncs import HostSyncs
from tests.rank_jobs import Job, run_jobs_on_ranks
from tests.test_moe import ARGS, GROUPED_MMS_PER_PASS, forward_context, make_moe
from titanlite.models.moe import MoE, MoEArgs
from titanlite.parallel.expert_parallel import apply_expert_parallel

EP = 2
WEIGHTS = ("w1", "w2", "w3")


def forward_backward(
    moe: MoE, x: torch.Tensor, probe: torch.Tensor, checkpointed: bool = False, precision: str = "as given"
) -> dict:
    """Output, input gradient and parameter gradients (local blocks for sharded experts);
    ``checkpointed``: the forward runs again in the backward (activation checkpointing);
    ``precision``: test_moe.forward_context's."""
    x = x.clone().requires_grad_(True)
    with forward_context(precision):
        out = checkpoint(moe, x, use_reentrant=False) if checkpointed else moe(x)
    (out.float() * probe).sum().backward()
    grads = {name: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for name, p in moe.named_parameters()}
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads}


def compare_with_whole_layer(
    moe: MoE,
    batch_shape: tuple[int, int],
    mesh,
    syncs: bool = False,
    checkpointed: bool = False,
    precision: str = "as given",
) -> dict:
    """This rank's EP run and the whole layer's on the same tokens: {"ep": ..., "whole": ...},
    the whole layer's expert gradients summed over the ranks and cut to this rank's experts;
    each with the grouped GEMMs it ran (counted at the dispatcher)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(*batch_shape, moe.args.dim, generator=gen).to(moe.gate.weight.dtype)
    probe = torch.randn(*batch_shape, moe.args.dim, generator=gen)
    with HostSyncs() as whole_counted:
        whole = forward_backward(moe, x, probe, precision=precision)
    whole["grouped_mms"] = whole_counted.other_ops["aten._grouped_mm"]
    n_local = moe.args.n_experts // EP
    for name in WEIGHTS:
        key = f"experts.{name}"
        dist.all_reduce(whole["grads"][key])  # every rank's tokens reach every expert
        whole["grads"][key] = whole["grads"][key][rank * n_local : (rank + 1) * n_local]
    moe.zero_grad()
    moe.reset_load()
    apply_expert_parallel(moe, mesh)
    with HostSyncs() as counted:
        ep = forward_backward(moe, x, probe, checkpointed, precision)
    ep["grouped_mms"] = counted.other_ops["aten._grouped_mm"]
    ep["counts"] = moe.tokens_per_expert.tolist()
    ep["syncs"] = len(counted.syncs) if syncs else None
    ep["placements"] = [moe.experts.get_parameter(name).grad.placements for name in WEIGHTS] == [(Shard(0),)] * 3
    return {"ep": ep, "whole": whole}


def expert_parallel_cases() -> dict:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",))
    results = {}
    # 4 experts, 2 per rank, top 2 of them per token, the same token count on both ranks.
    results["even"] = compare_with_whole_layer(make_moe(replace(ARGS, n_experts=4)), (2, 5), mesh)
    # 8 experts, 4 per rank, top 3; rank 0 holds 21 tokens, rank 1 holds 2.
    uneven = (3, 7) if dist.get_rank() == 0 else (1, 2)
    results["uneven"] = compare_with_whole_layer(make_moe(replace(ARGS, top_k=3)), uneven, mesh)
    # Expert 3 (on rank 1) wins every token's choice: rank 0's experts get nothing, rank 1's
    # expert 3 gets every token of both ranks.
    one = make_moe(MoEArgs(dim=16, n_experts=4, top_k=1, hidden_dim=24, bias_update_rate=1e-3)).train()
    one.expert_bias[3] = 100.0
    results["one_expert"] = compare_with_whole_layer(one, (3, 4), mesh)
    # Activation checkpointing: the all-to-alls run again in the backward, and the tokens are
    # still counted once.
    checkpointed = make_moe(replace(ARGS, n_experts=4)).train()
    results["checkpointed"] = compare_with_whole_layer(checkpointed, (2, 5), mesh, checkpointed=True)
    # bfloat16 through the grouped GEMM: the split sizes are the only host sync.
    results["grouped"] = compare_with_whole_layer(make_moe(dtype=torch.bfloat16), (2, 8), mesh, syncs=True)
    # float32 weights under autocast: the grouped GEMM too, on one process and under EP.
    results["autocast"] = compare_with_whole_layer(make_moe(), (2, 8), mesh, syncs=True, precision="autocast")
    # Under autocast again, with every token sent to expert 3: rank 0's experts receive no rows.
    idle = make_moe(MoEArgs(dim=16, n_experts=4, top_k=1, hidden_dim=24, bias_update_rate=1e-3)).train()
    idle.expert_bias[3] = 100.0
    results["idle_rank"] = compare_with_whole_layer(idle, (2, 8), mesh, syncs=True, precision="autocast")
    # The sharded weights are the whole ones, cut by expert, under the same names.
    moe = make_moe()
    whole_state = {name: tensor.clone() for name, tensor in moe.state_dict().items()}
    apply_expert_parallel(moe, mesh)
    results["state"] = {
        name: torch.equal(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor, whole_state[name])
        for name, tensor in moe.state_dict().items()
    }
    # Sharded on the meta device, then initialised from the same seed: the same weights as without EP.
    results["init"] = _same_init_with_and_without_ep(mesh)
    results["errors"] = [_error(make_moe(replace(ARGS, n_experts=3, top_k=1)), mesh), _error(moe, mesh)]
    return results


def _same_init_with_and_without_ep(mesh) -> bool:
    """Built on the meta device and sharded first, as parallelize_decoder builds models."""
    whole = MoE(ARGS)
    with torch.device("meta"):
        sharded = MoE(ARGS)
    apply_expert_parallel(sharded, mesh)
    sharded.to_empty(device="cpu")
    for moe in (whole, sharded):
        moe.init_weights(out_std=0.02, generator=torch.Generator().manual_seed(7))
    gathered = {name: sharded.experts.get_parameter(name).full_tensor() for name in WEIGHTS}
    return all(torch.equal(gathered[name], getattr(whole.experts, name)) for name in WEIGHTS)


def _error(moe: MoE, mesh) -> str:
    try:
        apply_expert_parallel(moe, mesh)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_jobs_on_ranks(EP, {"cases": Job(EP, expert_parallel_cases)})["cases"]


def assert_ep_equals_whole(ranks: list[dict], case: str, tol: float) -> None:
    for rank, result in enumerate(ranks):
        ep, whole = result[case]["ep"], result[case]["whole"]
        where = f"{case}, rank {rank}"
        assert ep["placements"], f"{where}: expert gradients are not Shard(0) DTensors"
        torch.testing.assert_close(ep["out"], whole["out"], rtol=tol, atol=tol, msg=f"{where}: output")
        torch.testing.assert_close(ep["x_grad"], whole["x_grad"], rtol=tol, atol=tol, msg=f"{where}: input grad")
        assert ep["grads"].keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():
            torch.testing.assert_close(ep["grads"][name], grad, rtol=tol, atol=tol, msg=f"{where}: {name} grad")


@pytest.mark.parametrize("case", ["even", "uneven", "one_expert", "checkpointed"])
def test_expert_parallel_equals_the_whole_layer_in_float32(runs, case):
    assert_ep_equals_whole(runs, case, tol=1e-6)


def test_dropless_when_every_token_goes_to_one_experts_rank(runs):
    # Each rank routed all of its 12 tokens to expert 3, held by rank 1 as its local expert 1;
    # the outputs equal the whole layer's (above), so every token came back from it.
    assert [result["one_expert"]["ep"]["counts"] for result in runs] == [[0, 0, 0, 12]] * 2
    per_local_expert = [result["one_expert"]["ep"]["grads"]["experts.w1"].abs().sum((1, 2)) for result in runs]
    assert per_local_expert[0].tolist() == [0, 0] and per_local_expert[1][0] == 0 and per_local_expert[1][1] > 0


@pytest.mark.parametrize("case", ["grouped", "autocast"])
def test_grouped_gemm_under_expert_parallelism_syncs_only_for_the_split_sizes(runs, case):
    # bf16's tolerance, test_parity's: EP sums each expert's rows in another order.
    assert_ep_equals_whole(runs, case, tol=2e-2)
    assert [result[case]["ep"]["syncs"] for result in runs] == [1, 1]
    # The grouped path on one process and on each EP rank, never the loop (it would sync).
    assert [result[case]["whole"]["grouped_mms"] for result in runs] == [GROUPED_MMS_PER_PASS] * EP
    assert [result[case]["ep"]["grouped_mms"] for result in runs] == [GROUPED_MMS_PER_PASS] * EP


def test_grouped_gemm_on_a_rank_whose_experts_receive_no_rows(runs):
    assert_ep_equals_whole(runs, "idle_rank", tol=2e-2)
    assert [result["idle_rank"]["ep"]["counts"] for result in runs] == [[0, 0, 0, 16]] * EP
    # Rank 0 runs no kernel on its empty rows, yet its experts get a (zero) gradient.
    assert [result["idle_rank"]["ep"]["grouped_mms"] for result in runs] == [0, GROUPED_MMS_PER_PASS]
    assert runs[0]["idle_rank"]["ep"]["grads"]["experts.w1"].abs().sum() == 0
    assert [result["idle_rank"]["ep"]["syncs"] for result in runs] == [1, 1]


def test_checkpointed_forward_counts_its_tokens_once(runs):
    for result in runs:  # 10 tokens, 2 experts each
        assert sum(result["checkpointed"]["ep"]["counts"]) == 20


def test_sharded_experts_keep_the_whole_weights_and_names(runs):
    for result in runs:
        assert result["state"] and all(result["state"].values()), result["state"]
        assert result["init"], "experts initialised after sharding differ from the unsharded init"


def test_bad_expert_parallel_use_is_refused_in_one_line(runs):
    indivisible, twice = runs[0]["errors"]
    assert indivisible == "expert_parallel_degree (2) must divide the MoE layer's n_experts (3)"
    assert "already sharded" in twice
