"""Hugging Face's DeepseekV3Config (a config.json) <-> DeepSeekV3Args, both ways.

The one place that knows how each DeepSeek-V3 hyper-parameter is spelled on the Hugging
Face side; the state-dict adapter beside it renames the weights.
"""

import dataclasses

from titanlite.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from titanlite.models.llama.hf_config import key_reader

MODEL_TYPE = "deepseek_v3"
MODEL_TYPES = (MODEL_TYPE,)

# DeepSeekV3Args field -> config.json key, for the fields spelled one to one.
_SAME = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "ffn_hidden_dim": "intermediate_size",
    "first_k_dense_replace": "first_k_dense_replace",
    "n_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "top_k": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size",
}
# YarnScaling field -> its key in rope_parameters, and the default transformers takes.
_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0, "attention_factor": None}


def args_to_hf_config(args: DeepSeekV3Args) -> dict:
    """The DeepseekV3Config fields that describe the model ``args`` builds; ValueError for a
    router transformers' DeepSeek-V3 cannot compute (softmax scores)."""
    if args.moe_score_func != "sigmoid":
        raise ValueError(
            f"this model routes with moe_score_func {args.moe_score_func}, and transformers' DeepSeek-V3 "
            "scores experts by a sigmoid only: it has no DeepseekV3Config"
        )
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope = {**rope, "rope_type": "yarn", **dataclasses.asdict(args.rope_scaling)}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MODEL_TYPE,
        **{theirs: getattr(args, ours) for ours, theirs in _SAME.items()},
        "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank or None,
        "n_group": args.moe_n_groups,
        "topk_group": args.moe_topk_groups,
        "norm_topk_prob": args.norm_topk_prob,
        "routed_scaling_factor": args.moe_route_scale,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": rope,
        # titanlite turns consecutive pairs of the rope part, which transformers calls interleaved.
        "rope_interleave": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    }


def _check_supported(config: dict, where: str) -> None:
    """Refuse the DeepseekV3Config variants titanlite's model does not build."""
    if config.get("attention_bias"):
        raise ValueError(f"{where}: biases in attention are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act '{config['hidden_act']}' is not supported (only silu)")
    if not config.get("rope_interleave", True):
        raise ValueError(f"{where}: rope_interleave false is not supported (titanlite turns interleaved pairs)")
    if config.get("tie_word_embeddings"):
        raise ValueError(f"{where}: tied input and output embeddings are not supported for DeepSeek-V3")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise ValueError(f"{where}: num_key_value_heads {kv_heads} differs from num_attention_heads {heads}")


def _rope(config: dict, where: str) -> tuple[float, YarnScaling | None]:
    """rope_theta and the YaRN scaling, if any (older files keep them in rope_scaling)."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"{where}: rope type '{rope_type}' is not supported (only yarn)")
    original = int(rope.get("original_max_position_embeddings", config.get("max_position_embeddings", 4096)))
    # transformers takes max_position_embeddings / original for a missing factor.
    factor = rope.get("factor") or config.get("max_position_embeddings", original) / original
    optional = {name: rope.get(name) if rope.get(name) is not None else default for name, default in _YARN.items()}
    floats = {name: None if value is None else float(value) for name, value in optional.items()}
    return theta, YarnScaling(factor=float(factor), original_max_position_embeddings=original, **floats)


def hf_config_to_args(config: dict, where: str = "config.json") -> DeepSeekV3Args:
    """The DeepSeekV3Args a config.json describes; ValueError naming ``where`` for what
    titanlite cannot build."""
    need = key_reader(config, where)
    _check_supported(config, where)
    rope_theta, rope_scaling = _rope(config, where)
    return DeepSeekV3Args(
        **{ours: int(need(theirs)) for ours, theirs in _SAME.items()},
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        moe_score_func="sigmoid",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        moe_route_scale=float(config.get("routed_scaling_factor", 2.5)),
        moe_n_groups=int(config.get("n_group") or 1),
        moe_topk_groups=int(config.get("topk_group") or 1),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
    )
