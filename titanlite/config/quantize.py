"""The [quantize.linear.float8] section: float8 training of the linear layers (torchao's
Float8Linear), which a float8 name in model.converters turns on; with the converter names
titanlite knows and the rules between these keys.

The section sits in TOML where torchtitan 0.2 has it, under [quantize] and [quantize.linear]
(JobConfig's quantize field holds the two levels; schema.section_classes names the section
by its whole dotted path)."""

from dataclasses import dataclass, field
from typing import Literal

# model.converters: the names of float8 training of the linear layers (titanlite's short
# name, and torchtitan 0.2's), and torchtitan's float8 MoE experts, which titanlite refuses.
FLOAT8_LINEAR_CONVERTERS = ("float8", "quantize.linear.float8")
FLOAT8_GROUPED_MM_CONVERTER = "quantize.grouped_mm.float8"
# torchtitan's word in filter_fqns for "skip the layers too small to gain"; titanlite always
# does (skip_small_layers), so the word is dropped from the list.
TORCHTITAN_AUTO_FILTER = "auto_filter_small_kn"

# torchao 0.18's Float8LinearRecipeName values.
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]


@dataclass
class LinearFloat8:
    recipe_name: Float8Recipe = "tensorwise"
    """How torchao scales tensors to float8: tensorwise (one scale per tensor, the fastest; the only one with float8
    all-gathers), rowwise (one scale per row, more accurate) or rowwise_with_gw_hp (rowwise, with the weight gradient
    in high precision, the most accurate)."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers left in high precision: those whose name contains any of these strings (torchao's rule). The
    output projection by default, whose float8 logits cost accuracy."""

    skip_small_layers: bool = True
    """Leave in high precision the layers too small for float8 to speed up, by torchao's size thresholds for the recipe
    (rowwise's for rowwise_with_gw_hp); false converts every layer whose dimensions are multiples of 16 (always a
    condition). What was skipped, and why, is logged at every start."""

    emulate: bool = False
    """Emulate float8 matmuls in float32 (slow; for tests). Needed where no CUDA GPU of compute capability 8.9 or
    newer is found: without it such a run stops with a config error naming the device."""

    enable_fsdp_float8_all_gather: bool = False
    """Under FSDP, all-gather the converted layers' weights in float8 (half the bf16 bytes), cast before the gather
    with one scale per tensor; tensorwise recipe only."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With float8 all-gathers: work out every converted weight's scale after the optimizer step, in one all-reduce,
    instead of one all-reduce per weight in the next forward."""


@dataclass
class QuantizeLinear:
    float8: LinearFloat8 = field(default_factory=LinearFloat8)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


def float8_requested(converters: list[str]) -> bool:
    """Whether model.converters asks for float8 linear layers."""
    return any(name in FLOAT8_LINEAR_CONVERTERS for name in converters)


def quantize_problem(converters: list[str], float8: LinearFloat8) -> str | None:
    """Why model.converters and [quantize.linear.float8] do not go together (one line), or None."""
    for name in converters:
        if name == FLOAT8_GROUPED_MM_CONVERTER:
            return (
                f"model.converters: '{name}' (float8 MoE experts) is not supported: torchao 0.18's float8 grouped "
                "GEMM runs only on CUDA GPUs of compute capability 9.0 or newer (Triton casts, "
                "torch._scaled_grouped_mm) and has no emulation, so titanlite cannot check it; remove it (the experts "
                "train in bf16, the other linear layers in float8 with 'float8')"
            )
        if name not in FLOAT8_LINEAR_CONVERTERS:
            return (
                f"model.converters: '{name}' is not a converter titanlite has; it has float8 only ('float8', or "
                "torchtitan 0.2's name 'quantize.linear.float8')"
            )
    all_gather = "quantize.linear.float8.enable_fsdp_float8_all_gather"
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        return (
            f'{all_gather} needs quantize.linear.float8.recipe_name = "tensorwise" (torchao all-gathers float8 '
            f'weights with one scale per tensor), got "{float8.recipe_name}"'
        )
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        return (
            "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp needs "
            f"{all_gather} (it precomputes the scales of the float8 all-gathers)"
        )
    return None
