"""Hugging Face's Qwen3Config and Qwen3MoeConfig (a config.json) <-> Qwen3Args, both ways.

The one place that knows how each Qwen3 hyper-parameter is spelled on the Hugging Face
side; the state-dict adapter beside it renames and permutes the weights.
"""

from titanlite.models.llama.hf_config import decoder_fields, key_reader, rope_settings
from titanlite.models.qwen3.args import MOE_BALANCING, Qwen3Args

MODEL_TYPE = "qwen3"
MOE_MODEL_TYPE = "qwen3_moe"
MODEL_TYPES = (MODEL_TYPE, MOE_MODEL_TYPE)
# What Qwen3Config (transformers 5) takes when a config.json leaves head_dim out.
_DEFAULT_HEAD_DIM = 128


def args_to_hf_config(args: Qwen3Args) -> dict:
    """The Qwen3Config fields that describe the model `args` builds."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": MODEL_TYPE,
        **decoder_fields(args),
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
    }
    if args.is_moe:
        config.update(_moe_fields(args))
    return config


def _moe_fields(args: Qwen3Args) -> dict:
    """What makes a Qwen3MoeConfig of the same model (every block MoE), with the trained
    coefficient of transformers' auxiliary loss; ValueError for a router transformers'
    Qwen3-MoE cannot compute."""
    _check_exportable_router(args)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": MOE_MODEL_TYPE,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # output_router_logits makes every forward return each layer's router logits and,
        # in a forward given labels, add router_aux_loss_coef x the pooled load-balancing
        # loss to the loss. Off, as in the published configs (inference returns no router
        # logits); the coefficient is the one this model trained with, for a fine-tune that
        # turns the loss on.
        "output_router_logits": False,
        "router_aux_loss_coef": args.moe_aux_loss_coef,
    }


def _check_exportable_router(args: Qwen3Args) -> None:
    """transformers' Qwen3-MoE routes by a softmax over all experts, unscaled: refuse the
    router options it lacks (the balancing losses and the bias only steer training)."""
    unlike = {
        "moe_score_func": args.moe_score_func != "softmax",
        "moe_route_scale": args.moe_route_scale != 1.0,
        "moe_n_groups": args.moe_n_groups != 1,
    }
    if any(unlike.values()):
        name = next(name for name, differs in unlike.items() if differs)
        raise ValueError(
            f"this MoE model routes with {name} {getattr(args, name)}, which transformers' Qwen3-MoE has no "
            "setting for (it routes by a softmax over all experts, unscaled): it has no Qwen3MoeConfig"
        )


def _moe_args(config: dict, where: str, need) -> dict:
    """The Qwen3Args fields of a qwen3_moe config; ValueError for the layouts not built."""
    step, dense_layers = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if step != 1 or dense_layers:
        raise ValueError(
            f"{where}: only all-MoE blocks are supported (decoder_sparse_step 1 and no mlp_only_layers), "
            f"got decoder_sparse_step {step} and mlp_only_layers {dense_layers}"
        )
    # Published config.json files spell it num_experts; transformers 5 saves num_local_experts.
    n_experts = config.get("num_experts") or need("num_local_experts")
    return {
        "n_experts": n_experts,
        "top_k": need("num_experts_per_tok"),
        "moe_hidden_dim": need("moe_intermediate_size"),
        # Qwen3MoeConfig's default when the file leaves it out.
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        # The flavors' balancing, which config.json does not say (training-only), then the
        # pooled loss it does say.
        **MOE_BALANCING,
        "moe_aux_loss_coef": _trained_aux_loss_coef(config),
    }


def _trained_aux_loss_coef(config: dict) -> float:
    """The weight transformers trains this model's auxiliary loss with: router_aux_loss_coef
    (Qwen3MoeConfig's default 0.001) when output_router_logits is on, else none."""
    return float(config.get("router_aux_loss_coef", 0.001)) if config.get("output_router_logits") else 0.0


def _check_supported(config: dict, where: str) -> None:
    """Refuse the Qwen3Config variants titanlite's model does not build."""
    if config.get("attention_bias"):
        raise ValueError(f"{where}: biases in attention are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act '{config['hidden_act']}' is not supported (only silu)")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or ()):
        raise ValueError(f"{where}: sliding-window attention is not supported (use_sliding_window must be false)")


def hf_config_to_args(config: dict, where: str = "config.json") -> Qwen3Args:
    """The Qwen3Args a config.json describes; ValueError naming `where` for what titanlite
    cannot build."""
    need = key_reader(config, where)

    _check_supported(config, where)
    rope_theta, rope_scaling = rope_settings(config, where)
    if rope_scaling is not None:
        raise ValueError(f"{where}: RoPE scaling is not supported for Qwen3 (only the default rope type)")
    n_heads = need("num_attention_heads")
    moe = _moe_args(config, where, need) if config.get("model_type") == MOE_MODEL_TYPE else {}
    return Qwen3Args(
        dim=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or _DEFAULT_HEAD_DIM,
        ffn_hidden_dim=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        **moe,
    )
