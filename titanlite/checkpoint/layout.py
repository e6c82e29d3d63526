"""What a checkpoint's train_state records of the layout that wrote it (beside the step), and
what a resume on another layout, or with another global batch, says about it. ``plan`` is the
run's RunPlan (its parallel_dims and global_batch_size are read)."""

import logging

logger = logging.getLogger("titanlite")


def layout_text(world_size: int, replicate: int, shard: int, tp: int, pp: int, show_pp: bool, cp: int = 1) -> str:
    """A layout as the start-up and resume lines name it, in the mesh's order; the pp degree
    where ``show_pp`` (a layout with pipeline parallelism is involved), the cp degree where above 1."""
    pipeline = f"pp {pp} x " if show_pp else ""
    context = f"cp {cp} x " if cp > 1 else ""
    return f"{world_size} rank(s) ({pipeline}replicate {replicate} x shard {shard} x {context}tp {tp})"


def layout_record(plan) -> dict:
    """The layout and global batch a checkpoint's train_state records beside the step, for
    log_resumed_layout to compare when the checkpoint is resumed."""
    dims = plan.parallel_dims
    return {
        "world_size": dims.world_size,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "tp": dims.tp,
        "pp": dims.pp,
        "cp": dims.cp,
        "global_batch_size": plan.global_batch_size,
    }


# The train_state entries that checkpoints written before them lack (the checkpoint manager
# then leaves them out of the load), each then meaning 1: "tp" and "pp", absent where no
# layout had tensor, pipeline or context parallelism, and "global_batch_size".
LAYOUT_ENTRIES_ADDED_LATER = ("tp", "pp", "cp", "global_batch_size")


def log_resumed_layout(step: int, plan, train_state: dict, rank: int) -> None:
    """Say so when the checkpoint being resumed was written by another layout, and warn when
    the global batch changed with it (a global_batch_size of -1 follows the number of ranks)."""
    dims = plan.parallel_dims
    # Checkpoints written before tensor (pipeline) parallelism existed have no "tp" ("pp"): they had none.
    saved = (
        train_state["world_size"],
        train_state["dp_replicate"],
        train_state["dp_shard"],
        train_state.get("tp", 1),
        train_state.get("pp", 1),
    )
    ours = (dims.world_size, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp)
    saved_cp = train_state.get("cp", 1)
    if saved != ours or saved_cp != dims.cp:
        show_pp = max(saved[-1], dims.pp) > 1
        logger.info(
            "resuming at step %d on %s from a checkpoint written by %s: model, optimizer and data position are "
            "resharded",
            step,
            layout_text(*ours, show_pp, dims.cp),
            layout_text(*saved, show_pp, saved_cp),
        )
    # Checkpoints written before it was recorded have no "global_batch_size": nothing to compare.
    saved_batch = train_state.get("global_batch_size", plan.global_batch_size)
    if saved_batch != plan.global_batch_size and rank == 0:
        logger.warning(
            "resuming at step %d with a global batch of %d sequences where the checkpoint's run used %d; "
            "set training.global_batch_size = %d to keep it",
            step,
            plan.global_batch_size,
            saved_batch,
            saved_batch,
        )
