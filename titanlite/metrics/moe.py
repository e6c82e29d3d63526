"""An MoE model's numbers at a log step: each layer's expert load, the worst a load can be,
the balancing losses that are on; and a warning for each layer whose router stays collapsed."""

import logging

from titanlite.config.model import MOE_BALANCING_KEYS
from titanlite.metrics import tags

logger = logging.getLogger("titanlite")

# The tag of each of titanlite.models.moe's BALANCE_LOSSES, by its name.
LOSS_TAGS = {
    "aux": tags.MOE_AUX_LOSS,
    "load_balance": tags.MOE_LOAD_BALANCE_LOSS,
    "seq_balance": tags.MOE_SEQ_BALANCE_LOSS,
    "z": tags.MOE_Z_LOSS,
}

# A layer counts as collapsed at a load this far of the way from even (1) to the worst
# (n_experts / top_k), for COLLAPSED_LOG_STEPS log steps in a row.
COLLAPSED_SHARE = 0.9
COLLAPSED_LOG_STEPS = 3


def moe_load_metrics(loads: dict[int, float], losses: dict[str, float], worst_load: float) -> dict[str, float]:
    """The MoE tags of a step: each layer's expert load ({block index: max / mean}), the
    largest of them, the worst possible (``worst_load``, n_experts / top_k) and the
    balancing losses that are on ({name: value})."""
    if not loads:
        return {}
    metrics = {tags.moe_layer_load(block): load for block, load in sorted(loads.items())}
    metrics[tags.MOE_MAX_LOAD] = max(loads.values())
    metrics[tags.MOE_WORST_LOAD] = worst_load
    metrics.update({LOSS_TAGS[name]: value for name, value in losses.items()})
    return metrics


class CollapseWatch:
    """Reads each log step's loads; when some layers have stayed near the worst load for
    COLLAPSED_LOG_STEPS log steps in a row, logs one warning naming them and the [model] keys
    that balance the experts. Each layer is named once a run: a layer that collapses after
    others were warned of gets a warning of its own, one already named is not named again."""

    def __init__(self, worst_load: float):
        self.worst_load = worst_load
        self.threshold = 1.0 + COLLAPSED_SHARE * (worst_load - 1.0)
        self.streaks: dict[int, int] = {}  # block index: log steps in a row at or above the threshold
        self.warned: set[int] = set()  # the layers a warning has named

    def see(self, loads: dict[int, float]) -> None:
        # With top_k = n_experts every load is 1, the worst too: nothing can collapse.
        if self.worst_load <= 1.0:
            return
        near = [block for block, load in loads.items() if load >= self.threshold]
        self.streaks = {block: self.streaks.get(block, 0) + 1 for block in near}
        collapsed = sorted(
            block
            for block, streak in self.streaks.items()
            if streak >= COLLAPSED_LOG_STEPS and block not in self.warned
        )
        if collapsed:
            self.warned.update(collapsed)
            logger.warning("%s", self.message(collapsed))

    def message(self, layers: list[int]) -> str:
        keys = ", ".join(f"model.{key}" for key in MOE_BALANCING_KEYS[:-1]) + f" or model.{MOE_BALANCING_KEYS[-1]}"
        return (
            f"MoE routing has collapsed in layer(s) {', '.join(map(str, layers))}: their max / mean expert load "
            f"stayed at or above {self.threshold:.2f} for {COLLAPSED_LOG_STEPS} log steps in a row, near the worst "
            f"possible {self.worst_load:.2f} (n_experts / top_k: every token sent to the same top_k experts); "
            f"balance the experts with {keys} (docs/model.md, 'Training an MoE'). Said once per layer."
        )
