"""The routed experts: n_experts SwiGLU feed-forwards with stacked weights, run on the rows
sorted by expert as one grouped GEMM or a loop over the experts; and the conversion from and
to the per-expert weights Hugging Face checkpoints keep."""

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.init import fill_trunc_normal_
from titanlite.models.moe.args import MoEArgs


@lru_cache
def _cuda_has_grouped_mm(device_index: int) -> bool:
    # torch documents grouped GEMM for CUDA devices of compute capability 8.0 and above.
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can multiply x [rows, in] by weight [E, out, in]: both
    bfloat16 (the only dtype of its compile-time rules, even though the CPU kernel also takes
    float32), on the CPU or a capable CUDA device, with rows of a multiple of 16 bytes."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if x.shape[-1] % 8 or weight.shape[-2] % 8:
        return False
    if x.device.type == "cuda":
        return _cuda_has_grouped_mm(x.device.index or 0)
    return x.device.type == "cpu"


def expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """x [rows, in], sorted by expert with counts[e] rows for expert e, times each expert's
    weight[e] [out, in] transposed: [rows, out]. ``grouped`` runs one grouped GEMM; otherwise a
    loop over experts runs one matmul each (exact, any dtype, but it reads the counts on the host)."""
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # where each expert's rows end
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return _linear_per_expert(x, weight, counts)


# Eager also inside a compiled block (which breaks its graph here): the split sizes are read
# on the host, and the compiler cannot size the pieces from values it does not know.
@torch.compiler.disable
def _linear_per_expert(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    rows = x.split(counts.tolist())
    # unbind, not weight[e]: each index's backward fills a zero tensor the size of the whole
    # stacked weight (cost growing with the square of the expert count); unbind's stacks once.
    return torch.cat([F.linear(expert_rows, w) for w, expert_rows in zip(weight.unbind(0), rows, strict=True)])


def swiglu_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    use_grouped_mm: bool | None,
) -> torch.Tensor:
    """Each expert's SwiGLU on its rows of x [rows, dim] (sorted by expert, counts[e] rows for
    expert e, of the len(counts) experts whose weights are stacked in w1, w2, w3): [rows, dim].
    ``use_grouped_mm`` None: grouped GEMM wherever it fits; False: always the loop."""
    # w1 fitting means dim and hidden_dim both do, and so w2 and w3 fit too.
    grouped = use_grouped_mm is not False and grouped_mm_fits(x, w1)
    hidden = F.silu(expert_linear(x, w1, counts, grouped)) * expert_linear(x, w3, counts, grouped)
    return expert_linear(hidden, w2, counts, grouped)


class GroupedExperts(nn.Module):
    """n_experts SwiGLU feed-forwards, w2(silu(w1 x) * w3 x), their weights stacked: w1 and
    w3 [n_experts, hidden_dim, dim], w2 [n_experts, dim, hidden_dim] ([out, in] per expert,
    as nn.Linear and transformers' per-expert checkpoints keep them)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(args.n_experts, args.hidden_dim, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, args.hidden_dim))
        self.w3 = nn.Parameter(torch.empty(args.n_experts, args.hidden_dim, args.dim))
        self.use_grouped_mm: bool | None = None  # None: wherever grouped_mm_fits; False: always the loop

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [rows, dim] sorted by expert, counts [n_experts] rows per expert -> [rows, dim]."""
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3, self.use_grouped_mm)

    def init_weights(self, out_std: float, generator: torch.Generator) -> None:
        fill_trunc_normal_(self.w1, std=0.02, generator=generator)
        fill_trunc_normal_(self.w2, std=out_std, generator=generator)
        fill_trunc_normal_(self.w3, std=out_std, generator=generator)


# --- Hugging Face's per-expert weights ----------------------------------------------

# transformers checkpoints save each expert's projections apart:
# {prefix}.{e}.gate_proj.weight [hidden, dim] (w1), up_proj (w3), down_proj [dim, hidden] (w2).
HF_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def stack_hf_experts(hf_state: dict[str, torch.Tensor], prefix: str, n_experts: int) -> dict[str, torch.Tensor]:
    """{"w1", "w2", "w3"}: the stacked weights of the experts saved under ``prefix`` (for
    example "model.layers.3.mlp.experts"); a KeyError names the first key that is missing."""
    stacked = {}
    for ours, theirs in HF_EXPERT_NAMES.items():
        keys = [f"{prefix}.{e}.{theirs}.weight" for e in range(n_experts)]
        missing = next((key for key in keys if key not in hf_state), None)
        if missing is not None:
            raise KeyError(f"expert weight '{missing}' is missing ({n_experts} experts expected under '{prefix}')")
        stacked[ours] = torch.stack([hf_state[key] for key in keys])
    return stacked


def unstack_hf_experts(stacked: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The per-expert keys and tensors of ``stacked`` {"w1", "w2", "w3"}; the tensors are views
    into the stacked ones (clone them before saving with safetensors, which refuses shared memory)."""
    return {
        f"{prefix}.{e}.{theirs}.weight": expert
        for ours, theirs in HF_EXPERT_NAMES.items()
        for e, expert in enumerate(stacked[ours].unbind(0))
    }
