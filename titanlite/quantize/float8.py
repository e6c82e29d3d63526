"""Float8 training of a model's linear layers through torchao 0.18 (an optional dependency:
pip install titanlite[float8]).

A float8 run swaps the chosen nn.Linear modules of the meta model for torchao's Float8Linear
before anything parallelises it (plan.build_model): tensor parallelism then gives them
float8's own styles (parallel/float8_styles.py), and activation checkpointing, compile and
FSDP wrap them as they wrap plain ones. A Float8Linear keeps the Linear's weight, the same
high-precision parameter under the same name, and casts it (and its input, and its output's
gradient) to float8 for each matmul: checkpoints and exports do not change, so a float8
checkpoint resumes without float8 and the other way round.

Which layers are swapped is decided from names and shapes alone (float8_layer_choice), so the
estimator counts the very layers a run converts without torchao. torchao itself is imported
only by the functions that need it."""

import dataclasses
import logging
import os
import re
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from titanlite.config import ConfigError, JobConfig
from titanlite.config.quantize import TORCHTITAN_AUTO_FILTER, LinearFloat8, float8_requested

INSTALL_HINT = "pip install titanlite[float8]"
# float8 tensor cores: Ada (8.9) and Hopper (9.0) on.
MIN_CAPABILITY = (8, 9)
# torch._scaled_mm's condition on both dimensions of the weight.
ALIGNMENT = 16


def _too_small(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether an [out, in] matmul falls under torchao's size thresholds for the recipe, below
    which its float8 kernels were measured no faster than bf16 on an H100 (torchao 0.18,
    float8_linear_utils._auto_filter_for_tensorwise / _auto_filter_for_rowwise). torchao gives
    rowwise_with_gw_hp none; it takes rowwise's, whose forward and input-gradient matmuls it shares."""
    if recipe == "tensorwise":
        return in_features <= 4096 and out_features <= 1024
    return out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048)


def _why_high_precision(name: str, linear: nn.Linear, float8: LinearFloat8, tied: set[int]) -> str | None:
    """Why the layer ``name`` stays in high precision, or None when float8 takes it."""
    out_features, in_features = linear.weight.shape
    filters = [fqn for fqn in float8.filter_fqns if fqn != TORCHTITAN_AUTO_FILTER]
    if any(fqn in name for fqn in filters):
        return "named in quantize.linear.float8.filter_fqns"
    if id(linear.weight) in tied:
        return "weight tied to another module"
    if out_features % ALIGNMENT or in_features % ALIGNMENT:
        return f"a dimension not a multiple of {ALIGNMENT}"
    if float8.skip_small_layers and _too_small(out_features, in_features, float8.recipe_name):
        return f"below torchao's {float8.recipe_name} size thresholds"
    return None


@dataclasses.dataclass(frozen=True)
class Float8Choice:
    """The linear layers float8 takes and those it leaves, by name, with shapes."""

    converted: dict[str, tuple[int, int]]  # name -> (out_features, in_features)
    skipped: dict[str, str]  # name -> why it stays in high precision

    def converted_params(self) -> int:
        return sum(rows * columns for rows, columns in self.converted.values())

    def lines(self, float8: LinearFloat8) -> list[str]:
        """The start-up lines: what was converted and what was not, and why, named compactly."""
        mode = ", emulated" if float8.emulate else ""
        total = len(self.converted) + len(self.skipped)
        lines = [
            f"float8 ({float8.recipe_name}{mode}): {len(self.converted)} of {total} linear layers converted: "
            f"{compact_names(self.converted) or 'none'}"
        ]
        for reason in dict.fromkeys(self.skipped.values()):
            names = [name for name, why in self.skipped.items() if why == reason]
            lines.append(f"float8: {len(names)} left in high precision ({reason}): {compact_names(names)}")
        return lines


def compact_names(names) -> str:
    """'layers.*.attention.wq x6, output': the names with their block index as '*', counted."""
    counts = Counter(re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name) for name in names)
    return ", ".join(pattern if count == 1 else f"{pattern} x{count}" for pattern, count in counts.items())


def _tied_weights(model: nn.Module) -> set[int]:
    """Ids of the parameters more than one module holds (Qwen3's tied embedding and output)."""
    seen = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    return {param_id for param_id, count in seen.items() if count > 1}


def float8_layer_choice(model: nn.Module, float8: LinearFloat8) -> Float8Choice:
    """Which of ``model``'s linear layers float8 converts (on the meta device or any other)."""
    converted, skipped, tied = {}, {}, _tied_weights(model)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = _why_high_precision(name, module, float8, tied)
        if reason is None:
            converted[name] = tuple(module.weight.shape)
        else:
            skipped[name] = reason
    return Float8Choice(converted, skipped)


# --- the checks before anything is built --------------------------------------------------

# What importing torchao 0.18 logs as warnings on every import: its optional compiled kernels
# (MX formats, CUTLASS for sm90a; float8 training uses neither) failing to load on a CPU build
# of torch, and torch's note that torchao registers an Enum as a pytree constant. Neither says
# anything about the run, and a config error must stay one line.
_NOISY_AT_IMPORT = ("torchao", "torch.utils._pytree")


def _import_torchao_float8() -> None:
    """Import torchao.float8 with the warnings above kept off stderr (ImportError without torchao)."""
    loggers = [logging.getLogger(name) for name in _NOISY_AT_IMPORT]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def _device_without_float8() -> str | None:
    """This process's GPU (the one parallel.pick_device will take) as an error names it, when it
    has no float8 matmuls; else None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (the CPU)"
    index = int(os.environ.get("LOCAL_RANK", "0"))
    capability = torch.cuda.get_device_capability(index)  # cuda-only
    if capability >= MIN_CAPABILITY:
        return None
    return f"{torch.cuda.get_device_name(index)} (compute capability {capability[0]}.{capability[1]})"  # cuda-only


def float8_run_problem(job_config: JobConfig) -> str | None:
    """Why this machine cannot run the config's float8 training (one line), or None: torchao
    missing, or no float8-capable GPU without quantize.linear.float8.emulate."""
    converters = job_config.model.converters
    if not float8_requested(converters):
        return None
    try:
        _import_torchao_float8()
    except ImportError:
        return f"model.converters = {converters} needs torchao, which is not installed: {INSTALL_HINT}"
    if job_config.quantize.linear.float8.emulate:
        return None
    device = _device_without_float8()
    if device is None:
        return None
    return (
        f"model.converters = {converters} needs a CUDA GPU of compute capability "
        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer for float8 matmuls (H100, H200, L40S, B200); found "
        f"{device}: set quantize.linear.float8.emulate = true to emulate them (slow; for tests)"
    )


def check_float8_run(job_config: JobConfig) -> None:
    problem = float8_run_problem(job_config)
    if problem is not None:
        raise ConfigError(problem)


# --- the conversion -------------------------------------------------------------------------


def _torchao_config(float8: LinearFloat8, fsdp: bool):
    """torchao's Float8LinearConfig for the section: the recipe, with emulation and (under
    FSDP only, where there is something to gather) float8 all-gathers."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(
        Float8LinearConfig.from_recipe_name(float8.recipe_name),
        emulate=float8.emulate,
        enable_fsdp_float8_all_gather=fsdp and float8.enable_fsdp_float8_all_gather,
    )


def convert_to_float8(model: nn.Module, job_config: JobConfig, fsdp: bool) -> list[str]:
    """Swap the chosen linear layers of ``model`` (still on meta) for Float8Linear in place, when
    model.converters asks for float8; returns the start-up lines (none without float8).
    ``fsdp``: the model will be sharded by FSDP (float8 all-gathers apply)."""
    if not float8_requested(job_config.model.converters):
        return []
    _import_torchao_float8()
    from torchao.float8 import convert_to_float8_training

    float8 = job_config.quantize.linear.float8
    choice = float8_layer_choice(model, float8)
    convert_to_float8_training(
        model, module_filter_fn=lambda module, name: name in choice.converted, config=_torchao_config(float8, fsdp)
    )
    return choice.lines(float8)


def scale_precompute_hook(job_config: JobConfig, fsdp: bool, model: nn.Module) -> Callable | None:
    """An optimizer step post-hook that works out the float8 all-gathers' weight scales in one
    all-reduce (quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp), or None."""
    float8 = job_config.quantize.linear.float8
    if not (float8_requested(job_config.model.converters) and fsdp and float8.precompute_float8_dynamic_scale_for_fsdp):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(optimizer, args, kwargs) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    return precompute
