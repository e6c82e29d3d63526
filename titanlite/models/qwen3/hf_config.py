"""Hugging Face's Qwen3Config (a config.json) <-> Qwen3Args, in both directions.

The one place that knows how each Qwen3 hyper-parameter is spelled on the Hugging Face
side; the state-dict adapter beside it renames and permutes the weights.
"""

from titanlite.models.llama.hf_config import rope_settings
from titanlite.models.qwen3.args import Qwen3Args

MODEL_TYPE = "qwen3"
# What Qwen3Config (transformers 5) takes when a config.json leaves head_dim out.
_DEFAULT_HEAD_DIM = 128


def args_to_hf_config(args: Qwen3Args) -> dict:
    """The Qwen3Config fields that describe the model `args` builds."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
    }


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

    def need(key):
        if key not in config:
            raise ValueError(f"{where}: no '{key}'")
        return config[key]

    _check_supported(config, where)
    rope_theta, rope_scaling = rope_settings(config, where)
    if rope_scaling is not None:
        raise ValueError(f"{where}: RoPE scaling is not supported for Qwen3 (only the default rope type)")
    n_heads = need("num_attention_heads")
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
    )
