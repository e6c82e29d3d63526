"""The memory estimate against the peaks measured on GPUs, and its CUDA terms against tensors.

The measured figures are those of real training steps of gpu_check's 1 B model ("check1b":
dim 2048, 16 blocks, 32 heads of 64, 8 key/value heads, vocabulary 128256; bf16 autocast over
float32 weights, batch 1), whose configs benchmarks/gpu_memory.py and gpu_check.py build; the
estimate runs here, on the CPU, from the same configs. Goal: every peak within 10%.

The terms (titanlite.estimate.compiled, ALLOCATOR_SLACK) are checked where a CPU can: what an
eager block and the eager loss keep for backward, on CPU tensors; what the CUDA attention
kernels keep, from their meta registrations.
"""

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from titanlite.config import parse_args
from titanlite.estimate import estimate_memory
from titanlite.estimate.compiled import compiled_block_saving, compiled_loss
from titanlite.estimate.floor import step_floor_bytes
from titanlite.loss import cross_entropy_sum
from titanlite.models.llama import LlamaArgs, Transformer
from titanlite.models.llama.model import TransformerBlock, rope_tables
from titanlite.models.qwen3.model import Qwen3Block
from titanlite.registry import get_model_args

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
TOLERANCE = 0.10


@dataclass(frozen=True)
class Measured:
    """One measured step: where it was measured, and its allocator peaks in bytes."""

    name: str
    seq_len: int
    compiled: bool
    ac_option: str  # selective activation checkpointing: "2" (every 2nd block) or "op"
    ema: bool
    allocated: int
    reserved: int | None  # None: not recorded


# H200 (torch 2.11.0+cu130), 2026-11-27: `python benchmarks/gpu_memory.py --no-estimate --snapshots
# DIR --json FILE`, the largest allocated_bytes.all.peak and reserved_bytes.all.peak of steps 3
# to 7 (torch.cuda.memory_stats), from its JSON; gpu_memory's runs then checkpointed every 2nd
# block (the config's selective option "2"), with the EMA on, eager and compiled (model, loss).
H200 = [
    Measured("H200 eager seq 4096", 4096, False, "2", True, 36_431_138_304, 38_738_591_744),
    Measured("H200 eager seq 8192", 8192, False, "2", True, 47_320_944_128, 51_055_165_440),
    Measured("H200 compiled seq 4096", 4096, True, "2", True, 30_619_963_392, 31_111_249_920),
    Measured("H200 compiled seq 8192", 8192, True, "2", True, 35_696_496_640, 37_885_050_880),
]
# H100 80GB HBM3 (torch 2.11.0+cu130), 2026-11-27: `python benchmarks/gpu_check.py`, each run
# in a process of its own, per-op selective checkpointing, seq 8192: the largest max_active
# of the measured windows (GiB, as printed to two decimals): run 1 compiled (model, loss) with
# the EMA, 33.72; run 2 eager without it, 36.46.
H100 = [
    Measured("H100 gpu_check run 1 (compiled, EMA)", 8192, True, "op", True, round(33.72 * GIB), None),
    Measured("H100 gpu_check run 2 (eager)", 8192, False, "op", False, round(36.46 * GIB), None),
]


@pytest.fixture(scope="module")
def benchmarks(request):
    """gpu_check and gpu_memory, whose functions build the measured runs' configs."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    request.addfinalizer(lambda: sys.path.remove(str(REPO / "benchmarks")))
    import gpu_check
    import gpu_memory

    gpu_check.register_flavors(gpu_check.GPU_SIZES)
    return gpu_check, gpu_memory


def measured_argv(measured: Measured, benchmarks, dump: str) -> list[str]:
    gpu_check, gpu_memory = benchmarks
    if measured in H200:
        sizes = gpu_memory.run_sizes(measured.seq_len, "compiled" if measured.compiled else "eager", dry_run=False)
        argv = gpu_memory.trainer_argv(sizes, dump)
    else:
        run = gpu_check.MFU_RUN if measured.ema else gpu_check.SAVE_RUN
        argv = gpu_check.trainer_argv(gpu_check.GPU_SIZES, dump, run)
    # The option each was measured with (the last of a repeated key wins).
    return argv + ["--activation_checkpoint.selective_ac_option", measured.ac_option]


@pytest.mark.parametrize("measured", H200 + H100, ids=lambda m: m.name)
def test_the_estimate_is_within_10_percent_of_every_measured_peak(measured, benchmarks):
    with tempfile.TemporaryDirectory() as dump:
        job_config = parse_args(measured_argv(measured, benchmarks, dump))
    assert job_config.compile.enable == measured.compiled and job_config.ema.enable == measured.ema
    assert set(job_config.compile.components) == ({"model", "loss"} if measured.compiled else {"model"})
    estimate = estimate_memory(job_config, 1, device_type="cuda")
    ratio = measured.allocated / estimate.peak_bytes
    found, predicted = measured.allocated / GIB, estimate.peak_bytes / GIB
    print(f"\n{measured.name}: allocated {found:.2f} vs {predicted:.2f} GiB = {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE, "\n".join(estimate.lines())
    if measured.reserved is not None:
        reserved = measured.reserved / estimate.reserved_bytes
        print(f"  reserved {measured.reserved / GIB:.2f} vs {estimate.reserved_bytes / GIB:.2f} GiB = {reserved:.3f}")
        assert abs(reserved - 1) <= TOLERANCE, "\n".join(estimate.lines())


# --- the terms ------------------------------------------------------------------------------

ARGS = LlamaArgs(dim=256, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=512, multiple_of=256, max_seq_len=20)
BATCH, SEQ = 3, 20  # 60 tokens: no activation is shaped like a weight


def saved_for_backward(fn) -> list[torch.Tensor]:
    """One tensor per distinct storage that autograd keeps for backward while ``fn()`` runs."""
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return list(saved.values())


def test_an_eager_block_keeps_what_the_compiled_one_recomputes():
    """compiled_block_saving is what an eager block keeps (measured here, on CPU tensors under
    CPU autocast) less what the compiled block kept on the GPU. The latter, per token, read
    from the allocator history of the compiled H200 step at seq 8192 (the second block of
    snapshot_compiled_8192.pkl.gz, gpu_memory --snapshots): the attention norm's bf16 output
    (2 x dim), q (2 x dim), k and v (2 x kv_dim each), q and k rotated (2 x dim, 2 x kv_dim),
    the attention output (2 x dim) and its float32 logsumexp (4 x heads), the feed-forward
    norm's bf16 output (2 x dim), w1's and w3's outputs and their gated product (3 x 2 x
    hidden), the block's float32 output (4 x dim) and the two norms' float32 reciprocal
    roots (2 x 4)."""
    torch.manual_seed(0)
    block = TransformerBlock(0, ARGS)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.02)
    cos, sin = rope_tables(ARGS)
    x = torch.randn(BATCH, SEQ, ARGS.dim, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block(x, cos, sin)

    # Activations lead with the batch or the tokens; the weights' bf16 copies and the RoPE
    # tables do not.
    kept = [t for t in saved_for_backward(forward) if t.shape[0] in (BATCH, BATCH * SEQ)]
    eager = sum(t.untyped_storage().nbytes() for t in kept) // (BATCH * SEQ)
    dim, kv_dim, hidden, heads = ARGS.dim, ARGS.kv_heads * ARGS.head_dim, ARGS.ffn_hidden_dim, ARGS.n_heads
    # Eager keeps (the same on the H200): both norms' float32 outputs, the float32 sum between
    # attention and feed-forward and the block's float32 input; five bf16 copies of the
    # norms' outputs, one per projection; q, k rotated and v; the attention output and its
    # logsumexp; w1's and w3's outputs, the SiLU's and the gated product; the reciprocal roots.
    assert eager == 4 * 4 * dim + 5 * 2 * dim + 2 * dim + 2 * 2 * kv_dim + 2 * dim + 4 * heads + 4 * 2 * hidden + 2 * 4
    compiled = 2 * dim + 2 * dim + 2 * 2 * kv_dim + 2 * dim + 2 * kv_dim + 2 * dim + 4 * heads
    compiled += 2 * dim + 3 * 2 * hidden + 4 * dim + 2 * 4
    assert compiled_block_saving(block, BATCH * SEQ) == (eager - compiled) * BATCH * SEQ


def test_the_compiled_loss_keeps_one_buffer_like_the_logits_where_eager_keeps_float32():
    leaf = torch.randn(BATCH, SEQ, ARGS.vocab_size, dtype=torch.bfloat16, requires_grad=True)
    logits = leaf * 1  # as the output layer's: not a leaf, whose gradient autograd would copy
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ))
    eager = saved_for_backward(lambda: cross_entropy_sum(logits, labels))
    # Eager: the float32 log-probabilities, beside the labels.
    assert [t.dtype for t in eager if t.numel() == logits.numel()] == [torch.float32]
    losses = []
    kept = saved_for_backward(lambda: losses.append(compiled_loss(logits, labels)))
    assert [(t.shape, t.dtype) for t in kept] == [(logits.shape, torch.bfloat16)]
    gradients = []
    logits.register_hook(gradients.append)
    losses[0].backward()
    # Its backward hands the kept buffer on as the logits' gradient: nothing more is allocated.
    assert gradients[0].untyped_storage().data_ptr() == kept[0].untyped_storage().data_ptr()


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
def test_the_cuda_attention_kernels_keep_what_the_cpu_simulation_counts(kernel):
    """The estimate runs SDPA's CPU kernel; on CUDA the trainer's bf16 attention ran cuDNN's
    (flash is the other bf16 candidate) and float32 the memory-efficient one (gpu_check's
    SDPA rows). Their meta registrations (torch/_meta_registrations.py) give what each keeps
    for backward beside its output: a float32 logsumexp per query and head (the efficient
    kernel pads the queries to a multiple of 32) and, for cuDNN and flash, a random seed and
    offset of a few bytes."""
    aten = torch.ops.aten
    batch, heads, seq, head_dim = 1, 32, 8192 + 8, 64
    dtype = torch.float32 if kernel == "efficient" else torch.bfloat16
    q, k, v = (torch.empty(batch, heads, seq, head_dim, device="meta", dtype=dtype) for _ in range(3))
    run = {
        "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True),
        "flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
        "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True),
    }[kernel]
    outputs = [t for t in run() if isinstance(t, torch.Tensor)]
    cuda_bytes = sum(t.numel() * t.element_size() for t in outputs)
    cpu_bytes = sum(
        t.numel() * t.element_size() for t in aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    )
    padding = 4 * batch * heads * (-seq % 32) if kernel == "efficient" else 0
    seed_and_offset = {"cudnn": 16, "flash": 24, "efficient": 16}[kernel]
    assert cuda_bytes == cpu_bytes + padding + seed_and_offset


def test_the_block_terms_stay_where_they_were_measured():
    """Qwen3's blocks (norms on q and k) and MoE blocks keep other tensors: no saving is
    claimed for them, so the estimate keeps their eager figure."""
    with torch.device("meta"):
        qwen3 = Qwen3Block(0, get_model_args("qwen3", "debugmodel"))
        llama = TransformerBlock(0, ARGS)
    assert compiled_block_saving(qwen3, 1000) == 0
    assert compiled_block_saving(llama, 1000) > 0


def test_the_floor_counts_the_compiled_loss_buffer_instead_of_float32():
    with torch.device("meta"):
        model = Transformer(LlamaArgs(**{**vars(ARGS), "n_layers": 2}))
    floors = [
        step_floor_bytes(model, ARGS.vocab_size, 1, BATCH, SEQ, 2, cpu_offload=False, compiled_loss=compiled)
        for compiled in (False, True)
    ]
    logits = BATCH * SEQ * ARGS.vocab_size
    assert [floor["logits"] for floor in floors] == [logits * (2 + 4), logits * (2 + 2)]
