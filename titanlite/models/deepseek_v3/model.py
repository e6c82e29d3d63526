"""The DeepSeek-V3 decoder, top to bottom (DeepSeek-V3 technical report, section 2.1).

tokens -> embedding -> n_layers x [RMSNorm -> multi-head latent attention -> residual,
RMSNorm -> feed-forward -> residual] -> RMSNorm -> output projection -> logits

Multi-head latent attention (MLA), for x [batch, seq, dim]:
  queries  x -> wq_a -> q_norm -> wq_b (a low-rank bottleneck of q_lora_rank), or x -> wq
           when q_lora_rank is 0; per head qk_nope_head_dim features without position and
           qk_rope_head_dim that RoPE turns;
  latent   x -> wkv_a -> [kv_lora_rank features, qk_rope_head_dim features]: the first go
           through kv_norm and wkv_b, which expands them into every head's position-free key
           (qk_nope_head_dim) and value (v_head_dim); the second are one rope key shared by
           all heads, turned by RoPE once;
  scores   softmax(q . k x softmax_scale) over the causal prefix, then wo.
RoPE turns the rope parts only, at YaRN-scaled frequencies when rope_scaling is set; YaRN
also scales the tables' magnitude (rope_magnitude) and the softmax scale (softmax_scale),
both as transformers computes them.

The feed-forward of the first first_k_dense_replace blocks is Llama's dense SwiGLU; every
later block's is DeepSeekMoE: the routed experts of titanlite/models/moe/ (sigmoid scores,
group-limited top-k, the expert bias for choosing only, renormalised and scaled weights)
plus shared experts every token meets. No multi-token prediction.

The block and model are Llama's (titanlite/models/llama/model.py) with this attention and
feed-forward; parameter names are Llama's wherever the meaning is the same (embedding,
norms, wo, the dense w1/w2/w3, the MoE layer's).
"""

import math
from dataclasses import replace

import torch
from torch import nn

from titanlite.models.attention import AttentionKernel
from titanlite.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from titanlite.models.init import fill_trunc_normal_
from titanlite.models.llama.model import FeedForward, RMSNorm, Transformer, TransformerBlock, apply_rope
from titanlite.models.moe import MoE, MoEArgs, add_load_balancing_loss, moe_layers

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not
# rms_norm_eps (which only the blocks' and the final norm take).
LATENT_NORM_EPS = 1e-6

# --- RoPE on the rope part, with YaRN ----------------------------------------------------


def _yarn_magnitude(factor: float, weight: float = 1.0) -> float:
    """YaRN's 0.1 x weight x ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def rope_magnitude(scaling: YarnScaling | None) -> float:
    """What YaRN multiplies the cos and sin tables by: attention_factor when given, else
    magnitude(mscale) / magnitude(mscale_all_dim) when both are set, else magnitude(1)."""
    if scaling is None:
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_magnitude(scaling.factor, scaling.mscale) / _yarn_magnitude(scaling.factor, scaling.mscale_all_dim)
    return _yarn_magnitude(scaling.factor)


def softmax_scale(args: DeepSeekV3Args) -> float:
    """1 / sqrt(qk_head_dim), times magnitude(mscale_all_dim)^2 under YaRN with mscale_all_dim set."""
    scale = args.qk_head_dim**-0.5
    scaling = args.rope_scaling
    if scaling is not None and scaling.mscale_all_dim:
        magnitude = _yarn_magnitude(scaling.factor, scaling.mscale_all_dim)
        scale = scale * magnitude * magnitude  # transformers' order of the products
    return scale


def _ramp_dimension(turns: float, dim: int, base: float, length: int) -> float:
    """The pair index (as a real number) whose wavelength fits ``turns`` times into ``length``."""
    return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(args: DeepSeekV3Args) -> torch.Tensor:
    """Rotation speed of each of the qk_rope_head_dim / 2 pairs. YaRN: pairs that turn more
    than beta_fast times over the original context keep their speed, those that turn fewer
    than beta_slow times go factor times slower, and those between blend linearly (the
    ramp's ends rounded outwards to whole pairs). In float32, each step in transformers'
    order, so that the tables round alike."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scaling = args.rope_scaling
    if scaling is None:
        return 1.0 / wavelengths
    length = scaling.original_max_position_embeddings
    low = max(math.floor(_ramp_dimension(scaling.beta_fast, dim, base, length)), 0)
    high = min(math.ceil(_ramp_dimension(scaling.beta_slow, dim, base, length)), dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point would divide by 0
    slowed = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - slowed
    return 1.0 / (scaling.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def rope_tables(args: DeepSeekV3Args, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, rope pair) angle, times YaRN's magnitude: two
    [max_seq_len, qk_rope_head_dim / 2] float32 tables."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, rope_frequencies(args).to(device))
    magnitude = rope_magnitude(args.rope_scaling)
    return angles.cos() * magnitude, angles.sin() * magnitude


# --- Multi-head latent attention -------------------------------------------------------


class LatentAttention(nn.Module):
    """Causal multi-head latent attention: keys and values expanded per head from one
    compressed latent, plus one rope key shared by the heads."""

    kernel_name = "attend"  # as Llama's attention: the module that attends, by name

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        queries = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, queries, bias=False)
        else:
            self.wq = nn.Linear(args.dim, queries, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.attend = AttentionKernel(softmax_scale(args))

    @staticmethod
    def kernel_kv_features(args: DeepSeekV3Args) -> int:
        """Numbers per token of the keys and values the kernel takes: every head's (the latent
        expanded, each key with the shared rope part)."""
        return args.n_heads * (args.qk_head_dim + args.v_head_dim)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, dim] -> the queries, flat per token (heads x qk_head_dim)."""
        if self.args.q_lora_rank:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        args = self.args
        batch, seq_len, _ = x.shape
        # Heads are counted from the projections' outputs (-1): under tensor parallelism each
        # rank holds its share of them.
        q = self.queries(x).view(batch, seq_len, -1, args.qk_head_dim)
        q_nope, q_rope = q.split([args.qk_nope_head_dim, args.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq_len, -1, args.qk_nope_head_dim + args.v_head_dim)
        k_nope, v = kv.split([args.qk_nope_head_dim, args.v_head_dim], dim=-1)
        # The rope key is one head, turned once and shared by every query head.
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, k_nope.shape[2], -1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        # Attention wants [batch, heads, seq, features].
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                fill_trunc_normal_(getattr(self, name).weight, std=0.02, generator=generator)
        for norm in ("q_norm", "kv_norm"):
            if hasattr(self, norm):
                getattr(self, norm).init_weights()
        fill_trunc_normal_(self.wo.weight, std=out_std, generator=generator)


# --- DeepSeekMoE: shared experts beside the routed ones -------------------------------------


class SharedExpertsMoE(MoE):
    """The routed experts (titanlite/models/moe/) plus shared_experts, one SwiGLU every token
    meets with weight 1, whose output is added to the routed experts' weighted sum."""

    def __init__(self, args: MoEArgs, shared: FeedForward):
        super().__init__(args)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)

    @torch.no_grad()
    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        super().init_weights(out_std, generator)
        self.shared_experts.init_weights(out_std, generator)


class DeepSeekV3Block(TransformerBlock):
    attention_cls = LatentAttention
    # Tensor parallelism splits the heads: the projections to them (wq or wq_b, wkv_b) by
    # output features and wo by input features, as Llama's. The low-rank down-projections and
    # their norms (wq_a, q_norm, wkv_a, kv_norm) are held whole on every rank: every head
    # reads all of the latent and the one rope key, so a split of them would need an
    # all-gather before each norm (an RMSNorm needs the whole vector) and again before the
    # heads; whole, they cost each rank dim x (q_lora_rank + kv_lora_rank + qk_rope_head_dim)
    # weights (15 M of 187 M per 671B block) and no collective in the forward. The
    # attention's tensors stay DTensors, so that the rope key, shared by heads on every rank,
    # gets the sum of their gradients.
    attention_tp_plan = {
        "wq": "colwise",
        "wq_a": "replicate",
        "q_norm": "replicate",
        "wq_b": "colwise",
        "wkv_a": "replicate",
        "kv_norm": "replicate",
        "wkv_b": "colwise",
        "attend": "local_heads",
        "wo": "rowwise",
    }
    attention_tp_dtensors = True

    def make_feed_forward(self, layer_id: int, args: DeepSeekV3Args) -> nn.Module:
        if not args.is_moe_layer(layer_id):
            return super().make_feed_forward(layer_id, args)
        return SharedExpertsMoE(args.moe_args(), FeedForward(replace(args, ffn_hidden_dim=args.shared_hidden_dim)))


class DeepSeekV3Transformer(Transformer):
    block_cls = DeepSeekV3Block

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.args, device=device)

    def forward(self, tokens: torch.Tensor, document_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Llama's forward; with balancing losses on, its output carries their gradients for
        the MoE layers it ran (this pipeline stage's under PP: none in a dense-only stage)."""
        return add_load_balancing_loss(super().forward(tokens, document_tokens), moe_layers(self))

    def init_buffers(self, device: torch.device) -> None:
        """The RoPE tables, and each MoE layer's token counts (never saved either)."""
        super().init_buffers(device)
        for layer in moe_layers(self):
            layer.init_buffers()
