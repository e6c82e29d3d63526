"""Model converters applied before parallelisation: float8 training of the linear layers
through torchao (float8.py). Knows the model only as nn.Modules and their names."""

from titanlite.quantize.float8 import (
    Float8Choice,
    check_float8_run,
    convert_to_float8,
    float8_layer_choice,
    float8_run_problem,
    scale_precompute_hook,
)

__all__ = [
    "Float8Choice",
    "check_float8_run",
    "convert_to_float8",
    "float8_layer_choice",
    "float8_run_problem",
    "scale_precompute_hook",
]
