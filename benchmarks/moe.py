"""The MoE layer's grouped GEMM against its loop over experts: forward and backward time of
titanlite/models/moe/ in bfloat16, per shape and precision, with both paths checked equal
first; then the bytes expert parallelism's all-to-alls really move on 2 gloo ranks against the
estimator's; then each rank's MoE work and all-to-all bytes under tensor parallelism, before
(every TP rank routing the whole sequence) and now (its own slice), measured on 2 gloo ranks
and estimated for Qwen3-30B-A3B at TP 1, 2, 4 and 8.

    python benchmarks/moe.py                 # 4 shapes, 2 precisions, 3 timed passes each (about 5 minutes on 2 vCPUs)
    python benchmarks/moe.py --precision autocast
    python benchmarks/moe.py --quick         # one tiny shape, one timed pass (seconds)
    python benchmarks/moe.py --shape 64,8,1024,512,1024 --repeats 5
    python benchmarks/moe.py --a2a_shape 16,4,512,256,4096 --a2a_passes 3
    python benchmarks/moe.py --device cuda --no_a2a   # grouped vs loop on a GPU, and the estimate (no gloo ranks)

A shape is experts,top-k,dim,hidden,tokens (hidden: each expert's SwiGLU width). A precision
is how the layer computes in bf16, as the trainer gets it: "bf16", weights and tokens bf16
(FSDP's param dtype); "autocast", float32 weights and tokens under CPU autocast to bf16 (one
process, TP or PP without FSDP), where the layer casts tokens and stacked weights itself. Per
shape and precision one MoE layer (the init's weights, seed 0; no load balancing) takes one
batch of random tokens, both ways, switched by GroupedExperts.use_grouped_mm:
  grouped  torch._grouped_mm, one call per projection for all experts (no host sync);
  loop     one matmul per expert, the exact fallback where grouped GEMM does not fit (it
           reads the token counts on the host).
Routing, sorting and un-sorting the rows are the same code in both, so the ratio is the
layer's, not the bare GEMMs'.

Checked in one untimed pass of each path, before any timing of the shape: the grouped
forward ran torch._grouped_mm for its 3 projections and the loop forward never did (their
autograd graphs say so: the figure compares what it says it compares), and the output and
the gradients of the tokens and of every parameter agree between the two within bfloat16
tolerance (largest |grouped - loop| / largest |loop| at most 2e-2), so a fast but wrong
kernel cannot pass. A failed check prints one line naming the shape and the tensor and
exits 1.

Timed: the forward, then the backward of sum(out²) (in float32), as one pass; each repeat
runs both paths, so load from other work falls on both; each figure is the median over the
repeats. Printed: a row per precision and shape (forward and forward+backward milliseconds of each
path, loop / grouped for both, the largest difference of the check); then a line per precision

    loop / grouped forward+backward time, bf16: r1, r2, ... (experts/top-k/dim/hidden/tokens: ...)
    loop / grouped forward+backward time, autocast bf16: r1, r2, ... (experts/top-k/dim/hidden/tokens: ...)

All-to-all bytes (the second half): 2 gloo ranks (spawned as torchrun would, ending as
titanlite's ranks do) build the same float32 MoE layer of --a2a_shape, split its experts over
a 1-D ``ep`` mesh of both (apply_expert_parallel), and each runs --a2a_passes forward +
backward passes on its own random tokens, then as many under activation checkpointing (whose
backward runs the forward, and its all-to-alls, again). Every ``dist.all_to_all_single`` is
intercepted and the bytes it sends to the other rank added up (from its split sizes: what
leaves the rank, not what it keeps). Checked, per rank: those bytes equal a count by hand
from the routing itself (the rank's pairs for the other rank's experts and the other rank's
pairs for its experts, each twice per plain pass and three times per checkpointed one, plus
the exchanged token counts), so the interception sees every all-to-all and nothing else. Printed: per rank, measured and
estimated bytes (titanlite.estimate.expert_parallel.expert_all_to_all_bytes, the function the
step time uses, which assumes an even load); the last line is

    measured / estimated all-to-all bytes, EP 2 on 2 gloo ranks: r0, r1 (rank 0, rank 1; ...)

A ratio above 1 is a rank whose tokens go to the other rank's experts more than evenly.

Tensor parallelism (the third part): 2 gloo ranks are a TP group, with EP 2 over them (the ep
group takes the TP ranks), each holding half of an MoE layer of --a2a_shape's experts (float32)
and the same sequence of --a2a_shape's tokens (a data-parallel rank's). Each runs one forward +
backward twice: routing the whole sequence, as every TP rank did before, and through the
trainer's TP plan (parallel/moe_tensor_parallel.py, sequence parallel), routing its own half.
Counted per rank: the tokens it routes, the rows its local experts run (the expert FLOPs
follow them) and the all-to-all bytes it sends (intercepted as above), beside the estimator's
bytes. Checked: the split layer's output on each rank is the whole layer's on that rank's half
of the sequence (within 1e-5), else exit 1. The line

    before / after per rank, TP 2 with EP 2 over its ranks: expert rows r0, r1; all-to-all bytes r0, r1

follows; then a table of the estimator's per-rank figures for train_configs/qwen3_30b_a3b.toml's
micro-batch at TP 1, 2, 4 and 8 (MoE FLOPs and EP 8's all-to-all bytes, before and now, and the
all-reduce of the experts' gradients over tp that TP without EP now adds).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import end_rank, free_port, torchrun_environment  # noqa: E402

from titanlite.estimate.expert_parallel import expert_all_to_all_bytes  # noqa: E402
from titanlite.models.moe import MoE, MoEArgs, grouped_mm_fits  # noqa: E402

# Largest |grouped - loop| / largest |loop| of any checked tensor: a few bfloat16 roundings
# (2^-8 each) where the two sum in different orders; a wrong expert or row is of order 1.
TOLERANCE = 2e-2
SHAPES = ("8,2,256,512,8192", "8,2,1024,2048,2048", "32,8,512,256,4096", "64,8,512,256,2048")
QUICK_SHAPE = "8,2,64,64,256"
PRECISIONS = ("bf16", "autocast")
A2A_SHAPE = "16,4,512,256,4096"
EP = 2


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    dim: int
    hidden: int
    tokens: int

    def label(self) -> str:
        return f"{self.experts}/{self.top_k}/{self.dim}/{self.hidden}/{self.tokens}"


def grouped_gemms(out: torch.Tensor) -> int:
    """How many grouped GEMMs the forward that made ``out`` ran: the GroupedMmBackward0 nodes
    of its autograd graph (walking the graph is free, where a dispatch mode counting the
    operators would slow every one of them)."""
    seen, pending = set(), [out.grad_fn]
    while pending:
        node = pending.pop()
        if node is not None and node not in seen:
            seen.add(node)
            pending.extend(parent for parent, _ in node.next_functions)
    return sum(type(node).__name__ == "GroupedMmBackward0" for node in seen)


def build(shape: Shape, precision: str = "bf16", device: str = "cpu") -> tuple[MoE, torch.Tensor]:
    """The layer and its tokens on ``device``: bf16, or float32 for autocast to cast."""
    moe = MoE(MoEArgs(dim=shape.dim, n_experts=shape.experts, top_k=shape.top_k, hidden_dim=shape.hidden))
    moe.init_weights(out_std=0.02, generator=torch.Generator().manual_seed(0))
    tokens = torch.randn(shape.tokens, shape.dim, generator=torch.Generator().manual_seed(1))
    dtype = torch.float32 if precision == "autocast" else torch.bfloat16
    return moe.to(device=device, dtype=dtype), tokens.to(device=device, dtype=dtype).requires_grad_()


def settle(device: torch.device) -> None:
    """Wait for the device's queued kernels, so a time read next includes them."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def one_pass(moe: MoE, tokens: torch.Tensor, grouped: bool, precision: str) -> tuple[float, float, torch.Tensor]:
    """Forward seconds, forward+backward seconds, and the output (its graph kept)."""
    moe.experts.use_grouped_mm = None if grouped else False
    moe.zero_grad(set_to_none=True)
    tokens.grad = None
    device = tokens.device
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    )
    settle(device)
    start = time.perf_counter()
    with autocast:
        out = moe(tokens)
    settle(device)
    forward = time.perf_counter() - start
    out.float().pow(2).sum().backward()
    settle(device)
    return forward, time.perf_counter() - start, out


def checked_tensors(
    moe: MoE, tokens: torch.Tensor, grouped: bool, precision: str
) -> tuple[dict[str, torch.Tensor], int]:
    """The output and every gradient of one pass, and the grouped GEMMs its forward ran."""
    _, _, out = one_pass(moe, tokens, grouped, precision)
    tensors = {"output": out.detach(), "tokens.grad": tokens.grad.clone()}
    tensors.update({f"{name}.grad": param.grad.clone() for name, param in moe.named_parameters()})
    return tensors, grouped_gemms(out)


def check(moe: MoE, tokens: torch.Tensor, shape: Shape, precision: str = "bf16") -> float:
    """The largest relative difference between the paths; exits 1 on a failed check."""
    grouped, grouped_calls = checked_tensors(moe, tokens, True, precision)
    loop, loop_calls = checked_tensors(moe, tokens, False, precision)
    where = f"shape {shape.label()}, {precision}"
    if grouped_calls != 3 or loop_calls != 0:
        fail(
            f"{where}: the forward ran {grouped_calls} grouped GEMMs in the grouped pass and "
            f"{loop_calls} in the loop pass (expected 3, one per projection, and 0)"
        )
    worst = 0.0
    for name, expected in loop.items():
        difference = (grouped[name].float() - expected.float()).abs().max().item()
        relative = difference / max(expected.float().abs().max().item(), 1e-30)
        if not relative <= TOLERANCE:  # NaN fails too
            fail(f"{where}: {name} differs between grouped and loop by {relative:.3g} (at most {TOLERANCE})")
        worst = max(worst, relative)
    return worst


def fail(message: str) -> None:
    print(f"moe benchmark: check failed: {message}", file=sys.stderr)
    sys.exit(1)


def measure(shape: Shape, repeats: int, precision: str, device: str = "cpu") -> dict:
    moe, tokens = build(shape, precision, device)
    difference = check(moe, tokens, shape, precision)  # also the warm-up of both paths
    times = {True: [], False: []}
    for _ in range(repeats):
        for grouped in (True, False):
            forward, total, _ = one_pass(moe, tokens, grouped, precision)
            times[grouped].append((forward, total))
    median = {
        grouped: [statistics.median(run[i] for run in runs) * 1e3 for i in (0, 1)] for grouped, runs in times.items()
    }
    return {"grouped_ms": median[True], "loop_ms": median[False], "difference": difference}


# --- all-to-all bytes under expert parallelism ---------------------------------------------


class SentBytes:
    """Counts what every dist.all_to_all_single call sends to the other ranks, while installed."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.bytes, self.calls = rank, world_size, 0, 0

    def __enter__(self):
        import torch.distributed as dist

        self.real = dist.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            rows = input_split_sizes or [input.shape[0] // self.world_size] * self.world_size
            row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
            self.bytes += sum(size for peer, size in enumerate(rows) if peer != self.rank) * row_bytes
            self.calls += 1
            return self.real(output, input, output_split_sizes, input_split_sizes, group, async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_to_all_single = self.real


def rank_tokens(shape: "Shape", rank: int) -> torch.Tensor:
    """The float32 tokens rank ``rank`` routes (its own, as data parallelism gives it)."""
    return torch.randn(shape.tokens, shape.dim, generator=torch.Generator().manual_seed(100 + rank))


def pairs_between(moe: MoE, tokens: torch.Tensor, source: int, owner: int) -> int:
    """How many (token, expert) pairs of rank ``source``'s ``tokens`` go to an expert rank
    ``owner`` holds, by the layer's own routing."""
    from titanlite.models.moe import route

    with torch.no_grad():
        experts = route(tokens, moe.gate.weight, moe.args).experts
    return int((experts // (moe.args.n_experts // EP) == owner).sum()) if source != owner else 0


def by_hand_bytes(moe: MoE, shape: "Shape", rank: int, checkpointed: bool) -> int:
    """What one pass of ``rank`` sends to the other rank, counted from the routing: its pairs
    for the other rank's experts (the dispatch, and the combine's gradient in backward), the
    other rank's pairs for its own experts (sent back by the combine, and the dispatch's
    gradient), both once more when checkpointing re-runs the forward; and before each forward
    the token counts meant for the other rank's experts (int64)."""
    other = 1 - rank
    away = pairs_between(moe, rank_tokens(shape, rank), rank, other)
    back = pairs_between(moe, rank_tokens(shape, other), other, rank)
    forwards = 2 if checkpointed else 1
    row_bytes = shape.dim * 4
    return (forwards + 1) * (away + back) * row_bytes + forwards * (moe.args.n_experts // EP) * 8


def _two_ranks(rank: int, port: int, shape: "Shape", passes: int, out_dir: str) -> None:
    """One of the 2 gloo ranks of the all-to-all and tensor-parallel parts."""
    torchrun_environment(rank, EP, port, LOG_RANK="")
    torch.set_num_threads(1)  # one rank, one core
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=EP)
    report = {"a2a": all_to_all_report(rank, shape, passes), "tp": tensor_parallel_report(rank, shape)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    end_rank()


def all_to_all_report(rank: int, shape: "Shape", passes: int) -> dict:
    """This rank's measured and by-hand bytes of the plain and checkpointed passes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    from titanlite.parallel.expert_parallel import apply_expert_parallel

    moe, _ = build(shape)
    moe = moe.float()
    apply_expert_parallel(moe, init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",)))
    tokens = rank_tokens(shape, rank)
    report = {}
    for name, checkpointed in (("plain", False), ("checkpointed", True)):
        with SentBytes(rank, EP) as sent:
            for _ in range(passes):
                x = tokens.clone().requires_grad_()
                out = checkpoint(moe, x, use_reentrant=False) if checkpointed else moe(x)
                out.pow(2).sum().backward()
        report[name] = {"measured": sent.bytes, "by_hand": passes * by_hand_bytes(moe, shape, rank, checkpointed)}
    return report


def estimated_all_to_all_bytes(shape: "Shape", passes: int, recomputed: bool) -> float:
    """The estimator's bytes for ``passes`` micro-batches through one MoE layer on one rank."""
    return passes * expert_all_to_all_bytes(
        shape.tokens, shape.top_k, shape.dim, 4, shape.experts, EP, moe_layers=1, recomputed_moe_layers=int(recomputed)
    )


def measure_on_two_ranks(shape: "Shape", passes: int) -> list[dict]:
    """Both ranks' reports, in rank order: {"a2a": all_to_all_report, "tp":
    tensor_parallel_report}; exits 1 if the all-to-all bytes differ from the routing's count or
    the TP-split layer's output from the whole layer's."""
    with tempfile.TemporaryDirectory(prefix="titanlite-moe-") as out_dir:
        mp.start_processes(
            _two_ranks, args=(free_port(), shape, passes, out_dir), nprocs=EP, start_method="spawn", join=True
        )
        reports = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(EP)]
    for rank, report in enumerate(reports):
        for name, figures in report["a2a"].items():
            if figures["measured"] != figures["by_hand"]:
                fail(
                    f"all-to-all shape {shape.label()}, rank {rank}, {name}: the intercepted all-to-alls sent "
                    f"{figures['measured']} bytes, the routing says {figures['by_hand']}"
                )
        difference = report["tp"]["largest_difference"]
        if not difference <= 1e-5:
            fail(f"TP shape {shape.label()}, rank {rank}: the split layer's output differs by {difference:.3g}")
    return reports


def print_all_to_all(shape: Shape, passes: int, reports: list[dict]) -> None:
    print(
        f"\nall-to-all bytes, EP {EP} on {EP} gloo ranks, float32, shape {shape.label()} "
        f"(experts/top-k/dim/hidden/tokens per rank), {passes} pass(es) each"
    )
    print("| rank | kind | measured bytes | estimated bytes | measured / estimated |")
    print("|---|---|---|---|---|")
    ratios = []
    for rank, report in enumerate(reports):
        measured = sum(figures["measured"] for figures in report.values())
        estimated = sum(estimated_all_to_all_bytes(shape, passes, name == "checkpointed") for name in report)
        for name, figures in report.items():
            expected = estimated_all_to_all_bytes(shape, passes, name == "checkpointed")
            print(
                f"| {rank} | {name} | {figures['measured']:,} | {expected:,.0f} | "
                f"{figures['measured'] / expected:.3f} |"
            )
        ratios.append(measured / estimated)
    print(
        f"measured / estimated all-to-all bytes, EP {EP} on {EP} gloo ranks: "
        + ", ".join(f"{ratio:.3f}" for ratio in ratios)
        + f" (rank 0, rank 1; shape {shape.label()}, plain and checkpointed passes)"
    )


# --- per-rank cost under TP: each TP rank routes its own slice of the sequence -----------------

TP = EP  # the measured TP group: the same 2 gloo ranks, EP 2 over them
A3B_CONFIG = Path(__file__).resolve().parent.parent / "train_configs" / "qwen3_30b_a3b.toml"
A3B_EP = 8  # the EP degree of the Qwen3-30B-A3B table: a multiple of every TP degree in it


def counted_expert_rows(experts) -> list[int]:
    """A list that gets the rows each forward of the expert-parallel ``experts`` runs through
    its local experts (those it received from every rank)."""
    rows, run_local = [], experts._run_local_experts

    def counted(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return run_local(x, counts)

    experts._run_local_experts = counted
    return rows


def tensor_parallel_report(rank: int, shape: "Shape") -> dict:
    """This rank's tokens routed, expert rows run and all-to-all bytes sent in one forward +
    backward, with every TP rank routing the whole sequence (as before) and its own half of it
    (the trainer's plan now), and the largest difference between the two layers' outputs."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from titanlite.parallel.expert_parallel import apply_expert_parallel
    from titanlite.parallel.moe_tensor_parallel import moe_tensor_parallel_plan

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    sequence = rank_tokens(shape, 0).unsqueeze(0)  # the data-parallel rank's sequence, on both TP ranks
    report, outputs = {}, {}
    for layout in ("whole", "split"):
        moe = build(shape)[0].float()
        apply_expert_parallel(moe, mesh)  # the ep group is the TP group
        rows = counted_expert_rows(moe.experts)
        x = sequence
        if layout == "split":  # the trainer's plan, sequence parallel: this rank's half of the sequence
            holder = nn.Module()
            holder.feed_forward = moe
            parallelize_module(holder, mesh, moe_tensor_parallel_plan(moe, mesh, Shard(1)))
            x = sequence.chunk(TP, dim=1)[rank]
        x = x.clone().requires_grad_()
        with SentBytes(rank, TP) as sent:
            out = moe(x)
            out.pow(2).sum().backward()
        outputs[layout] = out.detach()
        report[layout] = {"tokens": x.shape[1], "rows": sum(rows), "bytes": sent.bytes}
    # The split layer's output is the whole layer's on this rank's part of the sequence.
    whole_part = outputs["whole"].chunk(TP, dim=1)[rank]
    report["largest_difference"] = (outputs["split"] - whole_part).abs().max().item()
    return report


def print_tensor_parallel(shape: Shape, reports: list[dict]) -> None:
    print(
        f"\nper-rank MoE cost under TP {TP} (EP {TP} over the TP ranks), {TP} gloo ranks, float32, shape "
        f"{shape.label()} (the tokens: one sequence of the data-parallel rank), one forward + backward"
    )
    print("| rank | every TP rank routes | tokens | expert rows | all-to-all bytes | estimated bytes |")
    print("|---|---|---|---|---|---|")
    for rank, report in enumerate(reports):
        for layout, what in (("whole", "the whole sequence (before)"), ("split", "its own slice (now)")):
            figures = report[layout]
            estimated = expert_all_to_all_bytes(figures["tokens"], shape.top_k, shape.dim, 4, shape.experts, TP, 1, 0)
            print(
                f"| {rank} | {what} | {figures['tokens']} | {figures['rows']:,} | {figures['bytes']:,} | "
                f"{estimated:,.0f} |"
            )
    ratios = {
        key: ", ".join(f"{report['whole'][key] / report['split'][key]:.2f}" for report in reports)
        for key in ("rows", "bytes")
    }
    print(
        f"before / after per rank, TP {TP} with EP {TP} over its ranks: expert rows {ratios['rows']}; "
        f"all-to-all bytes {ratios['bytes']} (rank 0, rank 1; shape {shape.label()})"
    )


def print_a3b_per_rank_cost() -> None:
    """The estimator's per-rank MoE cost of train_configs/qwen3_30b_a3b.toml's micro-batch (one
    4096-token sequence per data-parallel rank, full activation checkpointing, bf16) at TP 1,
    2, 4 and 8: before, every TP rank ran the MoE layers on all the tokens (the TP 1 figures);
    now each routes 1/tp of them. TP 8 does not split the model's 4 key/value heads (the
    trainer refuses it); its MoE figures are shown all the same."""
    from titanlite.config import parse_args
    from titanlite.estimate.compute import rank_work, recompute_fraction
    from titanlite.estimate.expert_parallel import moe_all_to_all_bytes
    from titanlite.estimate.tensor_parallel import moe_gradient_all_reduce_bytes, recomputed_collective_blocks
    from titanlite.plan import run_model_args

    config = parse_args(["--job.config_file", str(A3B_CONFIG)])
    args, training, ac = run_model_args(config), config.training, config.activation_checkpoint
    tokens = training.local_batch_size * training.seq_len
    work = rank_work(args, training.seq_len, recompute_fraction(args.n_layers, ac.mode, ac.selective_ac_option), None)
    recomputed = recomputed_collective_blocks(args.n_layers, ac.mode, ac.selective_ac_option)
    moe_flops = (work.moe_flops + work.moe_recompute_flops) * tokens
    a2a = {tp: moe_all_to_all_bytes(args, work, tokens, 2, A3B_EP, recomputed, tp) for tp in (1, 2, 4, 8)}
    held_whole = work.held.moe + work.experts  # routers (and any shared experts) and experts, without EP
    print(
        f"\nper-rank MoE cost of {A3B_CONFIG.name}'s micro-batch ({tokens} tokens per data-parallel rank, "
        f"AC {ac.mode}, bf16), estimated: MoE layers' FLOPs (forward, backward, recomputation) and EP {A3B_EP}'s "
        "all-to-all bytes per rank, before (every TP rank routes all the tokens) and now (its 1/tp)"
    )
    print(
        "| tp | MoE TFLOP before | MoE TFLOP now | all-to-all GB before | all-to-all GB now | before / now | "
        "new: expert gradients summed over tp without EP, GB |"
    )
    print("|---|---|---|---|---|---|---|")
    for tp in (1, 2, 4, 8):
        gradients = moe_gradient_all_reduce_bytes(held_whole, 2, tp)
        print(
            f"| {tp} | {moe_flops / 1e12:.2f} | {moe_flops / tp / 1e12:.2f} | {a2a[1] / 1e9:.2f} | "
            f"{a2a[tp] / 1e9:.2f} | {a2a[1] / a2a[tp]:.2f} | {gradients / 1e9:.1f} |"
        )


def parse_shape(text: str) -> Shape:
    """A Shape from experts,top-k,dim,hidden,tokens; ValueError says what is wrong."""
    fields = text.split(",")
    if len(fields) != 5 or not all(field.strip().isdigit() for field in fields):
        raise ValueError("expected five positive integers experts,top-k,dim,hidden,tokens")
    shape = Shape(*map(int, fields))
    MoEArgs(dim=shape.dim, n_experts=shape.experts, top_k=shape.top_k, hidden_dim=shape.hidden)  # its own checks
    if shape.tokens < 1:
        raise ValueError("tokens must be at least 1")
    # The layer's own test: its tokens against w1, which fitting means w2 and w3 fit too.
    rows = torch.empty(0, shape.dim, dtype=torch.bfloat16)
    if not grouped_mm_fits(rows, torch.empty(shape.experts, shape.hidden, shape.dim, dtype=torch.bfloat16)):
        raise ValueError("the layer would not take the grouped path: dim and hidden must be multiples of 8")
    return shape


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"shape {QUICK_SHAPE} only, 1 timed pass (seconds)")
    parser.add_argument(
        "--shape",
        action="append",
        help=f"experts,top-k,dim,hidden,tokens; repeat for more (default {' '.join(SHAPES)})",
    )
    parser.add_argument("--repeats", type=int, help="timed passes of each path per shape (default 3; quick 1)")
    parser.add_argument(
        "--precision",
        action="append",
        choices=PRECISIONS,
        help="bf16 (weights and tokens bf16) or autocast (float32 under autocast); repeat for both (default both)",
    )
    parser.add_argument(
        "--a2a_shape",
        help=f"the all-to-all half's experts,top-k,dim,hidden,tokens (default {A2A_SHAPE}; quick: the quick shape)",
    )
    parser.add_argument("--a2a_passes", type=int, help="forward+backward passes of each kind (default 3; quick 1)")
    parser.add_argument(
        "--device", default="cpu", help="where the grouped-vs-loop half runs, e.g. cuda (the all-to-all half: CPU)"
    )
    parser.add_argument(
        "--no_a2a", action="store_true", help="skip the parts on 2 gloo ranks (all-to-all bytes, TP's measured cost)"
    )
    options = parser.parse_args(argv)
    texts = options.shape or ([QUICK_SHAPE] if options.quick else list(SHAPES))
    options.shapes = []
    for text in texts:
        try:
            options.shapes.append(parse_shape(text))
        except ValueError as error:
            parser.error(f"--shape {text}: {error}")
    options.precisions = options.precision or list(PRECISIONS)
    options.repeats = options.repeats if options.repeats is not None else 1 if options.quick else 3
    options.a2a_passes = options.a2a_passes if options.a2a_passes is not None else 1 if options.quick else 3
    for name in ("repeats", "a2a_passes"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(options, name)}")
    a2a_text = options.a2a_shape or (QUICK_SHAPE if options.quick else A2A_SHAPE)
    try:
        options.a2a = parse_shape(a2a_text)
    except ValueError as error:
        parser.error(f"--a2a_shape {a2a_text}: {error}")
    if options.a2a.experts % EP:
        parser.error(f"--a2a_shape {a2a_text}: the experts must split evenly over the {EP} ranks")
    if options.a2a.tokens % TP:
        parser.error(f"--a2a_shape {a2a_text}: the tokens must split evenly over the {TP} TP ranks")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    print(
        f"titanlite MoE grouped GEMM benchmark, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads on {os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} before"
    )
    if options.device != "cpu":
        print(f"grouped vs loop on {options.device}: {torch.accelerator.current_accelerator()} {device_name(options)}")
    print(f"forward + backward of sum(out²), median of {options.repeats} timed passes after a checked one")
    print()
    print(
        "| precision | experts | top-k | dim | hidden | tokens | grouped fwd ms | grouped fwd+bwd ms | loop fwd ms | "
        "loop fwd+bwd ms | loop / grouped fwd | loop / grouped fwd+bwd | largest difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {precision: [] for precision in options.precisions}
    for precision in options.precisions:
        for shape in options.shapes:
            result = measure(shape, options.repeats, precision, options.device)
            (grouped_fwd, grouped_total), (loop_fwd, loop_total) = result["grouped_ms"], result["loop_ms"]
            ratios[precision].append(loop_total / grouped_total)
            print(
                f"| {precision} | {shape.experts} | {shape.top_k} | {shape.dim} | {shape.hidden} | {shape.tokens} | "
                f"{grouped_fwd:.1f} | {grouped_total:.1f} | {loop_fwd:.1f} | {loop_total:.1f} | "
                f"{loop_fwd / grouped_fwd:.2f} | {ratios[precision][-1]:.2f} | {result['difference']:.2g} |",
                flush=True,
            )
    print(f"\nload average {os.getloadavg()[0]:.2f} after")
    for precision, values in ratios.items():
        print(
            f"loop / grouped forward+backward time, {'autocast bf16' if precision == 'autocast' else precision}: "
            + ", ".join(f"{ratio:.2f}" for ratio in values)
            + " (experts/top-k/dim/hidden/tokens: "
            + ", ".join(shape.label() for shape in options.shapes)
            + ")"
        )
    if not options.no_a2a:
        reports = measure_on_two_ranks(options.a2a, options.a2a_passes)
        print_all_to_all(options.a2a, options.a2a_passes, [report["a2a"] for report in reports])
        print_tensor_parallel(options.a2a, [report["tp"] for report in reports])
    print_a3b_per_rank_cost()
    return 0


def device_name(options: argparse.Namespace) -> str:
    return torch.cuda.get_device_name(options.device) if options.device.startswith("cuda") else ""


if __name__ == "__main__":
    sys.exit(main())
