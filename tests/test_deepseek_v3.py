"""DeepSeek-V3: tiny random transformers DeepseekV3ForCausalLM models (YaRN on, grouped
routing, a dense first block, with and without the query bottleneck, a non-zero expert
bias) read into titanlite's deepseek_v3 model give their logits and greedy tokens; a
training run seeded from one (checkpoint.initial_load_in_hf) starts from its logits and
loss; a titanlite checkpoint trained with the bias exports to transformers with its logits;
the published shapes, and the refusals.

The transformers models are built in this process (no Hub) and drawn as test_qwen3's are.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers import assert_hf_to_dcp_to_hf_is_exact, hf_tensors, load_script, tiny_args, train_tiny
from tests.test_qwen3 import NEW_TOKENS, PROMPT, SCRIPTS, TOKENS, hf_greedy
from titanlite.checkpoint.load import load_model
from titanlite.config import parse_args
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.metrics.flops import active_params, count_params
from titanlite.models.deepseek_v3 import args_to_hf_config
from titanlite.models.generate import generate
from titanlite.registry import get_model_args, model_from_hf_config
from titanlite.train import Trainer

DEEPSEEK = ["--model.name=deepseek_v3"]
TINY = get_model_args("deepseek_v3", "tiny")

# The tiny flavor as transformers spells it, but for its YaRN: a 4 x stretch of 16 positions
# whose two magnitudes differ, so that both the tables' magnitude and the softmax-scale
# correction are not 1.
TINY_HF_SHAPE = dict(
    vocab_size=258,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=96,
    first_k_dense_replace=1,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
)


@pytest.fixture(scope="module", params=[0, 32], ids=["plain_queries", "query_bottleneck"])
def hf_model(request, tmp_path_factory) -> tuple[Path, transformers.DeepseekV3ForCausalLM]:
    """A random DeepseekV3ForCausalLM of tiny's shape (q_lora_rank as the param, 0 for None)
    with a non-zero expert bias, saved. Its norm gains are drawn away from 1 and its other
    weights scaled by 5, for logits of order 10 (test_qwen3's save_random scales by 10: with
    this model's more matmuls per block, the blocks' outputs then reach 30 and float32's
    rounding, a few units in the last place there, alone comes near 1e-5 in the logits)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(q_lora_rank=request.param or None, **TINY_HF_SHAPE)
    folder = tmp_path_factory.mktemp("deepseek_v3") / str(request.param)
    return folder, save_drawn(transformers.DeepseekV3ForCausalLM(config), folder)


def save_drawn(model: transformers.DeepseekV3ForCausalLM, folder: Path) -> transformers.DeepseekV3ForCausalLM:
    """``model`` with its norm gains drawn, its other weights scaled by 5 and a random expert
    bias (hf_model's reasons), saved to ``folder``; in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.5) if "norm" in name else param.mul_(5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.5)
    model.save_pretrained(folder)
    return model.eval()


def test_a_transformers_deepseek_v3_imports_with_its_logits_and_greedy_tokens(hf_model):
    folder, theirs = hf_model
    ours, description = load_model(folder)
    assert description.name == "deepseek_v3" and description.args.rope_scaling.mscale_all_dim == 0.8
    assert description.args.q_lora_rank == (theirs.config.q_lora_rank or 0)
    biases = [b for name, b in ours.named_buffers() if name.endswith("expert_bias")]
    assert biases and all(b.abs().min() > 0 and b.dtype == torch.float32 for b in biases)
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours(TOKENS)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() <= 1e-5
    assert generate(ours, PROMPT, NEW_TOKENS) == hf_greedy(theirs, PROMPT, NEW_TOKENS)


def test_the_expert_bias_changes_the_choice(hf_model):
    """The bias takes part in choosing experts (without it the logits differ): the parity
    above checks it, not a bias that happens to change nothing."""
    ours, _ = load_model(hf_model[0])
    with torch.no_grad():
        with_bias = ours(TOKENS)
        for name, buffer in ours.named_buffers():
            if name.endswith("expert_bias"):
                buffer.zero_()
        assert (ours(TOKENS) - with_bias).abs().max().item() > 1e-3


def test_hf_to_dcp_to_hf_gives_the_same_tensors(hf_model, tmp_path):
    folder = hf_model[0]
    assert_hf_to_dcp_to_hf_is_exact(folder, tmp_path)


def test_a_run_seeded_from_a_transformers_folder_starts_from_its_logits_and_loss(tmp_path):
    """checkpoint.initial_load_in_hf from a random DeepseekV3ForCausalLM of the tiny flavor's
    config (titanlite's own config.json): before any step the run's logits are transformers'
    (the stacked experts, the latent attention's weights and the expert bias all read), and
    the first step's loss is transformers' cross-entropy on that step's batch."""
    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(**args_to_hf_config(TINY))
    theirs = save_drawn(transformers.DeepseekV3ForCausalLM(config), tmp_path / "hf")
    overrides = {"model.name": "deepseek_v3", "training.steps": 1, "checkpoint.initial_load_in_hf": True}
    overrides |= {"checkpoint.initial_load_path": str(tmp_path / "hf"), "job.dump_folder": str(tmp_path / "run")}
    trainer = Trainer(parse_args(tiny_args(overrides)))
    with torch.no_grad():
        ours, expected = trainer.model.eval()(TOKENS), theirs(TOKENS).logits
    assert expected.abs().max() > 1.0
    assert (ours - expected).abs().max().item() <= 1e-5
    batches, next_batch = [], trainer._next_batch

    def recorded_batch():
        batches.append(next_batch())
        return batches[-1]

    trainer._next_batch = recorded_batch
    trainer.model.train()
    (record,) = trainer.train()
    ((inputs, labels),) = batches
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(theirs(inputs).logits.flatten(0, 1), labels.flatten())
    assert record.loss == pytest.approx(loss.item(), rel=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny DeepSeek-V3 trained a few steps in this process with its default balancing
    (the expert bias updated after every step), with checkpoints."""
    return train_tiny(tmp_path_factory.mktemp("deepseek_v3_run"), DEEPSEEK)


def test_a_checkpoint_trained_with_the_bias_exports_to_transformers_with_its_logits(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert load_script(SCRIPTS / "convert_dcp_to_hf.py").main([str(trained.step_dir), str(out)]) == 0
    assert "routes without it" not in capsys.readouterr().out  # the bias is exported, not dropped
    exported = hf_tensors(out)
    bias = exported["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, trained.weights["layers.1.feed_forward.expert_bias"]) and bias.abs().max() > 0
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert isinstance(theirs, transformers.DeepseekV3ForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        expected = theirs.eval()(trained.tokens).logits
    assert (trained.logits - expected).abs().max().item() <= 1e-5
    # scripts/generate.py on the checkpoint continues a prompt as transformers does.
    prompt, tokenizer = "def main():", ByteTokenizer()
    continued = hf_greedy(theirs, [tokenizer.bos_id, *tokenizer.encode(prompt)], NEW_TOKENS)
    argv = ["--checkpoint", str(trained.step_dir), "--prompt", prompt, "--max_new_tokens", str(NEW_TOKENS)]
    capsys.readouterr()
    assert load_script(SCRIPTS / "generate.py").main(argv) == 0
    assert capsys.readouterr().out == prompt + tokenizer.decode(continued) + "\n"


def test_a_bf16_export_keeps_the_router_and_the_bias_in_float32(trained, tmp_path):
    """transformers keeps DeepSeek-V3's router weight and bias in float32 in every dtype."""
    out = tmp_path / "hf"
    export = load_script(SCRIPTS / "convert_dcp_to_hf.py")
    assert export.main([str(trained.step_dir), str(out), "--dtype", "bfloat16"]) == 0
    dtypes = {name: tensor.dtype for name, tensor in hf_tensors(out).items()}
    routers = {name for name in dtypes if name.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    assert len(routers) == 4  # two MoE blocks, a weight and a bias each
    assert all(dtypes[name] == torch.float32 for name in routers)
    assert {dtypes[name] for name in dtypes.keys() - routers} == {torch.bfloat16}


def test_the_671b_shape_has_the_published_total_and_active_parameters():
    """DeepSeek-V3's README_WEIGHTS: 671B parameters in the main model (the multi-token
    prediction module apart), of which a token meets 36.7B (the report rounds it to 37B).
    Counted on the model built on the meta device: the active ones are the weights a token's
    matmuls meet (its 8 routed experts, the shared one, the router, attention, the output
    projection; the embedding lookup is not a matmul)."""
    args = get_model_args("deepseek_v3", "671B")
    assert abs(count_params(args) / 671e9 - 1) < 0.01
    assert abs(active_params(args) / 36.7e9 - 1) < 0.01
    small = get_model_args("deepseek_v3", "16B")
    assert round(count_params(small) / 1e9, 1) == 15.7  # DeepSeek-V2-Lite's 15.7B
    assert round((active_params(small) + small.vocab_size * small.dim) / 1e9, 1) == 2.7  # its 2.4B + 0.2B rounding


def test_balancing_defaults_to_the_sigmoid_router_with_the_bias():
    """docs/model.md "Training an MoE": for sigmoid routing, the bias stepped in proportion to
    the load's distance from even at 0.05, with a sequence-wise loss of 1e-3; every flavor and
    an import start there."""
    for flavor in ("debugmodel", "671B"):
        args = get_model_args("deepseek_v3", flavor)
        assert args.moe_score_func == "sigmoid" and args.moe_bias_update_rate == 0.05
        assert args.moe_args().bias_update_rule == "proportional"
        assert args.moe_seq_balance_coef == 1e-3 and args.moe_load_balance_coef == args.moe_aux_loss_coef == 0
    imported = model_from_hf_config(args_to_hf_config(TINY))[1]
    assert imported == TINY


def test_the_config_round_trips_through_transformers():
    """titanlite's config.json builds transformers' DeepseekV3Config of the same model."""
    config = args_to_hf_config(TINY)
    theirs = transformers.DeepseekV3Config(**config).to_dict()
    assert model_from_hf_config(json.loads(json.dumps(theirs)))[1] == TINY


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"rope_interleave": False}, "rope_interleave false is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 differs"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope type 'llama3' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_deepseek_v3_configs_are_refused_in_one_line(change, expected):
    config = {**args_to_hf_config(TINY), **change}
    with pytest.raises(ValueError, match=expected) as error:
        model_from_hf_config(config, "x/config.json")
    assert "\n" not in str(error.value) and str(error.value).startswith("x/config.json")


def test_a_softmax_router_has_no_deepseek_v3_config():
    """The 16B shape routes by a softmax, which transformers' DeepSeek-V3 cannot."""
    with pytest.raises(ValueError, match="routes with moe_score_func softmax"):
        args_to_hf_config(replace(TINY, moe_score_func="softmax"))
