"""The pipeline bubble: the share of a step a pp rank waits, found by running every rank's
actions, in the order torch's schedule runs them, on one clock.

The actions (F: a chunk's forward, B: its whole backward, I and W: its backward split into
the inputs' gradient and the weights'; a chunk is one micro-batch through one stage):
  GPipe, 1F1B  a fixed pattern in torch's ``_step_microbatches``: GPipe every forward, then
               every backward; 1F1B min(m, p - r) forwards on rank r, then one backward and
               one forward in turn until the forwards run out, then the backwards left.
               (torch's printed ``pipeline_order`` for 1F1B numbers the last rank's
               micro-batches from 1; the runtime does not, nor does this.)
  the others   torch's own ``pipeline_order`` per rank, built by the planner its constructor
               calls (here without stages or a process group), gaps (None) dropped: the
               runtime skips them and waits on its receives instead. DualPipeV's overlapped
               forward+backward runs its two actions one after the other, as torch's runtime
               does unless a custom function is registered.

Durations, in forwards of one chunk (every stage alike): F 1; B ``backward`` (2 by default:
the backward multiplies by the weights twice, once for the inputs' gradient and once for the
weights', where the forward does it once); W 1 (its matmuls are the forward's) and I the rest,
``backward`` - 1 (the inputs' gradient, and any recomputation, which runs in the first
backward pass over a chunk, I).

Each action starts when its rank has finished the previous one and its inputs are there:
F(s, i) after F(s - 1, i); B or I of (s, i) after B or I of (s + 1, i), or on the last stage
after F(s, i) (the loss); W after its own I (earlier on the same rank). Sends take no time
here: the step time adds those nothing hides (estimate.pipeline.pipelined_seconds).

    bubble = idle / step on the busiest rank = 1 - its busy time / the step,

the step ending when the last rank finishes, so that compute / (1 - bubble) is the step.
GPipe and 1F1B give (p - 1) / (m + p - 1) whatever the ratio; Interleaved1F1B with m >= p
(in torch's equal rounds) gives Megatron's (p - 1) / (v m) of the compute, i.e.
(p - 1) / (v m + p - 1) of the step; the zero-bubble schedules fill most of the rest with W
(tests/test_pipeline_bubble.py).
"""

import functools
from collections.abc import Iterator

from torch.distributed.pipelining import schedules as torch_schedules

from titanlite.config.parallelism import PIPELINE_SCHEDULES

BACKWARD_PER_FORWARD = 2.0  # a chunk's backward over its forward, without recomputation

_F, _B, _I, _W = "F", "B", "I", "W"  # torch's _ComputationType values


def _single_stage_actions(schedule: str, pp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of GPipe's or 1F1B's rank ``rank``, as torch runs them."""
    forwards = [(_F, rank, index) for index in range(microbatches)]
    backwards = [(_B, rank, index) for index in range(microbatches)]
    if schedule == "GPipe":
        return forwards + backwards
    warmup = min(microbatches, pp - rank)
    actions = forwards[:warmup]
    for index, backward in enumerate(backwards):
        actions.append(backward)
        if warmup + index < microbatches:
            actions.append(forwards[warmup + index])
    return actions


def _planner(schedule: str, pp: int, stages_per_rank: int, microbatches: int):
    """torch's schedule object with the attributes its per-rank planner reads, set as its
    constructor sets them (which needs stages and a process group; torch's own printout,
    get_schedule_ops, builds mock stages and the lowering with sends, 10-100x slower).
    tests/test_pipeline_bubble.py holds the result to that printout."""
    schedule_class = torch_schedules.get_schedule_class(schedule)
    planner = schedule_class.__new__(schedule_class)
    planner.pp_group_size, planner.n_local_stages = pp, stages_per_rank
    planner._n_microbatches = microbatches
    planner.number_of_rounds = max(1, microbatches // pp)
    planner.microbatches_per_round = microbatches // planner.number_of_rounds
    planner.num_stages = planner._num_stages = pp * stages_per_rank
    planner._stages = [None] * stages_per_rank
    return planner


def _flattened(actions) -> Iterator[tuple[str, int, int]]:
    for action in actions:
        if action is None:
            continue
        if action.sub_actions:  # an overlapped forward+backward: its parts in turn
            yield from _flattened(action.sub_actions)
        else:
            yield action.computation_type.value, action.stage_index, action.microbatch_index


def rank_actions(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Each pp rank's compute actions, (kind, stage, micro-batch), in the order torch runs them
    (see the module docstring)."""
    if PIPELINE_SCHEDULES[schedule] == "single":
        return [_single_stage_actions(schedule, pp, microbatches, rank) for rank in range(pp)]
    planner = _planner(schedule, pp, stages_per_rank, microbatches)
    return [list(_flattened(planner._calculate_single_rank_operations(rank))) for rank in range(pp)]


def _inputs_ready(kind: str, stage: int, index: int, last_stage: int, done: dict) -> float | None:
    """When the inputs of action (kind, stage, index) are there (None: not yet)."""
    if kind == _F:
        return 0.0 if stage == 0 else done.get((_F, stage - 1, index))
    if kind in (_B, _I):
        return done.get((_F, stage, index)) if stage == last_stage else done.get((_I, stage + 1, index))
    return 0.0  # W: its I ran earlier on this rank


def simulate(orders: list[list[tuple[str, int, int]]], backward: float) -> tuple[float, list[float]]:
    """(the step, each rank's busy time) of running ``orders`` with the durations of the
    module docstring."""
    duration = {_F: 1.0, _B: backward, _I: backward - 1.0, _W: 1.0}
    last_stage = max(stage for order in orders for _, stage, _ in order)
    done: dict[tuple[str, int, int], float] = {}  # (F or I, stage, micro-batch) -> when it ended
    clock, busy, position = [0.0] * len(orders), [0.0] * len(orders), [0] * len(orders)
    left = sum(map(len, orders))
    while left:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, stage, index = order[position[rank]]
                ready = _inputs_ready(kind, stage, index, last_stage, done)
                if ready is None:
                    break
                clock[rank] = max(clock[rank], ready) + duration[kind]
                busy[rank] += duration[kind]
                # A whole backward hands its inputs' gradient on as I does.
                done[(_I if kind == _B else kind, stage, index)] = clock[rank]
                position[rank] += 1
                left -= 1
                moved = True
        if not moved:
            waiting = [order[at] for order, at in zip(orders, position, strict=True) if at < len(order)]
            raise RuntimeError(f"the pipeline's actions wait on each other (next on each rank: {waiting})")
    return max(clock), busy


@functools.lru_cache(maxsize=1024)
def pipeline_bubble(
    schedule: str, pp: int, stages_per_rank: int, microbatches: int, backward: float = BACKWARD_PER_FORWARD
) -> float:
    """Idle share of the step on the busiest pp rank (see the module docstring); ``backward``
    is a chunk's backward over its forward (recomputation included), at least 1."""
    if not backward >= 1:
        raise ValueError(f"a pipeline chunk's backward over its forward must be at least 1, got {backward}")
    step, busy = simulate(rank_actions(schedule, pp, stages_per_rank, microbatches), backward)
    return 1.0 - max(busy) / step
