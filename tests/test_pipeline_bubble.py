"""The pipeline bubble (titanlite.parallel.bubble): the actions it runs are torch's, its clock
gives the closed forms where they are exact (GPipe, 1F1B, Interleaved1F1B in Megatron's
case), a small schedule worked by hand, and the zero-bubble schedules' credit."""

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from titanlite.parallel.bubble import pipeline_bubble, rank_actions, simulate
from titanlite.parallel.pipeline import PipelinePlan

MULTI_STAGE = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _printed(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> list[list[tuple]]:
    """torch's own printout of the schedule (its visualizer's), as (kind, stage, micro-batch)."""
    printed = get_schedule_ops(schedule, pp, microbatches, stages_per_rank)

    def flat(actions):
        for action in actions:
            if action is not None and action.sub_actions:
                yield from flat(action.sub_actions)
            elif action is not None and action.computation_type.value in "FBIW":  # not REDUCE_GRAD
                yield action.computation_type.value, action.stage_index, action.microbatch_index

    return [list(flat(actions)) for actions in printed]


def _runs(schedule: str, pp: int, microbatches: int) -> bool:
    """Whether torch builds the schedule (and plan_pipeline lets it through)."""
    stages = pp * (1 if schedule in ("GPipe", "1F1B") else 2)
    if schedule in ("1F1B", "DualPipeV"):
        return microbatches >= stages
    if schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"):
        return microbatches <= pp or microbatches % pp == 0
    return True


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", *MULTI_STAGE])
def test_the_actions_are_the_ones_torch_prints(schedule):
    for pp in (2, 4):
        for microbatches in (1, 2, 4, 8, 12):
            if not _runs(schedule, pp, microbatches):
                continue
            per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
            ours, torchs = (
                rank_actions(schedule, pp, per_rank, microbatches),
                _printed(schedule, pp, per_rank, microbatches),
            )
            if schedule != "1F1B":
                assert ours == torchs, (pp, microbatches)
                continue
            # torch's printout numbers the last rank's micro-batches from 1 (F1 B0 F2 B1 ... F<m>)
            # where its runtime (Schedule1F1B._step_microbatches) starts at 0: the same kinds in
            # the same order there, the same actions on every other rank.
            assert ours[:-1] == torchs[:-1], (pp, microbatches)
            assert [kind for kind, _, _ in ours[-1]] == [kind for kind, _, _ in torchs[-1]]
            assert [index for kind, _, index in ours[-1] if kind == "F"] == list(range(microbatches))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("backward", [1.5, 2.0, 3.0])
def test_gpipe_and_1f1b_idle_p_minus_1_of_m_plus_p_minus_1_slots(schedule, backward):
    for pp in (2, 3, 4, 8):
        for microbatches in (1, 2, 4, 7, 8, 32):
            if _runs(schedule, pp, microbatches):
                bubble = pipeline_bubble(schedule, pp, 1, microbatches, backward)
                assert bubble == pytest.approx((pp - 1) / (microbatches + pp - 1), rel=1e-12), (pp, microbatches)


@pytest.mark.parametrize("stages_per_rank", [2, 3, 4])
def test_interleaved_1f1b_gives_megatrons_bubble_once_m_fills_a_round(stages_per_rank):
    # Megatron-LM's analysis (Narayanan et al. 2021, section 2.2.2): (p - 1) / (v m) of the
    # compute, i.e. (p - 1) / (v m + p - 1) of the step, whatever the backward costs. torch
    # runs m >= p micro-batches in m // p equal rounds (e.g. 10 on 4 ranks: 2 rounds of 5).
    v = stages_per_rank
    for pp in (2, 4, 8):
        for microbatches in (pp, pp + 1, 2 * pp, 2 * pp + 2, 4 * pp):
            for backward in (2.0, 3.0):
                bubble = pipeline_bubble("Interleaved1F1B", pp, v, microbatches, backward)
                megatron = (pp - 1) / (v * microbatches)
                assert bubble / (1 - bubble) == pytest.approx(megatron, rel=1e-12), (pp, microbatches)
    # Fewer micro-batches than ranks (one round of m): they cross the v p stages as GPipe's
    # cross v p ranks, m + v p - 1 chunk slots of which a rank is busy v m; far more idle
    # time than Megatron's formula, which assumes full rounds of p.
    for pp in (4, 8):
        for microbatches in range(1, pp):
            bubble = pipeline_bubble("Interleaved1F1B", pp, v, microbatches)
            slots = microbatches + v * pp - 1
            assert bubble == pytest.approx(1 - v * microbatches / slots, rel=1e-12), (pp, microbatches)
            assert bubble > (pp - 1) / (v * microbatches + pp - 1)


def test_a_small_zbv_schedule_on_the_clock_by_hand():
    # PP 2, m = 2, F = I = W = 1 (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2):
    #   rank 0: F0.0 [0,1] F0.1 [1,2] F3.0 [3,4] I3.0 W3.0 [4,6] F3.1 [6,7] I3.1 W3.1 [7,9]
    #           I0.0 [9,10] W0.0 [10,11] I0.1 [12,13] W0.1 [13,14]   (waits: 2-3, 11-12)
    #   rank 1: F1.0 [1,2] F2.0 [2,3] F1.1 [3,4] F2.1 [4,5] I2.0 [5,6] W2.0 I1.0 W1.0 [6,9]
    #           I2.1 [9,10] W2.1 I1.1 W1.1 [10,13]
    step, busy = simulate(rank_actions("ZBVZeroBubble", 2, 2, 2), backward=2.0)
    assert (step, busy) == (14.0, [12.0, 12.0])
    assert pipeline_bubble("ZBVZeroBubble", 2, 2, 2) == pytest.approx(2 / 14, rel=1e-12)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_schedules_idle_less_than_interleaved_1f1b(schedule):
    for pp in (2, 4, 8):
        for microbatches in (2 * pp, 4 * pp, 8 * pp):
            zero = pipeline_bubble(schedule, pp, 2, microbatches)
            interleaved = pipeline_bubble("Interleaved1F1B", pp, 2, microbatches)
            # The weight gradients fill all but about one forward per hop (p - 1 of the
            # 3 v m forwards' worth of work): a third of the interleaved schedule's or less.
            assert zero <= interleaved / 2.5, (pp, microbatches, zero, interleaved)
            assert pipeline_bubble(schedule, pp, 2, 2 * microbatches) < zero
    # The split only pays when the weight gradient has work to fill: recomputation in the
    # inputs' gradient (a longer I) leaves more idle time.
    assert pipeline_bubble(schedule, 4, 2, 16, 3.0) > pipeline_bubble(schedule, 4, 2, 16, 2.0)


def test_the_plans_bubble_is_the_simulated_one_and_bad_ratios_are_refused():
    plan = PipelinePlan("Interleaved1F1B", 2, tuple((f"layers.{i}",) for i in range(4)), 4)
    assert plan.bubble == pipeline_bubble("Interleaved1F1B", 2, 2, 4) == pytest.approx(1 / 9)
    assert plan.bubble_at(2.5) == pytest.approx(plan.bubble, rel=1e-12)  # not a split schedule
    with pytest.raises(ValueError, match=r"^a pipeline chunk's backward over its forward must be at least 1, got 0.5$"):
        pipeline_bubble("ZBVZeroBubble", 2, 2, 4, 0.5)
