"""Float8's term of the step-time estimate: the layers a float8 run converts (found as the
trainer finds them) run their matmuls at the float8 peak, with torchao's casts on top.

Memory needs no term: torchao 0.18's Float8Linear keeps the same high-precision input and
weight for its backward as a Linear, and its float8 copies live for one matmul, so the memory
estimate simulates a float8 run without its converter (simulation.FLOAT8_MEMORY_NOTE)."""

from dataclasses import dataclass

from titanlite.config import JobConfig
from titanlite.config.quantize import float8_requested
from titanlite.estimate.compute import RankWork, compute_seconds
from titanlite.estimate.hardware import Hardware
from titanlite.quantize import float8_layer_choice

# torchao's casts to float8 (each converted layer's input, weight and output gradient: an
# amax pass and a scaled cast each, again for the backward's transposed copies) as a share of
# the float8 matmul time they feed. Fitted to the float8 row measured on an H200 (16 blocks of
# Llama 3 8B's shape, compiled: 1.23x, docs/performance.md), which it reproduces; the H100's row
# of the same run reads 0.55 (its step predicted 2% short) and the H200's 4-block run is
# predicted within 1%. It holds for layers torchao's size thresholds let through, whose matmuls
# are large against their casts (quantize.linear.float8.skip_small_layers).
FLOAT8_CAST_OVERHEAD = 0.5


def float8_saved_seconds(
    flops_per_token_done: float, tokens: int, peak_flops: float, float8_peak_flops: float, efficiency: float
) -> float:
    """What float8 takes off a step's compute: its layers' matmul time at the bf16 peak, less the
    same FLOPs at the float8 peak with the casts on top (FLOAT8_CAST_OVERHEAD of that):

        t x (1 - peak / float8 peak x (1 + overhead)),   t = compute_seconds of the converted FLOPs
    """
    bf16_s = compute_seconds(flops_per_token_done, tokens, peak_flops, efficiency)
    return bf16_s * (1 - peak_flops / float8_peak_flops * (1 + FLOAT8_CAST_OVERHEAD))


@dataclass(frozen=True)
class Float8Work:
    """The linear weights a float8 run converts (quantize.float8_layer_choice): in all the blocks,
    and outside them (the output projection, where filter_fqns leaves it to float8)."""

    block_params: int
    other_params: int

    @classmethod
    def of_layers(cls, converted: dict[str, tuple[int, int]]) -> "Float8Work":
        """From the converted layers' names and [out, in] shapes (the blocks' are layers.*)."""
        in_blocks = sum(rows * columns for name, (rows, columns) in converted.items() if name.startswith("layers."))
        return cls(in_blocks, sum(rows * columns for rows, columns in converted.values()) - in_blocks)

    def flops_per_token(self, work: RankWork, n_layers: int, pipelined: bool, fraction: float) -> float:
        """The converted layers' FLOPs per token on the busiest rank, 6 per weight and 2 more per
        weight recomputed (``fraction`` of the blocks). A pp rank holds ``work.blocks`` of the
        ``n_layers`` blocks, counted at the blocks' average; the layers outside the blocks are
        counted without a pipeline only (a pipeline gives their stage fewer blocks)."""
        block_params = self.block_params * work.blocks / n_layers
        params = block_params + (0 if pipelined else self.other_params)
        return 6 * params + 2 * fraction * block_params


def float8_seconds(
    float8: Float8Work | None,
    work: RankWork,
    n_layers: int,
    pipeline,
    fraction: float,
    tp: int,
    tokens: int,
    hw: Hardware,
    efficiency: float,
) -> float:
    """What float8 takes off the busiest rank's compute (0 without float8): float8_saved_seconds
    of its converted FLOPs, 1/tp of them under TP, which splits every dense layer. ``pipeline``:
    the run's PipelinePlan or None. A ValueError for hardware without float8."""
    if float8 is None:
        return 0.0
    if hw.float8_peak_flops is None:
        raise ValueError(f"{hw.name} has no float8 matmuls; leave float8 out of model.converters")
    flops = float8.flops_per_token(work, n_layers, pipeline is not None, fraction) / tp
    return float8_saved_seconds(flops, tokens, hw.peak_flops, hw.float8_peak_flops, efficiency)


def float8_note(saved_seconds: float) -> str:
    """What the compute line of a step-time estimate adds for float8 (nothing without)."""
    return f"; float8 matmuls take {saved_seconds * 1e3:.1f} ms off" if saved_seconds else ""


def float8_work(job_config: JobConfig, model_args) -> Float8Work | None:
    """What the config's float8 converter takes of the model ``model_args`` describes, or None
    without float8 (the meta model is the trainer's own, so are the layers chosen)."""
    if not float8_requested(job_config.model.converters):
        return None
    from titanlite.plan import meta_model  # the registry behind it pulls in every model

    choice = float8_layer_choice(meta_model(job_config, model_args), job_config.quantize.linear.float8)
    return Float8Work.of_layers(choice.converted)
