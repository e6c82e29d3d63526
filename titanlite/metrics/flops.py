"""Model FLOPs per token, device peak FLOPs, and the TFLOPs and MFU derived from them.

MFU (model FLOPs utilisation, PaLM appendix B) compares the FLOPs the model needs per
token, times the tokens per second achieved, with the device's dense peak. Recomputation
(activation checkpointing, flash attention's backward) is not counted: MFU measures
useful work, not work done.
"""

import functools
import re
from dataclasses import dataclass

import torch

from titanlite.models.moe import MoE, moe_layers

# --- parameter counts ----------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a titanlite decoder (any family's), by the parts FSDP shards as units."""

    total: int  # every parameter once: a tied output projection is the embedding's matrix
    embedding: int  # the token embedding table
    blocks: tuple[int, ...]  # each transformer block's, in order
    head: int  # the final norm's and the output projection's, tied or not (its matmul is work)
    idle_experts: int = 0  # routed experts' weights a token does not meet: all but its top_k in each MoE layer
    experts: tuple[int, ...] = ()  # each block's routed experts' weights (0 for a dense block), in order
    moe_active: int = 0  # weights a token meets in the MoE layers (routers and its top_k experts), any TP degree

    @property
    def root(self) -> int:
        """The root unit's: the embedding, the final norm and the output projection."""
        return self.total - sum(self.blocks)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def model_on_meta(args) -> torch.nn.Module:
    """The decoder ``args`` describe (the model class their family's args name, model_cls),
    built on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return args.model_cls()(args)


@functools.lru_cache(maxsize=64)
def param_counts(args) -> ParamCounts:
    """Counted on the model itself, built on the meta device (shapes only, no memory), so
    the counts follow the model's layout wherever it changes."""
    model = model_on_meta(args)
    return ParamCounts(
        _numel(model),
        _numel(model.tok_embeddings),
        tuple(_numel(b) for b in model.layers.values()),
        _numel(model.norm) + model.output.weight.numel(),
        idle_expert_params(model),
        tuple(routed_expert_params(block) for block in model.layers.values()),
        active_moe_params(model),
    )


def routed_expert_params(module: torch.nn.Module) -> int:
    """The routed experts' weights in ``module`` (all experts of every MoE layer in it; the
    routers not included): what expert parallelism splits."""
    return sum(_numel(moe.experts) for moe in moe_layers(module))


def idle_expert_params(module: torch.nn.Module) -> int:
    """Of the MoE layers in ``module``, the experts' weights one token skips: in each layer
    the n_experts - top_k experts it is not routed to."""
    return sum(_idle_expert_params(moe) for moe in moe_layers(module))


def _idle_expert_params(moe: MoE) -> int:
    """Of one MoE layer's stacked experts, the weights of the n_experts - top_k a token skips."""
    per_expert = _numel(moe.experts) // moe.args.n_experts
    return (moe.args.n_experts - moe.args.top_k) * per_expert


def active_moe_params(module: torch.nn.Module) -> int:
    """Of the MoE layers in ``module``, the weights one token meets: each layer's router and
    its top_k experts (the layer's weights less the experts it skips). Tensor parallelism splits
    their work by token: each TP rank routes its own slice of the sequence."""
    return sum(_numel(moe) - _idle_expert_params(moe) for moe in moe_layers(module))


def count_params(args, include_embedding: bool = True) -> int:
    """Parameters of titanlite's decoder, each once. Without the embedding table: the weights
    a token's matmuls meet, the output projection included even when it is tied to the
    embedding (its matmul is work; the lookup is not)."""
    counts = param_counts(args)
    return counts.total if include_embedding else sum(counts.blocks) + counts.head


def active_params(args) -> int:
    """The weights one token's matmuls meet: count_params without the embedding, less the
    routed experts the token is not sent to (an MoE model's top_k of n_experts per layer).
    Equal to count_params(args, include_embedding=False) for a dense model."""
    return count_params(args, include_embedding=False) - param_counts(args).idle_experts


@functools.lru_cache(maxsize=64)
def block_flops_per_token(args, seq_len: int) -> tuple[int, ...]:
    """Training FLOPs per token of each block, counted on the model built on the meta device:
    6 x the block's weights a token meets (in an MoE block its top_k routed experts, not the
    others) plus the block's share of attention_flops_per_token. What a pipeline split by work
    weighs each block by (DeepSeek-V3's dense and MoE blocks differ)."""
    attention = attention_flops_per_token(args, seq_len) // args.n_layers
    blocks = model_on_meta(args).layers.values()
    return tuple(6 * (_numel(block) - idle_expert_params(block)) + attention for block in blocks)


def attention_flops_per_token(args, seq_len: int, causal: bool = True) -> int:
    """Training FLOPs per token of attention's two matmuls (QK^T and scores x V), which
    involve no parameters: 12 x n_layers x n_heads x head_dim x seq_len for the whole
    [seq, seq] score matrix (2 matmuls x 2 FLOPs per multiply-add x 3 for forward and
    backward), half of that when only the causal half is counted (``causal``, the default):
    a token attends to the tokens before it, on average half the sequence.

    torchtitan and PaLM count the whole matrix (``causal=False``), ignoring the mask."""
    whole = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return whole // 2 if causal else whole


def flops_per_token(args, seq_len: int, causal_attention: bool = True) -> int:
    """Training FLOPs (forward + backward) per token:

        6 x active_params + attention_flops_per_token

    The first term is the usual 2 FLOPs per multiply-add in the forward pass plus 4 in
    the backward, for every weight a token meets; the embedding is a table lookup, not
    a matmul, so it is left out (the output projection stays in), and in an MoE model only
    the token's top_k experts count, not the experts it skips (the router, which every
    token meets, does).

    The second term counts attention causally by default (6 x L x H x Dh x T), the work
    the model needs. ``causal_attention=False`` gives torchtitan's and PaLM's convention
    (12 x L x H x Dh x T), under which the same run's FLOPs per token, TFLOPs and MFU read
    higher at long sequence lengths; benchmarks print both so that titanlite's figures
    compare with published ones on the same terms (docs/metrics.md).
    """
    return 6 * active_params(args) + attention_flops_per_token(args, seq_len, causal_attention)


# --- device peaks ----------------------------------------------------------------------------

# Dense (no 2:4 sparsity) bf16 tensor-core peak per device, from the vendors' data sheets;
# fp16 for V100 and T4, which have no bf16. Rows are (model token, variant substring or
# None, FLOP/s); the first row whose model is a whole word of the device name and whose
# variant appears in it wins, so variants come before their model's plain row.
_PEAK_FLOPS = (
    ("A100", None, 312e12),
    ("A800", None, 312e12),
    ("H100", "NVL", 835e12),
    ("H100", "PCIE", 756e12),
    ("H100", None, 989e12),  # SXM, reported e.g. as "NVIDIA H100 80GB HBM3"
    ("H800", None, 989e12),
    ("H200", None, 989e12),
    ("GH200", None, 989e12),
    ("B200", None, 2.25e15),
    ("GB200", None, 2.5e15),
    ("L40S", None, 362e12),
    ("L40", None, 181e12),
    ("L4", None, 121e12),
    ("A10", None, 125e12),
    ("A10G", None, 70e12),  # AWS variant of the A10; no NVIDIA data sheet, commonly quoted figure
    ("V100", "PCIE", 112e12),
    ("V100", None, 125e12),
    ("T4", None, 65e12),
    ("MI250X", None, 383e12),
    ("MI300X", None, 1307e12),
    ("MI325X", None, 1307e12),
)


def peak_flops_per_device(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU, looked up by its name (torch.cuda.get_device_name);
    None for a CPU or a device not in the table.

    Model names are matched as whole words so that "A10" does not match an A100 and
    "L4" does not match an L40S.
    """
    upper = device_name.upper()
    words = set(re.split(r"[^A-Z0-9]+", upper))
    for model, variant, flops in _PEAK_FLOPS:
        if model in words and (variant is None or variant in upper):
            return flops
    return None


def resolve_peak_flops(peak_tflops: float, device: torch.device) -> float | None:
    """The peak to compute MFU against: metrics.peak_tflops when set (> 0), else the
    table's value for a CUDA device, else None (CPU, unknown GPU: no MFU)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type == "cuda":
        return peak_flops_per_device(torch.cuda.get_device_name(device))  # cuda-only
    return None


# --- achieved -----------------------------------------------------------------------------


def tflops(tokens_per_second: float, flops_per_token: int) -> float:
    """Achieved model TFLOP/s of one device, from its tokens per second."""
    return tokens_per_second * flops_per_token / 1e12


def mfu(tokens_per_second: float, flops_per_token: int, peak_flops: float) -> float:
    """Model FLOPs utilisation in percent (the "mfu(%)" tag) of one device."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return 100.0 * tokens_per_second * flops_per_token / peak_flops
