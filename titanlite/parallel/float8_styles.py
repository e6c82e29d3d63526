"""Tensor parallelism of float8 layers: torchao's float8 styles in place of the plain ones.

torchao's Float8ColwiseParallel and Float8RowwiseParallel split a Float8Linear as the plain
styles split a Linear, but cast its input to float8 before TP's all-gather (half the bytes of
bf16) and its output's gradient to float8 as it leaves; PrepareFloat8ModuleInput casts a
block's input once, before the all-gather, for all the float8 layers that read it. They cast
with one scale per tensor, so they are used for the tensorwise recipe only: with the rowwise
ones, and for layers float8 left in high precision, the plain styles stay (a Float8Linear
under them casts the DTensors it gets, its scales taken over the whole mesh).

The model's TP plan stays as it is written (tensor_parallel.apply_tensor_parallel);
``float8_styles`` rewrites a plan just before it is applied, on GPU meshes: gloo, the CPU's
backend, cannot send float8 tensors, so CPU runs (the tests, emulated) keep the plain styles."""

import sys

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

# Where torchao's Float8Linear lives: until it is imported, no module can be one, and
# parallelising a model without float8 never imports torchao.
_FLOAT8_LINEAR_MODULE = "torchao.float8.float8_linear"


def _is_tensorwise_float8(module: nn.Module) -> bool:
    """A Float8Linear casting input, weight and output gradient with one scale per tensor."""
    float8_linear = sys.modules.get(_FLOAT8_LINEAR_MODULE)
    if float8_linear is None or not isinstance(module, float8_linear.Float8Linear):
        return False
    from torchao.float8 import ScalingGranularity

    config = module.config
    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    return all(cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts)


def _float8_style(module: nn.Module, name: str, style: ParallelStyle, plan: dict[str, ParallelStyle]) -> ParallelStyle:
    """The float8 style standing for ``style`` on ``module``'s submodule ``name``, or ``style``."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    if type(style) in (ColwiseParallel, RowwiseParallel) and _is_tensorwise_float8(module.get_submodule(name)):
        float8_cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
        return float8_cls(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    if type(style) is PrepareModuleInput:
        # The input prepared here reaches the column-wise layers below (wq/wk/wv, w1/w3): it
        # may be cast once for them only when every one of them takes float8.
        readers = [
            module.get_submodule(child)
            for child, child_style in plan.items()
            if child.startswith(f"{name}.") and type(child_style) is ColwiseParallel
        ]
        if readers and all(_is_tensorwise_float8(reader) for reader in readers):
            return PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                use_local_output=style.use_local_output,
            )
    return style


def float8_styles(module: nn.Module, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """``plan`` (submodule name -> style, as parallelize_module takes it for ``module``) with
    torchao's float8 styles wherever the submodules they split are tensorwise float8 layers.
    On a CPU mesh the plan stays: gloo has no float8 collectives ("Invalid scalar type"), and
    the plain styles gather in high precision for the float8 layers to cast."""
    if _FLOAT8_LINEAR_MODULE not in sys.modules or tp_mesh.device_type == "cpu":
        return plan
    return {name: _float8_style(module, name, style, plan) for name, style in plan.items()}
