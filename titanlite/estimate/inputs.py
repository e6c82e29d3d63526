"""Checks of the step-time estimate's inputs, each a ValueError of one line that names the
input and what it may be."""

import typing

from titanlite.config import Training
from titanlite.dtypes import DTYPES
from titanlite.parallel.parallel_dims import ParallelDims

RESHARD_POLICIES = ("default", "always", "never")
AC_MODES = ("none", "full", "selective")


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_layout(
    dp_replicate: int, dp_shard: int, world_size: int | None, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1
) -> ParallelDims:
    """Degrees to ParallelDims: the data-parallel ones positive or -1 (at most one -1, which
    needs world_size), tp, pp, ep and cp positive; ParallelDims.resolve reports a product that does
    not match the world size, or an ep that does not divide the shard degree."""
    for name, degree in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if isinstance(degree, bool) or not isinstance(degree, int) or (degree < 1 and degree != -1):
            raise ValueError(f"{name} must be a positive integer or -1, got {degree!r}")
    positive_int("tp", tp)
    positive_int("pp", pp)
    positive_int("ep", ep)
    positive_int("cp", cp)
    if dp_replicate == -1 and dp_shard == -1:
        raise ValueError("dp_replicate and dp_shard cannot both be -1; set one of them")
    if world_size is None:
        if -1 in (dp_replicate, dp_shard):
            raise ValueError("a degree of -1 (take the ranks left over) needs world_size")
        world_size = dp_replicate * dp_shard * tp * pp * cp
    positive_int("world_size", world_size)
    return ParallelDims.resolve(dp_replicate, dp_shard, world_size, tp, pp, ep, cp)


def _precision_choices(field_name: str) -> tuple[str, ...]:
    """The dtype names the config accepts for training.``field_name``, in DTYPES' order."""
    allowed = typing.get_args(Training.__annotations__[field_name])
    return tuple(name for name in DTYPES if name in allowed)


def check_choices(
    ac_mode: str,
    selective_ac_option: str,
    reshard_after_forward: str,
    param_dtype: str,
    reduce_dtype: str,
    efficiency: float,
) -> None:
    """One clear ValueError per bad option, naming the choices."""
    for name, value, choices in (
        ("reshard_after_forward", reshard_after_forward, RESHARD_POLICIES),
        ("ac_mode", ac_mode, AC_MODES),
        ("param_dtype", param_dtype, _precision_choices("mixed_precision_param")),
        ("reduce_dtype", reduce_dtype, _precision_choices("mixed_precision_reduce")),
    ):
        if value not in choices:
            raise ValueError(f"{name} '{value}' is not known (choose from {', '.join(choices)})")
    if ac_mode == "selective" and selective_ac_option != "op":
        if not (selective_ac_option.isdigit() and int(selective_ac_option) >= 1):
            raise ValueError(f"selective_ac_option must be 'op' or a positive integer, got {selective_ac_option!r}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")


def check_experts(model_args, ep: int) -> None:
    """One ValueError when the model's experts cannot be split over ``ep`` ranks."""
    n_experts = getattr(model_args, "n_experts", 0)
    if ep > 1 and not n_experts:
        raise ValueError(f"parallelism.expert_parallel_degree ({ep}) needs a mixture-of-experts model")
    if n_experts % ep:
        raise ValueError(f"parallelism.expert_parallel_degree ({ep}) must divide the model's n_experts ({n_experts})")
