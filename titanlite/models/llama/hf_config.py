"""Hugging Face's LlamaConfig (a config.json) <-> LlamaArgs, in both directions.

The one place that knows how each hyper-parameter is spelled on the Hugging Face side;
the state-dict adapter beside it renames and permutes the weights.
"""

import dataclasses

from titanlite.models.llama.args import LlamaArgs, RopeScaling


def decoder_fields(args) -> dict:
    """The config.json fields that every decoder built on Llama's (Qwen3's too) spells alike."""
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
    }


def args_to_hf_config(args: LlamaArgs) -> dict:
    """The LlamaConfig fields that describe the model `args` builds."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_fields(args),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if args.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(args.rope_scaling)}
    return config


def ffn_sizing(dim: int, intermediate: int) -> tuple[int, float | None]:
    """multiple_of and ffn_dim_multiplier such that LlamaArgs.ffn_hidden_dim == intermediate."""

    def hidden_of(multiple_of, multiplier):
        return LlamaArgs(dim=dim, n_heads=1, multiple_of=multiple_of, ffn_dim_multiplier=multiplier).ffn_hidden_dim

    for multiple_of in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if intermediate % multiple_of == 0 and hidden_of(multiple_of, None) == intermediate:
            return multiple_of, None
    base = int(2 * (4 * dim) / 3)
    for multiplier in (intermediate / base, (intermediate + 0.5) / base):
        if hidden_of(intermediate, multiplier) == intermediate:
            return intermediate, multiplier
    raise ValueError(f"intermediate_size {intermediate} cannot be expressed for hidden_size {dim}")


def _check_supported(config: dict, where: str) -> None:
    """Refuse the LlamaConfig variants titanlite's model does not build."""
    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type '{config.get('model_type')}' is not llama")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{where}: biases in attention or MLP are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act '{config['hidden_act']}' is not supported (only silu)")


def rope_settings(config: dict, where: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and the llama3 frequency scaling, if any."""
    # Newer transformers keep rope_theta and the scaling under rope_parameters.
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
        return float(rope_theta), scaling
    if rope_type not in ("default", None):
        raise ValueError(f"{where}: rope type '{rope_type}' is not supported (only llama3 scaling)")
    return float(rope_theta), None


def key_reader(config: dict, where: str):
    """need(key): config[key], or a ValueError naming `where` and the missing key."""

    def need(key):
        if key not in config:
            raise ValueError(f"{where}: no '{key}'")
        return config[key]

    return need


def hf_config_to_args(config: dict, where: str = "config.json") -> LlamaArgs:
    """The LlamaArgs a config.json describes; ValueError naming `where` for what titanlite
    cannot build."""
    need = key_reader(config, where)

    _check_supported(config, where)
    dim, n_heads = need("hidden_size"), need("num_attention_heads")
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"{where}: head_dim {config['head_dim']} differs from hidden_size / num_attention_heads")
    rope_theta, rope_scaling = rope_settings(config, where)
    multiple_of, multiplier = ffn_sizing(dim, need("intermediate_size"))
    kv_heads = config.get("num_key_value_heads") or n_heads
    return LlamaArgs(
        dim=dim,
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if kv_heads == n_heads else kv_heads,
        vocab_size=need("vocab_size"),
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
    )


def hf_model_name(args: LlamaArgs) -> str:
    """The registry name for a model read from Hugging Face (both build the same class)."""
    return "llama2" if args.vocab_size == 32000 and args.rope_theta == 10000.0 else "llama3"
