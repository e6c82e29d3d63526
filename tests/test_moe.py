"""The mixture-of-experts layer (titanlite/models/moe/) on its own: routing, grouped GEMM
against the loop over experts (bf16 and under autocast, empty experts, no rows, kept by
per-op checkpointing), dropless routing, both ways of load balancing, and parity with
transformers' Qwen3-MoE block."""

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.host_syncs import HostSyncs
from titanlite.models.moe import (
    MoE,
    MoEArgs,
    expert_linear,
    keep_top_groups,
    load_balancing_loss,
    route,
    route_logits,
    stack_hf_experts,
    unstack_hf_experts,
)

ARGS = MoEArgs(dim=16, n_experts=8, top_k=2, hidden_dim=24)


def make_moe(args: MoEArgs = ARGS, seed: int = 0, dtype: torch.dtype = torch.float32) -> MoE:
    moe = MoE(args)
    moe.init_weights(out_std=0.02, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # larger weights than the init's, so that differences show
        for param in moe.parameters():
            param.mul_(10)
    return moe.to(dtype)


def reference_choice(args: MoEArgs, choice: torch.Tensor) -> list[int]:
    """One token's experts from its choice scores [n_experts], by the definition: with
    groups, only those of the topk_groups groups whose two best scores sum highest."""
    allowed = range(args.n_experts)
    if args.n_groups > 1:
        per_group = args.experts_per_group
        groups = [choice[g * per_group : (g + 1) * per_group].tolist() for g in range(args.n_groups)]
        group_scores = [sum(sorted(group)[-2:]) for group in groups]
        best_groups = sorted(range(args.n_groups), key=lambda g: -group_scores[g])[: args.topk_groups]
        allowed = [e for e in allowed if e // per_group in best_groups]
    return sorted(allowed, key=lambda e: -choice[e].item())[: args.top_k]


def reference_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer computed token by token, expert by expert, straight from the definition."""
    args = moe.args
    bias = moe.expert_bias if args.bias_update_rate > 0 else torch.zeros(args.n_experts)
    out = torch.zeros_like(x)
    for t, token in enumerate(x.reshape(-1, args.dim)):
        logits = moe.gate.weight @ token
        scores = torch.softmax(logits, dim=-1) if args.score_func == "softmax" else torch.sigmoid(logits)
        chosen = reference_choice(args, (scores + bias).detach())
        weights = scores[chosen] / (scores[chosen].sum() if args.norm_topk_prob else 1) * args.route_scale
        for e, weight in zip(chosen, weights, strict=True):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            out.view(-1, args.dim)[t] += weight * (w2 @ (F.silu(w1 @ token) * (w3 @ token)))
    return out


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in module.named_parameters()}


ROUTERS = {
    "softmax": {},
    "softmax_unnormalised": {"norm_topk_prob": False},
    # 4 groups of 2, the best 2 groups' 4 experts open to a token's 3 choices; the bias shifts both choices.
    "sigmoid_groups_scaled_biased": {
        "score_func": "sigmoid",
        "route_scale": 2.5,
        "n_groups": 4,
        "topk_groups": 2,
        "bias_update_rate": 1e-3,
    },
    "softmax_groups_biased_unnormalised": {"norm_topk_prob": False, "n_groups": 2, "bias_update_rate": 1e-3},
}


@pytest.mark.parametrize("router", ROUTERS)
def test_loop_over_experts_equals_the_per_token_reference_in_float32(router):
    args = MoEArgs(dim=16, n_experts=8, top_k=3, hidden_dim=24, **ROUTERS[router])
    moe = make_moe(args)
    moe.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(13)) * 0.1)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    moe(x).pow(2).sum().backward()
    layer_out, layer_grads = moe(x), grads(moe)
    moe.zero_grad()
    expected = reference_forward(moe, x)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(layer_out, expected, rtol=0, atol=1e-6)
    for name, grad in grads(moe).items():
        # float32 rounding, against each gradient's own scale (route_scale 2.5 scales them 6-fold).
        torch.testing.assert_close(layer_grads[name], grad, rtol=1e-6, atol=1e-6 * grad.abs().max(), msg=name)


def test_group_limited_selection_keeps_the_best_groups_by_their_two_best_scores():
    # 3 groups of 3. Token 0: group 0 has the single best score (0.9) but its two best sum to
    # 1.0; group 1's sum to 1.3, group 2's to 1.1: groups 1 and 2 stay.
    # Token 1: groups 1 (0.98) and 0 (0.95) stay, group 2 (0.6) goes.
    choice = torch.tensor(
        [[0.9, 0.1, 0.0, 0.7, 0.6, 0.2, 0.55, 0.55, 0.0], [0.95, 0.0, 0.0, 0.5, 0.48, 0.46, 0.3, 0.3, 0.3]]
    )
    kept = keep_top_groups(choice, n_groups=3, topk_groups=2)
    inf = float("-inf")
    expected = torch.tensor(
        [[inf, inf, inf, 0.7, 0.6, 0.2, 0.55, 0.55, 0.0], [0.95, 0.0, 0.0, 0.5, 0.48, 0.46, inf, inf, inf]]
    )
    torch.testing.assert_close(kept, expected)
    # Through the router: without groups token 0 would take expert 0 first.
    args = MoEArgs(dim=4, n_experts=9, top_k=2, hidden_dim=8, score_func="sigmoid", n_groups=3, topk_groups=2)
    routing = route_logits(torch.logit(choice), torch.float32, args)
    assert routing.experts.tolist() == [[3, 4], [0, 3]]
    ungrouped = route_logits(torch.logit(choice), torch.float32, replace(args, n_groups=1, topk_groups=1))
    assert ungrouped.experts.tolist()[0] == [0, 3]


def test_the_router_computes_in_float32_under_autocast():
    """Autocast runs linear in bf16 (it is on autocast's lower-precision list): the router
    turns it off for its logits, which are the float32 products of the bf16 inputs."""
    moe = make_moe(dtype=torch.bfloat16)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(14)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(x.float(), moe.gate.weight.float()).dtype == torch.bfloat16  # what autocast would do
        logits = moe.gate(x)
        routing = route_logits(logits, x.dtype, moe.args)
    assert logits.dtype == routing.probs.dtype == torch.float32 and routing.weights.dtype == torch.bfloat16
    torch.testing.assert_close(logits, x.float() @ moe.gate.weight.float().T, rtol=1e-6, atol=1e-6)


# Grouped GEMMs per MoE layer in one forward and backward: w1, w3 and w2 forward, and each
# of them twice backward (the rows' gradient and the weights').
GROUPED_MMS_PER_PASS = 9


def forward_context(precision: str):
    """What a forward runs in: "autocast", float32 weights and tokens under CPU autocast bf16
    (the trainer's bf16 on one process, or TP or PP without FSDP); any other precision, the
    dtype they have (bf16 as FSDP's param dtype gives them, or float32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()


@pytest.mark.parametrize("precision", ["bf16", "autocast"])
def test_grouped_gemm_equals_the_loop_in_bf16_with_empty_experts_and_no_host_sync(precision):
    moe = make_moe(replace(ARGS, bias_update_rate=1e-3), dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    moe.expert_bias[[1, 5]] = -100.0  # experts 1 and 5 are never chosen: empty groups
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2)).to(moe.gate.weight.dtype).requires_grad_()
    results = {}
    for grouped in (True, False):
        moe.experts.use_grouped_mm = None if grouped else False
        moe.zero_grad()
        x.grad = None
        with HostSyncs() as syncs:
            with forward_context(precision):
                out = moe(x)
            out.float().pow(2).sum().backward()
        results[grouped] = (out, grads(moe) | {"x": x.grad.clone()}, syncs)
    (grouped_out, grouped_grads, grouped_syncs), (loop_out, loop_grads, loop_syncs) = results[True], results[False]
    assert moe.tokens_per_expert[[1, 5]].tolist() == [0, 0] and moe.tokens_per_expert.sum() == 2 * 32 * 2
    assert grouped_syncs.other_ops["aten._grouped_mm"] == GROUPED_MMS_PER_PASS
    assert loop_syncs.other_ops["aten._grouped_mm"] == 0
    assert not grouped_syncs.syncs, grouped_syncs.report()
    assert loop_syncs.syncs["Tensor.tolist"] == 3  # the loop reads the counts once per projection
    assert moe.tokens_per_expert.dtype == torch.int64  # integer counts survive the cast to bf16
    # Parameters keep their dtype (float32 under autocast) and so do their gradients.
    assert {grad.dtype for grad in grouped_grads.values()} == {moe.gate.weight.dtype}
    torch.testing.assert_close(grouped_out, loop_out, rtol=1.6e-2, atol=1e-2)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=1.6e-2, atol=2e-2, msg=name)


def test_expert_linear_paths_agree_with_empty_experts_and_with_no_rows():
    # Rows for experts 1 and 3 only: the others get none, which both paths must allow; then
    # no rows at all (an expert-parallel rank whose experts received none).
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    weight = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    probe = torch.randn(7, 8, generator=torch.Generator().manual_seed(5))
    for counts in ([0, 3, 0, 4], [0, 0, 0, 0]):
        rows = sum(counts)
        experts = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
        # By hand, in float32: row i times its expert's weight, and the gradients of sum(out * probe).
        w = weight.float()[experts]
        expected_out = torch.einsum("ri,roi->ro", x[:rows].float(), w)
        expected_x_grad = torch.einsum("ro,roi->ri", probe[:rows], w)
        expected_w_grad = torch.zeros(4, 8, 16).index_add_(0, experts, probe[:rows, :, None] * x[:rows, None].float())
        for grouped in (True, False):
            x_in, weight_in = x[:rows].clone().requires_grad_(), weight.clone().requires_grad_()
            with HostSyncs() as syncs:
                out = expert_linear(x_in, weight_in, torch.tensor(counts), grouped)
                (out.float() * probe[:rows]).sum().backward()
            where = f"counts {counts}, {'grouped' if grouped else 'loop'}"
            assert out.shape == (rows, 8), where
            # The grouped path: one kernel forward, two backward (rows' and weight's gradients);
            # none without rows.
            assert syncs.other_ops["aten._grouped_mm"] == (3 if grouped and rows else 0), where
            if grouped:
                assert not syncs.syncs, f"{where}: {syncs.report()}"
            for got, expected in ((out, expected_out), (x_in.grad, expected_x_grad), (weight_in.grad, expected_w_grad)):
                torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=2e-2, msg=where)


def test_per_op_checkpointing_keeps_the_grouped_gemms():
    """The trainer's per-op selective activation checkpointing (parallelize.py's saved ops)
    keeps what the grouped GEMMs computed, under autocast too: its backward runs as many as
    without checkpointing, where full checkpointing runs the forward's 3 again."""
    from titanlite.parallel.parallelize import apply_activation_checkpointing

    calls = {}
    for mode in ("none", "selective", "full"):
        layers = nn.ModuleDict({"0": make_moe()})
        apply_activation_checkpointing(layers, mode, selective_option="op")
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(6), requires_grad=True)
        with HostSyncs() as counted:
            with forward_context("autocast"):
                out = layers["0"](x)
            out.pow(2).sum().backward()
        calls[mode] = counted.other_ops["aten._grouped_mm"]
    assert calls == {"none": GROUPED_MMS_PER_PASS, "selective": GROUPED_MMS_PER_PASS, "full": GROUPED_MMS_PER_PASS + 3}


def test_dropless_when_the_router_sends_every_token_to_one_expert():
    for top_k in (1, 2):
        args = MoEArgs(dim=16, n_experts=4, top_k=top_k, hidden_dim=24, bias_update_rate=1e-3)
        moe = make_moe(args).train()
        moe.expert_bias[2] = 100.0  # expert 2 wins every token's choice
        x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(5))
        out = moe(x)
        routing = route(x.reshape(-1, 16), moe.gate.weight, args, moe.expert_bias)
        assert (routing.experts == 2).any(dim=-1).all() and routing.experts.shape == (21, top_k)
        assert moe.tokens_per_expert[2] == 21 and moe.tokens_per_expert.sum() == 21 * top_k
        torch.testing.assert_close(out, reference_forward(moe, x), rtol=0, atol=1e-6)


def test_expert_bias_chooses_experts_but_never_weights_them():
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(6))
    gate = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(8, generator=torch.Generator().manual_seed(8))
    plain, biased = route(x, gate, ARGS, None), route(x, gate, ARGS, bias)
    assert not torch.equal(plain.experts, biased.experts)
    chosen = biased.probs.gather(-1, biased.experts)
    torch.testing.assert_close(biased.weights, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(biased.probs, plain.probs)


def test_bias_update_raises_the_idle_experts_centred_and_on_the_device():
    moe = make_moe(MoEArgs(dim=16, n_experts=4, top_k=1, hidden_dim=24, bias_update_rate=0.01))
    counts = torch.tensor([10, 0, 2, 4])  # mean 4: expert 3 is exactly at it
    with HostSyncs() as syncs:
        moe.update_expert_bias(counts)
    assert not syncs.syncs, syncs.report()
    # signs (-1, +1, +1, 0), mean 0.25, centred: (-1.25, 0.75, 0.75, -0.25) x 0.01
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-1.25, 0.75, 0.75, -0.25]) * 0.01)
    assert moe.gate.weight.grad is None


def test_the_proportional_bias_update_steps_by_the_distance_from_the_mean_load():
    args = MoEArgs(dim=16, n_experts=4, top_k=1, hidden_dim=24, bias_update_rate=0.05, bias_update_rule="proportional")
    moe = make_moe(args)
    counts = torch.tensor([10, 0, 2, 4])  # mean 4
    with HostSyncs() as syncs:
        moe.update_expert_bias(counts)
    assert not syncs.syncs, syncs.report()
    # (mean - load) / mean = (-1.5, 1, 0.5, 0): already centred, so the step is 0.05 x that
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-1.5, 1.0, 0.5, 0.0]) * 0.05)
    moe.update_expert_bias(torch.tensor([4, 4, 4, 4]))  # an even load leaves the bias where it is
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-1.5, 1.0, 0.5, 0.0]) * 0.05)


def test_load_counts_add_up_over_training_forwards_only():
    moe = make_moe()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(9))
    moe.train()
    moe(x)
    moe(x)
    moe.eval()
    moe(x)
    once = route(x.reshape(-1, 16), moe.gate.weight, ARGS).experts
    expected = 2 * torch.bincount(once.reshape(-1), minlength=8)
    torch.testing.assert_close(moe.tokens_per_expert, expected)
    torch.testing.assert_close(moe.load_imbalance(), expected.max() / expected.float().mean())
    moe.reset_load()
    assert moe.tokens_per_expert.abs().sum() == 0
    # Activation checkpointing runs the forward again during backward: counted once.
    checkpoint(moe.train(), x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(moe.tokens_per_expert, expected // 2)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_equal_to_transformers_qwen3_moe_block(norm_topk_prob):
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=ARGS.dim,
        moe_intermediate_size=ARGS.hidden_dim,
        num_experts=ARGS.n_experts,
        num_experts_per_tok=ARGS.top_k,
        norm_topk_prob=norm_topk_prob,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(10)
    theirs = qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.5)
    # transformers checkpoints hold one tensor per expert and projection; its loader
    # concatenates gate and up along dim 1 into gate_up_proj, and stacks down_proj.
    saved = {"mlp.gate.weight": theirs.gate.weight.detach()}
    for e in range(8):
        gate, up = theirs.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        saved |= {f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up}
        saved[f"mlp.experts.{e}.down_proj.weight"] = theirs.experts.down_proj[e].detach()

    ours = MoE(replace(ARGS, norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01))
    ours.init_weights(out_std=0.02, generator=torch.Generator().manual_seed(0))
    stacked = stack_hf_experts(saved, "mlp.experts", n_experts=8)
    with torch.no_grad():
        ours.gate.weight.copy_(saved["mlp.gate.weight"])
        for name, tensor in stacked.items():
            getattr(ours.experts, name).copy_(tensor)
    back = unstack_hf_experts({name: getattr(ours.experts, name) for name in stacked}, "mlp.experts")
    assert back.keys() == saved.keys() - {"mlp.gate.weight"}
    assert all(torch.equal(tensor, saved[key]) for key, tensor in back.items())

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-5)
    router_logits = theirs.gate(x.reshape(-1, 16))[0]
    their_loss = qwen3_moe.load_balancing_loss_func((router_logits,), 8, 2)
    torch.testing.assert_close(load_balancing_loss([ours.last_router_stats]), their_loss, rtol=1e-6, atol=0)
    # Pooled over two "layers" (the same one twice, a second input) as transformers pools them.
    y = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(12))
    first = ours.last_router_stats
    ours(y)
    both = qwen3_moe.load_balancing_loss_func((router_logits, theirs.gate(y.reshape(-1, 16))[0]), 8, 2)
    torch.testing.assert_close(load_balancing_loss([first, ours.last_router_stats]), both, rtol=1e-6, atol=0)


def test_missing_expert_weight_is_named():
    saved = {f"mlp.experts.{e}.{p}.weight": torch.zeros(2, 2) for e in range(2) for p in ("gate_proj", "up_proj")}
    with pytest.raises(KeyError, match=r"'mlp.experts.0.down_proj.weight' is missing \(2 experts expected"):
        stack_hf_experts(saved, "mlp.experts", n_experts=2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"top_k": 9}, r"MoEArgs.top_k \(9\) must not exceed n_experts \(8\)"),
        ({"n_experts": 0, "top_k": 0}, "MoEArgs.n_experts must be at least 1, got 0"),
        ({"bias_update_rate": -1.0}, "MoEArgs.bias_update_rate must be 0 or more, got -1.0"),
        ({"z_loss_coef": -1.0}, "MoEArgs.z_loss_coef must be 0 or more, got -1.0"),
        ({"score_func": "relu"}, "MoEArgs.score_func must be one of softmax, sigmoid, got 'relu'"),
        ({"bias_update_rule": "pid"}, "MoEArgs.bias_update_rule must be one of sign, proportional, got 'pid'"),
        ({"route_scale": 0.0}, "MoEArgs.route_scale must be above 0, got 0.0"),
        ({"n_groups": 3}, r"MoEArgs.n_groups \(3\) must divide n_experts \(8\)"),
        ({"n_groups": 4, "topk_groups": 5}, r"MoEArgs.topk_groups \(5\) must not exceed n_groups \(4\)"),
        (
            {"n_groups": 4, "top_k": 3},
            r"MoEArgs.top_k \(3\) must not exceed the experts of topk_groups groups \(1 x 2\)",
        ),
    ],
)
def test_bad_args_are_refused_in_one_line(changes, message):
    fields = {"dim": 16, "n_experts": 8, "top_k": 2, "hidden_dim": 24} | changes
    with pytest.raises(ValueError, match=message):
        MoEArgs(**fields)
