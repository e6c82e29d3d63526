"""MoE load balancing in training, in one process: the [model] keys (refused for a model
without MoE layers, carried into the model's args), the auxiliary loss's gradients against
the loss written out by hand (whole model, and pooled per pipeline stage), the bias update
on a skipped step, and the metrics' tags. The data-parallel sums and the run's metrics are
checked under FSDP 2 in tests/test_qwen3_moe.py, in its launch of ranks."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import full_weights, tiny_args
from titanlite import train
from titanlite.config import parse_args
from titanlite.loss import cross_entropy_sum
from titanlite.metrics import tags
from titanlite.metrics.processor import moe_load_metrics
from titanlite.models.moe import MoE, MoEArgs
from titanlite.models.qwen3 import Qwen3Transformer
from titanlite.parallel.pipeline import prune_to_stage
from titanlite.plan import meta_model, plan_run
from titanlite.registry import get_model_args
from titanlite.train import Trainer

SEQ, BATCH, MICRO_BATCHES = 16, 2, 2
STEP_TOKENS = SEQ * BATCH * MICRO_BATCHES
COEF = 0.5  # large, so that the auxiliary loss's gradient is far above the tolerance


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [["--model.flavor=tiny"], ["--model.name=qwen3", "--model.flavor=tiny"]])
@pytest.mark.parametrize("key", ["moe_aux_loss_coef", "moe_bias_update_rate"])
def test_balancing_keys_are_refused_for_a_model_without_moe_layers(model, key, capsys):
    assert train.main(tiny_args() + model + [f"--model.{key}=0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"titanlite: config error: model.{key} (0.001) applies to MoE models only")


def test_balancing_keys_reach_the_model_built_on_meta():
    overrides = {"model.name": "qwen3", "model.flavor": "tiny_moe", "model.moe_aux_loss_coef": 0.25}
    job_config = parse_args(tiny_args(overrides))
    plan = plan_run(job_config, world_size=1)
    moe = next(module for module in meta_model(job_config, plan.model_args).modules() if isinstance(module, MoE))
    flavor = get_model_args("qwen3", "tiny_moe")
    # The key set, and the flavor's default for the other (off, as both are in the flavors).
    assert moe.args.router_aux_loss_coef == 0.25 and flavor.moe_aux_loss_coef == 0
    assert moe.args.bias_update_rate == flavor.moe_bias_update_rate == 0
    job_config = parse_args(tiny_args(overrides | {"model.moe_bias_update_rate": 1e-3}))
    assert plan_run(job_config, world_size=1).model_args.moe_bias_update_rate == 1e-3


# --- the auxiliary loss's gradients -----------------------------------------------------


def tiny_moe(coef: float) -> Qwen3Transformer:
    args = get_model_args("qwen3", "tiny_moe").with_seq_len(SEQ)
    model = Qwen3Transformer(replace(args, moe_aux_loss_coef=coef, moe_bias_update_rate=0.0))
    model.init_weights(seed=0)
    return model.train()


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 258, (MICRO_BATCHES, BATCH, SEQ + 1), generator=generator)
    return [(window[:, :-1], window[:, 1:]) for window in tokens]


def by_hand_aux_loss(gate_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """transformers' loss from the definition: the layers' routing pooled, then
    n_experts x sum over experts of (share of (token, expert) pairs) x (mean probability)."""
    probs = torch.cat([torch.softmax(logits.float(), dim=-1) for logits in gate_logits])
    chosen = F.one_hot(torch.topk(probs, top_k).indices, probs.shape[-1]).sum(dim=1).float()
    return probs.shape[-1] * torch.sum(chosen.mean(0) * probs.mean(0))


def capture_gate_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """The list that each MoE layer's router logits, [tokens, experts], will be appended to
    in each forward, computed here from the layer's input and gate."""
    captured = []

    def router_logits(moe, inputs):
        captured.append(inputs[0].reshape(-1, moe.args.dim) @ moe.gate.weight.T)

    for module in model.modules():
        if isinstance(module, MoE):
            module.register_forward_pre_hook(router_logits)
    return captured


def grads(*modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for module in modules for name, p in module.named_parameters() if p.grad is not None}


def by_hand_grads(stages: list[list[int]], with_aux: bool = True) -> tuple[dict, list[float]]:
    """The gradients of sum over micro-batches of CE_sum / step tokens + COEF x (micro-batch
    tokens / step tokens) x (the aux loss of each stage's layers, pooled), from a model with
    the loss off; and each micro-batch's aux losses summed over the stages."""
    model = tiny_moe(coef=0.0)
    captured = capture_gate_logits(model)
    aux_losses = []
    for inputs, labels in micro_batches():
        captured.clear()
        loss = cross_entropy_sum(model(inputs), labels) / STEP_TOKENS
        aux = sum(by_hand_aux_loss([captured[i] for i in stage], top_k=2) for stage in stages)
        aux_losses.append(aux.item())
        if with_aux:
            loss = loss + COEF * (inputs.numel() / STEP_TOKENS) * aux
        loss.backward()
    return grads(model), aux_losses


def assert_same_grads(ours: dict, expected: dict) -> None:
    assert ours.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def moe_layers(module: torch.nn.Module) -> list[MoE]:
    return [layer for layer in module.modules() if isinstance(layer, MoE)]


def test_the_aux_loss_gradient_is_the_mean_over_micro_batches_of_the_pooled_loss():
    model = tiny_moe(coef=COEF)
    for layer in moe_layers(model):
        layer.aux_loss_step_tokens = STEP_TOKENS  # as the trainer sets it
    for inputs, labels in micro_batches():
        (cross_entropy_sum(model(inputs), labels) / STEP_TOKENS).backward()
    expected, aux_losses = by_hand_grads(stages=[[0, 1, 2]])
    assert_same_grads(grads(model), expected)
    # The loss reaches the routers (the gates' gradients are not the cross-entropy's alone)...
    without_aux, _ = by_hand_grads(stages=[[0, 1, 2]], with_aux=False)
    gate = "layers.0.feed_forward.gate.weight"
    assert (expected[gate] - without_aux[gate]).abs().max() > 1e-4
    # ... and the metrics get its mean over the micro-batches, on the first layer.
    tallies = [layer.aux_loss_sum.item() for layer in moe_layers(model)]
    assert tallies[0] == pytest.approx(sum(aux_losses) / MICRO_BATCHES, rel=1e-6) and tallies[1:] == [0, 0]


def test_under_a_pipeline_split_each_stage_adds_the_loss_of_its_own_layers():
    """Two stages chained by hand as a pipeline runs them: the first stage's output (a hidden
    state, not the loss) carries its layers' loss, pooled over those layers only."""
    whole = tiny_moe(coef=COEF)
    stages = [("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "norm", "output")]
    parts = []
    for modules in stages:
        part = tiny_moe(coef=COEF)
        prune_to_stage(part, modules)
        part.load_state_dict({k: v for k, v in whole.state_dict().items() if k in part.state_dict()})
        for layer in moe_layers(part):
            layer.aux_loss_step_tokens = STEP_TOKENS
        parts.append(part)
    for inputs, labels in micro_batches():
        hidden = parts[0](inputs).detach().requires_grad_()  # what the next stage receives
        logits = parts[1](hidden)
        (cross_entropy_sum(logits, labels) / STEP_TOKENS).backward()
        parts[0](inputs).backward(hidden.grad)  # as the schedule sends the gradient back
    expected, _ = by_hand_grads(stages=[[0, 1], [2]])
    assert_same_grads(grads(*parts), expected)


# --- the bias, the metrics --------------------------------------------------------------


def test_a_skipped_step_leaves_the_bias_alone():
    moe = MoE(MoEArgs(dim=8, n_experts=4, top_k=2, hidden_dim=8, bias_update_rate=0.1))
    moe.expert_bias.zero_()
    counts = torch.tensor([5, 1, 1, 1])
    moe.update_expert_bias(counts, skip=torch.tensor(1.0))
    assert moe.expert_bias.abs().sum() == 0
    moe.update_expert_bias(counts, skip=torch.tensor(0.0))
    # Load 2 on average: the busy expert down by 0.1, the others up, then centred (mean 0.05 off).
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.15, 0.05, 0.05, 0.05]))


def test_the_metrics_name_each_layer_and_the_largest_load():
    metrics = moe_load_metrics({0: 1.25, 3: 2.5}, aux_loss=None)
    expected = {tags.moe_layer_load(0): 1.25, tags.moe_layer_load(3): 2.5, tags.MOE_MAX_LOAD: 2.5}
    assert metrics == expected
    assert moe_load_metrics({0: 1.0}, aux_loss=2.0)[tags.MOE_AUX_LOSS] == 2.0
    assert moe_load_metrics({}, aux_loss=None) == {}


def test_a_resumed_run_routes_with_the_saved_bias(tmp_path):
    """4 steps straight, and the same run resumed from its step-2 checkpoint: the same bias
    (a saved buffer) and so the same routing and weights at step 4."""
    overrides = {"model.name": "qwen3", "model.flavor": "tiny_moe", "model.moe_bias_update_rate": 0.01}
    overrides |= {"training.steps": 4, "checkpoint.enable": True, "checkpoint.interval": 2}
    args = tiny_args(overrides) + ["--job.dump_folder", str(tmp_path)]
    straight = Trainer(parse_args(args))
    straight.train()
    resumed = Trainer(parse_args(args + ["--checkpoint.load_step=2"]))
    assert resumed.step == 2
    resumed.train()
    ours, theirs = full_weights(resumed.model), full_weights(straight.model)
    biases = torch.stack([value for name, value in ours.items() if name.endswith("expert_bias")])
    assert biases.abs().max() > 0.005  # they moved, by 0.01 a step (one may be back at 0: they swing)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)
