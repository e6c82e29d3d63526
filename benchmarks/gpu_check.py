"""The GPU path, checked in one command on one CUDA GPU (5 minutes on an H100 before the block_causal runs).

    python benchmarks/gpu_check.py                  # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --cpu-dry-run    # the same code on the CPU, debug sizes

Without a CUDA device (and without --cpu-dry-run) it prints "no GPU: skipped" and exits 0.
Otherwise it prints one table row per check and exits 1 if any check failed:

* SDPA kernel, bf16 (autocast, as the trainer computes) and fp32, grouped-query attention
  (32 query heads, 8 key/value heads, seq 8192): one block built as the trainer builds its
  model runs with the math backend disabled; the profiler names the SDPA operator that ran
  (and on CUDA the kernel), and math, or no fused kernel taking the layout, fails. Two
  control rows show the check can fail: with only the math backend allowed it must read
  math, with no backend allowed it must report the error.
* Three trainings of a Llama-3-shaped 1 B model ("check1b": dim 2048, 16 blocks, 32 heads, 8
  key/value heads, vocabulary 128256), bf16 compute with float32 weights, selective
  activation checkpointing per op (matmul and attention outputs kept), seq 8192, batch 1,
  each run in a process of its own:
  - run 1, compiled, with the EMA, no checkpoint: MFU (the trainer's own figure, the median
    of WINDOWS logged windows after one warm-up window; attention counted causally, and
    beside it counted whole as torchtitan does; see docs/metrics.md), target >= 45%; host
    syncs in quiet steps; peak memory.
  - run 1b, the same without the EMA: its MFU and host syncs, and a row setting run 1's MFU
    beside it (both conventions): what the EMA's update costs.
  - run 2, eager, saving with `async_with_pinned_mem`: MFU (reference), host syncs, and the
    race the staging guards against. At the end of the measured windows the state is copied
    into pinned host memory on the compute stream right where the save is issued (no
    synchronisation the training lacks, and nothing more on the device, so the check fits an
    80 GB card), training goes on, and the checkpoint read back from disk is compared with the
    copy bit for bit, every tensor of the model, optimizer and schedule. The next interval
    save does the same with the guard off (CheckpointManager.wait_for_staging and
    order_staging_after_compute made no-ops) and reports whether a tear appears; only a
    tear with the guard on fails. No save falls in a measured window, each compared
    checkpoint is deleted before the next save, and the last save is model-only bf16.
  - Host syncs in quiet steps: `torch.cuda.set_sync_debug_mode("warn")` is on during the
    steps after the warm-up that are not log steps, save points or SYNC_EVERY steps, and
    every synchronizing CUDA call there is counted. Target 0.
  - Peak memory: each run's largest `max_active` (the allocated peak) against
    `titanlite.estimate.estimate_memory` for the same config (fake tensors, in this process),
    with the estimate's breakdown, and its largest `max_reserved` against the estimate's
    reserved figure (the caching allocator's slack beside the tensors). Target within 10%.
    Runs 1 and 1b check the estimate's compile terms (the compiled loss and blocks), run 2
    the eager step.
* Float8: float8 (torchao's tensorwise recipe, the trainer's --model.converters float8)
  against bf16 on 16 blocks of Llama 3 8B's shape, seq 8192, compiled, per-op AC, 25 steps
  each in a process of its own (benchmarks/gpu_float8.py's runs): step-time ratio, target
  >= 1.2x, with both runs' max active memory; the loss gap after the 25 steps is reported.
* Document masking (block_causal): FlexAttention, its kernel on CUDA, which CI can run only
  forward on a CPU (tests/test_flex_attention.py). Its forward (the block mask and mask
  function titanlite/models/attention.py builds, compiled) against the SDPA mask, float32,
  two rows of several documents at seq FLEX_CHECK_LEN with the run's heads: target within
  FLEX_FORWARD_TOLERANCE. Then two compiled trainings of the same model and data with per-op
  AC, DOCUMENT_STEPS steps each in a process of its own, one with FlexAttention and one with
  the SDPA mask (attention.FLEX_ON_CUDA off): every step's loss within bf16's tolerance
  (torch.testing's rtol for bfloat16), and not bit-identical on CUDA (the same bits would mean
  one kernel ran both). The CPU dry run trains both with the SDPA mask (FlexAttention's
  backward refuses the CPU).
* Disk: the checkpoint bytes are estimated before anything runs (printed; the check refuses
  to start above DISK_LIMIT_BYTES on disk at once) and the largest checkpoint measured on
  disk must match the estimate within 10%.

--cpu-dry-run runs every line of the same code on the CPU with debug sizes (the tiny
model, seq 128, no compile: tests/test_parity.py covers compile), except the lines that
end with the CUDA_ONLY marker below; tests/test_gpu_check.py runs it under coverage and
fails on any other line left unexecuted (of titanlite/models/attention.py too). Its numbers
mean nothing and its MFU, memory and sync targets are not enforced; the SDPA, FlexAttention
forward, block_causal loss, checkpoint and disk rows are.

A run whose process fails (an error, or killed: out of memory, say) becomes one failed row
saying why, and the other rows are still printed; without torchao the float8 rows say
"skipped". The last line names every failed check with its result.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

from titanlite.metrics import tags  # noqa: E402
from titanlite.metrics.flops import count_params, flops_per_token  # noqa: E402
from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs  # noqa: E402

# A line of this script (and of gpu_mfu.py and checkpoint_stall.py) that ends with this
# comment runs only on CUDA; every other line runs in the CPU dry run.
CUDA_ONLY = "# cuda-only"

MODEL_ARGS = LlamaArgs(
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=1024,
    ffn_dim_multiplier=1.5,
    rope_theta=500000.0,
)
ATTENTION_FLAVOR = "checkattention"  # one block, for the SDPA rows


@dataclass(frozen=True)
class Sizes:
    """What differs between the CUDA run and the CPU dry run: sizes, never code."""

    flavor: str
    seq_len: int
    attention: LlamaArgs  # the SDPA rows' one block
    compile: bool
    log_freq: int  # steps per measured window
    peak_tflops: float  # 0: the trainer's table for the GPU
    flex_check_len: int  # the FlexAttention forward row's sequence: several 128-token tiles


GPU_SIZES = Sizes(
    "check1b", 8192, LlamaArgs(dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=512), True, 4, 0.0, 8192
)
# flex_check_len 320: the shapes of tests/test_flex_attention.py's check, whose compiled kernel
# the dry run then finds in inductor's cache (a CPU compile of it takes 15 to 25 s here).
DRY_RUN_SIZES = Sizes(
    "tiny", 128, LlamaArgs(dim=256, n_layers=1, n_heads=16, n_kv_heads=4, vocab_size=512), False, 2, 1.0, 320
)
WINDOWS = 5  # measured windows per run, after one warm-up window: an odd count has a middle one
MFU_TARGET, MEMORY_TOLERANCE, DISK_TOLERANCE = 45.0, 0.10, 0.10
FLOAT8_LAYERS, FLOAT8_STEPS, FLOAT8_TARGET = 16, 25, 1.2  # torchtitan reports +28% on 8B with compile
DISK_LIMIT_BYTES = 20 * 10**9
# Beyond the tensors a checkpoint holds DCP's metadata and the small states (schedule, data
# position, RNG): a few KB per tensor, which only a tiny model notices.
DISK_SLACK_BYTES = 10**6
MFU_RUN, SAVE_RUN = "run 1 (EMA, compiled on CUDA)", "run 2 (eager, async saves)"
NO_EMA_RUN = "run 1b (no EMA, compiled on CUDA)"  # run 1 without the EMA: what the EMA costs
TRAINING_RUNS = (MFU_RUN, NO_EMA_RUN, SAVE_RUN)
FLEX_RUN = "block_causal run, FlexAttention (compiled on CUDA)"
SDPA_MASK_RUN = "block_causal run, SDPA mask (compiled on CUDA)"
DOCUMENT_RUNS = (FLEX_RUN, SDPA_MASK_RUN)
RUNS = TRAINING_RUNS + DOCUMENT_RUNS
DOCUMENT_STEPS = 6
BF16_RTOL = 1.6e-2  # torch.testing's relative tolerance for bfloat16
FLEX_FORWARD_TOLERANCE = 1e-5


def register_flavors(sizes: Sizes) -> None:
    LLAMA3_FLAVORS.setdefault(GPU_SIZES.flavor, MODEL_ARGS)
    LLAMA3_FLAVORS[ATTENTION_FLAVOR] = sizes.attention


def measured_steps(sizes: Sizes) -> int:
    """The warm-up window and the measured ones."""
    return (1 + WINDOWS) * sizes.log_freq


def save_steps(sizes: Sizes) -> tuple[int, int]:
    """Run 2's interval saves: right after the measured windows (guard on), one interval
    later (guard off). The run ends one step after the second."""
    first = measured_steps(sizes)
    return first, 2 * first


def trainer_argv(sizes: Sizes, dump: str, run: str) -> list[str]:
    first_save, second_save = save_steps(sizes)
    argv = [
        *("--model.flavor", sizes.flavor, "--job.dump_folder", dump, "--training.seq_len", str(sizes.seq_len)),
        *("--training.local_batch_size", "1", "--training.mixed_precision_param", "bfloat16"),
        *("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
        *("--lr_scheduler.warmup_steps", "2"),
        *(("--metrics.peak_tflops", str(sizes.peak_tflops)) if sizes.peak_tflops else ()),
    ]
    compiled = ("--compile.enable", "--compile.components", "model,loss") if sizes.compile else ()
    if run in DOCUMENT_RUNS:  # every step logged: its loss is compared
        steps = ("--training.steps", str(DOCUMENT_STEPS), "--metrics.log_freq", "1")
        return argv + ["--model.attn_mask_type", "block_causal", *steps, *compiled]
    argv += ["--metrics.log_freq", str(sizes.log_freq)]
    if run in (MFU_RUN, NO_EMA_RUN):
        ema = ("--ema.enable",) if run == MFU_RUN else ()
        return argv + ["--training.steps", str(measured_steps(sizes)), *ema, *compiled]
    return argv + [
        *("--training.steps", str(second_save + 1), "--checkpoint.enable", "--checkpoint.interval", str(first_save)),
        *("--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.keep_latest_k", "1"),
        *("--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"),
    ]


def checkpoint_bytes(sizes: Sizes) -> dict[str, int]:
    """Run 2's checkpoints: two full saves (float32 weights and AdamW's two moments; the
    schedule, data position and RNG states are a few KB) and a model-only bf16 last save.
    Each compared save is deleted before the next one starts."""
    params = count_params(LLAMA3_FLAVORS[sizes.flavor])
    full, last = 3 * 4 * params, 2 * params
    return {"full": full, "written": 2 * full + last, "at_once": max(full, last)}


# --------------------------------------------------------------------------- in the worker


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # cuda-only


def attention_block(sizes: Sizes, device: torch.device):
    """The SDPA rows' one block, built as the trainer builds its model (plan_run, build_model:
    on meta, then materialised and initialised on the device), with its compute context."""
    from titanlite.config import parse_args
    from titanlite.parallel import compute_context
    from titanlite.plan import build_model, plan_run

    job_config = parse_args(["--model.flavor", ATTENTION_FLAVOR, "--training.seq_len", str(sizes.seq_len)])
    plan = plan_run(job_config, world_size=1)
    model = build_model(job_config, plan, plan.parallel_dims.build_mesh(device.type), device)
    contexts = {name: compute_context(plan.parallel_dims, name, device.type) for name in ("bfloat16", "float32")}
    return model, contexts


def sdpa_operator(model, tokens: torch.Tensor, backends: list, context, device: torch.device) -> tuple[str, str]:
    """(the SDPA operator that ran, the CUDA kernel it launched or ""), or ("", the error)
    when no allowed backend takes the layout."""
    from torch.nn.attention import sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)  # cuda-only
    try:
        with sdpa_kernel(backends), torch.no_grad(), context, profile(activities=activities) as prof:
            model(tokens)
            synchronize(device)
    except RuntimeError as error:
        return "", str(error).splitlines()[0][:80]
    names = {(event.device_type.name, event.name) for event in prof.events()}
    # scaled_dot_product_attention dispatches to one of its backends' operators, named
    # aten::_scaled_dot_product_<backend>...; on CUDA each launches kernels of its own.
    operators = sorted(name for kind, name in names if name.startswith("aten::_scaled_dot_product_"))
    kernels = sorted(name for kind, name in names if kind == "CUDA" and ("attention" in name or "fmha" in name))
    return ", ".join(operators) or "no SDPA operator", ", ".join(kernels)[:60]


def sdpa_rows(sizes: Sizes, device: torch.device) -> list[dict]:
    """The attention block at the run's sequence length with the math backend disabled, in
    bf16 and fp32, then the two controls."""
    from torch.nn.attention import SDPBackend

    model, contexts = attention_block(sizes, device)
    tokens = torch.randint(0, sizes.attention.vocab_size, (1, sizes.seq_len), device=device)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    rows = []
    for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        operator, kernel = sdpa_operator(model, tokens, fused, contexts[dtype], device)
        fused_ran = operator.startswith("aten::_scaled_dot_product_") and "math" not in operator
        result = (operator + (f" ({kernel})" if kernel else "")) if operator else f"needs math: {kernel}"
        rows.append(
            {"check": f"SDPA kernel, {name}", "result": result, "target": "a fused kernel, never math", "ok": fused_ran}
        )
    math_only, _ = sdpa_operator(model, tokens, [SDPBackend.MATH], contexts["float32"], device)
    rows.append(
        {
            "check": "control: SDPA with only the math backend allowed",
            "result": math_only,
            "target": "the check reads math",
            "ok": "math" in math_only,
        }
    )
    nothing, error = sdpa_operator(model, tokens, [], contexts["float32"], device)
    rows.append(
        {
            "check": "control: SDPA with no backend allowed",
            "result": error,
            "target": "the check reports the error",
            "ok": not nothing and bool(error),
        }
    )
    return rows


def _flatten(state, prefix: str = "") -> dict:
    if isinstance(state, dict):
        flat = {}
        for key, value in state.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    if isinstance(state, (list, tuple)):
        return _flatten(dict(enumerate(state)), prefix)
    return {prefix.rstrip("."): state}


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory, queued on the current stream: from an accelerator,
    ``non_blocking`` makes torch allocate the copy pinned (its _to_copy does so for any
    accelerator but MPS), so the host waits for nothing here; read it after a synchronize."""
    return tensor.detach().to("cpu", non_blocking=True, copy=True)


def _map_tensors(function, state):
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, function, state)


class SaveRace:
    """Run 2's two saves under test: the state cloned on the compute stream where each save
    is issued, moved to the host once the save has staged, compared with the checkpoint
    read back from disk, which is then deleted."""

    def __init__(self, trainer, sizes: Sizes, device: torch.device):
        self.trainer, self.checkpointer, self.device = trainer, trainer.checkpointer, device
        self.guarded, self.unguarded = save_steps(sizes)
        self.clones: dict[int, dict] = {}
        self.rows: list[dict] = []
        self.largest_on_disk = 0
        save = self.checkpointer.save

        def save_with_clone(step, **kwargs):
            if step in (self.guarded, self.unguarded):
                # Queued on the current stream after this step's optimizer and EMA kernels
                # and before the next step's: the state as saved, with no host sync. The
                # copy lands in host memory (pinned, where a non-blocking copy from an
                # accelerator puts it), so the device holds nothing the training lacks: a
                # clone there (18 GB for check1b) would not fit beside it on an 80 GB card.
                collected = self.checkpointer._collect(list(self.checkpointer.states))
                self.clones[step] = _map_tensors(host_copy, collected)
            if step == self.unguarded:
                self.checkpointer.wait_for_staging = lambda: None  # the guard off for this save
                self.checkpointer.order_staging_after_compute = lambda: None
            return save(step, **kwargs)

        self.checkpointer.save = save_with_clone

    def after_step(self, step: int) -> None:
        """After the step that follows a save under test (staging has finished or, with the
        guard off, raced that step's optimizer): settle the save and compare."""
        saved = step - 1
        if saved not in self.clones:
            return
        synchronize(self.device)  # the copies into host memory have landed
        reference = self.clones.pop(saved)
        self.checkpointer.__dict__.pop("wait_for_staging", None)  # the guard back on
        self.checkpointer.__dict__.pop("order_staging_after_compute", None)
        self.checkpointer.wait()
        folder = self.checkpointer.folder / f"step-{saved}"
        self.largest_on_disk = max(self.largest_on_disk, sum(f.stat().st_size for f in folder.iterdir()))
        self.rows.append(self._compare(folder, reference, guarded=saved == self.guarded))
        shutil.rmtree(folder)  # the next save must not add to this one on disk

    @staticmethod
    def _compare(folder: Path, reference: dict, guarded: bool) -> dict:
        import torch.distributed.checkpoint as dcp

        loaded = _map_tensors(torch.empty_like, reference)
        dcp.load(loaded, checkpoint_id=str(folder))
        expected, saved = _flatten(reference), _flatten(loaded)
        tensors = [key for key, value in expected.items() if isinstance(value, torch.Tensor)]
        differing = [key for key in tensors if not torch.equal(saved[key], expected[key])]
        equal = f"{len(tensors) - len(differing)} of {len(tensors)} tensors equal"
        first = f" (first differing: {differing[0]})" if differing else ""
        if guarded:
            return {
                "check": f"async_with_pinned_mem save of step {folder.name[5:]} vs its stream-ordered clone",
                "result": equal + first,
                "target": "bit-identical",
                "ok": bool(tensors) and not differing,
            }
        return {
            "check": f"same, guard off (no staging wait), step {folder.name[5:]}",
            "result": ("torn: " if differing else "no tear seen: ") + equal + first,
            "target": "(reported, not enforced)",
            "ok": bool(tensors),
        }


# What c10's warn_or_error_on_sync says for each synchronizing call in "warn" mode. Matching
# only it leaves out the one-time notice that enabling the mode prints ("Synchronization
# debug mode is a prototype feature ..."), which the first run on an H200 counted as a sync.
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def counting_host_syncs(device: torch.device, syncs: list[str]):
    """Every synchronizing CUDA call inside, one line each into `syncs` (nothing on a CPU)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")  # cuda-only
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")  # cuda-only
            syncs.extend(str(w.message).splitlines()[0] for w in caught if SYNC_WARNING in str(w.message))


def mfu_windows(records: list[dict], sizes: Sizes) -> list[float]:
    """The MFU of each measured window: the log steps after the warm-up window, up to the
    first save."""
    steps = range(2 * sizes.log_freq, measured_steps(sizes) + 1, sizes.log_freq)
    by_step = {record["step"]: record for record in records}
    return [by_step[step][tags.MFU] for step in steps if tags.MFU in by_step.get(step, {})]


def training_rows(sizes: Sizes, run: str, dump: str, device: torch.device) -> tuple[list[dict], dict]:
    """The run's rows, and its figures for the rows made across runs: the median MFU and the
    measured windows' memory peaks."""
    from titanlite.config import parse_args
    from titanlite.nonfinite import SYNC_EVERY
    from titanlite.train import Trainer

    trainer = Trainer(parse_args(trainer_argv(sizes, dump, run)))
    last = trainer.job_config.training.steps
    race = SaveRace(trainer, sizes, device) if run == SAVE_RUN else None
    syncs: list[str] = []

    def quiet(step: int) -> bool:
        logged = step == 1 or step % sizes.log_freq == 0 or step == last or step % SYNC_EVERY == 0
        # The step after a save is not quiet either: the stager's thread copies (and syncs) then.
        saving = trainer.checkpointer.should_save(step, last) or trainer.checkpointer.should_save(step - 1, last)
        return step > sizes.log_freq and not logged and not saving

    one_step = trainer._one_step

    def checked_step(freq):
        step = trainer.step + 1
        with counting_host_syncs(device, syncs) if quiet(step) else contextlib.nullcontext():
            record = one_step(freq)
        if race is not None:
            race.after_step(step)
        return record

    trainer._one_step = checked_step
    trainer.train()
    records = _read_metrics(Path(dump))
    windows = mfu_windows(records, sizes)
    on_gpu = device.type == "cuda"
    compiled = run == MFU_RUN and sizes.compile  # the run the MFU target is for
    rows = [
        {
            "check": f"MFU, {sizes.flavor} seq {sizes.seq_len}, {run}",
            "result": mfu_result(windows, sizes),
            "target": f">= {MFU_TARGET:.0f}%" if compiled else "(reference)",
            "ok": len(windows) == WINDOWS and (statistics.median(windows) >= MFU_TARGET or not (compiled and on_gpu)),
        },
        {
            "check": f"host syncs in quiet steps, {run}",
            "result": f"{len(syncs)}" + (f" ({syncs[0][:50]})" if syncs else "") + ("" if on_gpu else " (no CUDA)"),
            "target": "0",
            "ok": not syncs,
        },
    ]
    if race is not None:
        rows += race.rows + [disk_row(sizes, race.largest_on_disk)]
    # The measured windows only: the steps around run 2's saves are not a training's steps.
    windows_only = [r for r in records if sizes.log_freq < r["step"] <= measured_steps(sizes)]

    def peak(tag: str) -> float | None:
        return max((r[tag] for r in windows_only if tag in r), default=None)

    figures = {
        "mfu": statistics.median(windows) if windows else None,
        # max_active is the allocator's allocated peak here (active = allocated: no block
        # freed on one stream is held for another); on a CPU the process's peak RSS.
        "allocated_gib": peak(tags.MAX_ACTIVE_GIB if on_gpu else tags.PEAK_RSS_GIB),
        "reserved_gib": peak(tags.MAX_RESERVED_GIB),  # None on a CPU
    }
    return rows, figures


def whole_attention_factor(sizes: Sizes) -> float:
    """MFU counting attention whole (torchtitan's convention) over MFU counting it causally."""
    args = LLAMA3_FLAVORS[sizes.flavor]
    return flops_per_token(args, sizes.seq_len, causal_attention=False) / flops_per_token(args, sizes.seq_len)


def mfu_result(windows: list[float], sizes: Sizes) -> str:
    """The median window's MFU, with attention counted causally (the trainer's) and whole."""
    median = statistics.median(windows) if windows else float("nan")  # nan: the GPU lacks a peak
    whole = median * whole_attention_factor(sizes)
    return f"{median:.3g}% ({whole:.3g}% counting whole attention); median of {len(windows)} windows"


def ema_cost_row(sizes: Sizes, with_ema: float | None, without: float | None) -> dict:
    """Run 1's MFU against run 1b's (the same compiled training without the EMA), in both
    conventions: what the EMA's update costs a step."""
    whole = whole_attention_factor(sizes)
    nan = float("nan")  # a missing median (the GPU lacks a peak): reported, never passes
    on, off = (nan if value is None else value for value in (with_ema, without))
    return {
        "check": f"MFU with the EMA vs without, {sizes.flavor} seq {sizes.seq_len}, runs 1 and 1b",
        "result": f"{on:.3g}% vs {off:.3g}% ({on * whole:.3g}% vs {off * whole:.3g}% counting whole attention): "
        f"the EMA costs {off - on:.2g} points",
        "target": "(reported)",
        "ok": with_ema is not None and without is not None,
    }


def disk_row(sizes: Sizes, measured: int) -> dict:
    estimate = checkpoint_bytes(sizes)["full"]
    return {
        "check": "largest checkpoint on disk vs the disk estimate",
        "result": f"{measured / 1e9:.3g} vs {estimate / 1e9:.3g} GB = {measured / estimate:.2f}",
        "target": f"within {DISK_TOLERANCE:.0%} + {DISK_SLACK_BYTES / 1e6:.0f} MB",
        "ok": abs(measured - estimate) <= DISK_TOLERANCE * estimate + DISK_SLACK_BYTES,
    }


def flex_forward_row(sizes: Sizes, device: torch.device) -> dict:
    """FlexAttention's forward as block_causal runs it on CUDA (attention.py's block mask and
    mask function, flex_attention compiled) against the SDPA mask, float32, with the run's
    heads (grouped-query) on two rows of flex_check_len tokens: five documents, and two. The
    block mask must also equal the one torch's create_block_mask makes of the mask function."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titanlite.models.attention import attend, document_block_mask, document_mask, flex_attend

    args, seq = LLAMA3_FLAVORS[sizes.flavor], sizes.flex_check_len
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, args.n_heads, seq, args.head_dim, generator=generator).to(device)
    k, v = (torch.randn(2, args.kv_heads, seq, args.head_dim, generator=generator).to(device) for _ in range(2))
    positions = torch.arange(seq, device=device)
    ids = torch.stack([positions * 5 // seq, (positions >= 3 * seq // 4).long()])
    seen = document_mask(positions.unsqueeze(0) <= positions.unsqueeze(1), ids, ids)
    block_mask = document_block_mask(positions, positions, ids, ids)
    flex = flex_attend(q, k, v, block_mask, None)
    difference = (flex - attend(q, k, v, mask=seen.unsqueeze(1))).abs().max().item()
    torchs = create_block_mask(block_mask.mask_mod, 2, None, seq, seq, device=device)
    lists = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    same = all(torch.equal(getattr(block_mask, name), getattr(torchs, name)) for name in lists)
    return {
        "check": f"block_causal: FlexAttention forward vs the SDPA mask, fp32, seq {seq}, 7 documents",
        "result": f"max difference {difference:.2e}; block mask {'equal to' if same else 'UNLIKE'} create_block_mask's",
        "target": f"<= {FLEX_FORWARD_TOLERANCE:.0e}, equal",
        "ok": difference <= FLEX_FORWARD_TOLERANCE and same,
    }


def cp_flex_forward_row(sizes: Sizes, device: torch.device) -> dict:
    """Context parallelism's attention on CUDA: rank 0 of CP 2 under the head-tail split (its
    queries at chunks 0 and 3 of 4) attends the whole gathered sequence through the CP kernel's
    entry, attention.py's attend_by_position (on CUDA FlexAttention under position_block_mask,
    built from each tile's positions, no [q, kv] mask), against SDPA under the dense causal mask
    by position, float32, grouped-query heads; and FlexAttention under that block mask called
    directly (what the entry runs on CUDA; the CPU dry run's entry takes its SDPA branch)."""
    from titanlite.models.attention import attend, attend_by_position, flex_attend, position_block_mask
    from titanlite.parallel.context_parallel import sequence_positions

    args, seq = LLAMA3_FLAVORS[sizes.flavor], sizes.flex_check_len
    generator = torch.Generator().manual_seed(1)
    q_positions = sequence_positions(seq, 2, 0, headtail=True).to(device)
    kv_positions = torch.arange(seq, device=device)
    q = torch.randn(1, args.n_heads, len(q_positions), args.head_dim, generator=generator).to(device)
    k, v = (torch.randn(1, args.kv_heads, seq, args.head_dim, generator=generator).to(device) for _ in range(2))
    kernel = attend_by_position(q, k, v, None, q_positions, kv_positions)
    flex = flex_attend(q, k, v, position_block_mask(q_positions, kv_positions), None)
    sdpa = attend(q, k, v, mask=kv_positions.unsqueeze(0) <= q_positions.unsqueeze(1))
    difference = max((kernel - sdpa).abs().max().item(), (flex - sdpa).abs().max().item())
    return {
        "check": f"CP 2 rank 0 (head-tail): FlexAttention under the position block mask vs the SDPA mask, seq {seq}",
        "result": f"max difference {difference:.2e}",
        "target": f"<= {FLEX_FORWARD_TOLERANCE:.0e}",
        "ok": difference <= FLEX_FORWARD_TOLERANCE,
    }


def document_run(sizes: Sizes, run: str, dump: str, device: torch.device) -> dict:
    """One of the two block_causal trainings (FlexAttention on CUDA, or the SDPA mask): every
    step's loss; the FlexAttention run checks the kernel's forward first."""
    from titanlite.config import parse_args
    from titanlite.models import attention
    from titanlite.train import Trainer

    attention.FLEX_ON_CUDA = run == FLEX_RUN
    rows = [flex_forward_row(sizes, device), cp_flex_forward_row(sizes, device)] if run == FLEX_RUN else []
    Trainer(parse_args(trainer_argv(sizes, dump, run))).train()
    return {"rows": rows, "losses": [record[tags.LOSS] for record in _read_metrics(Path(dump))]}


def _read_metrics(dump: Path) -> list[dict]:
    files = sorted(dump.glob("metrics/*/metrics.jsonl"))
    lines = files[-1].read_text().splitlines() if files else []
    return [record for record in map(json.loads, lines) if tags.TPS in record]


def _worker(_, port: int, dry_run: bool, run: str, out: str) -> None:
    """One training run (the first also takes the SDPA rows, the FlexAttention one its forward
    row) in a process of its own: what
    one run leaves on the device (a compiled model kept alive by the compiler's caches
    holds its weights, moments and EMA, 22.4 GiB for check1b) must not count as the next
    run's peak, as it did when both ran in one process (run 2 read 60.8 GiB for 38.4)."""
    from titanlite.parallel import pick_device

    if run not in RUNS:
        raise ValueError(f"gpu_check: no run named {run!r}")
    torchrun_environment(0, 1, port, LOG_RANK="")
    if dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sizes = DRY_RUN_SIZES if dry_run else GPU_SIZES
    register_flavors(sizes)
    quiet_every_rank_lines()
    device = pick_device()
    with tempfile.TemporaryDirectory(prefix="titanlite-gpu-check-") as dump:
        if run in DOCUMENT_RUNS:
            result = document_run(sizes, run, dump, device)
        else:
            rows = sdpa_rows(sizes, device) if run == MFU_RUN else []
            more, figures = training_rows(sizes, run, dump, device)
            result = {"rows": rows + more, **figures}
    Path(out).write_text(json.dumps({**result, "device": device.type}))


# --------------------------------------------------------------------------- in the parent


def memory_rows(sizes: Sizes, run: str, measured: dict) -> list[dict]:
    """The estimator's figures for ``run``'s config against the measured ones: the allocated
    peak (the tensors) and the caching allocator's reserved peak, with the estimate's
    breakdown so that a miss says which part is off. On a CPU the process's peak RSS, which
    holds much more than tensors, and no reserved figure: not enforced."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_memory
    from titanlite.estimate.tracker import CATEGORIES

    with tempfile.TemporaryDirectory() as dump:
        estimate = estimate_memory(parse_args(trainer_argv(sizes, dump, run)), 1, device_type="cuda")
    parts = ", ".join(f"{name} {estimate.peak[name] / 2**30:.2f}" for name in CATEGORIES)
    enforced = measured["device"] == "cuda"
    rows = []
    for what, key, predicted in (
        ("allocated (max active)", "allocated_gib", estimate.peak_bytes),
        ("reserved", "reserved_gib", estimate.reserved_bytes),
    ):
        found = measured[key] or 0.0
        ratio = found / (predicted / 2**30)
        detail = f" (estimate: {parts})" if key == "allocated_gib" else " (ALLOCATOR_SLACK of the step's own)"
        rows.append(
            {
                "check": f"peak memory {what}, {run}, measured vs the estimate",
                "result": f"{found:.2f} vs {predicted / 2**30:.2f} GiB = {ratio:.2f}"
                + ("" if enforced else " (CPU RSS; no allocator)")
                + detail,
                "target": f"within {MEMORY_TOLERANCE:.0%}",
                "ok": abs(ratio - 1) <= MEMORY_TOLERANCE or not enforced,
            }
        )
    return rows


def document_loss_row(flex: dict, sdpa: dict) -> dict:
    """The two block_causal trainings' losses, step by step: FlexAttention's against the SDPA
    mask's within bf16's tolerance; on CUDA, not the same bits (one kernel would have run both)."""
    pairs = list(zip(flex["losses"], sdpa["losses"], strict=False))
    gap = max((abs(a - b) / abs(b) for a, b in pairs), default=float("nan"))
    on_gpu = flex["device"] == "cuda"
    identical = all(a == b for a, b in pairs)
    last = f"; last step {pairs[-1][0]:.4f} vs {pairs[-1][1]:.4f}" if pairs else ""
    where = "" if on_gpu else " (CPU: both train with the SDPA mask; FlexAttention's backward refuses the CPU)"
    return {
        "check": f"block_causal loss, FlexAttention vs the SDPA mask, {DOCUMENT_STEPS} steps, per-op AC",
        "result": f"largest relative gap {gap:.2e} over {len(pairs)} steps{last}{where}",
        "target": f"every step within {BF16_RTOL} (bf16), not bit-identical on CUDA",
        "ok": len(pairs) == DOCUMENT_STEPS and gap <= BF16_RTOL and not (on_gpu and identical),
    }


def run_in_worker(run: str, dry_run: bool, scratch: str) -> dict:
    """``run`` in a process of its own: its rows and figures, or one failed row saying why."""
    out = f"{scratch}/rows.json"
    args = (free_port(), dry_run, run, out)
    _, failure = in_processes(run, lambda: mp.start_processes(_worker, args=args, nprocs=1, start_method="spawn"))
    return {"rows": [failure], "failed": True} if failure else json.loads(Path(out).read_text())


def in_processes(check: str, work) -> tuple:
    """(``work()``, None), or, where a process it started failed (an error, or killed: out of
    memory, say), (None, a failed row for ``check`` saying why): the child's exception line (the
    message torch.multiprocessing raises ends with the child's traceback and an empty line) or
    how the process ended."""
    try:
        return work(), None
    except ProcessException as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[-1][:200] if lines else type(error).__name__
        return None, {"check": check, "result": f"its process failed: {reason}", "target": "finishes", "ok": False}


FLOAT8_SPEED_CHECK = "float8 tensorwise vs bf16 step time, the trainer's model.converters = ['float8']"
FLOAT8_LOSS_CHECK = "float8 loss against bf16"


def float8_rows(dry_run: bool) -> list[dict]:
    """Float8 against bf16 through the trainer's keys (--model.converters float8, tensorwise):
    benchmarks/gpu_float8.py's two runs, each a process of its own, on FLOAT8_LAYERS blocks of
    Llama 3 8B's shape, seq 8192, compiled, per-op AC (the dry run: the tiny model, emulated).
    Without torchao both rows say so and pass: the rest of the check stands without them."""
    import gpu_float8

    from titanlite.quantize.float8 import INSTALL_HINT

    if importlib.util.find_spec("torchao") is None:
        skipped = {"result": f"skipped: torchao missing ({INSTALL_HINT})", "target": "(needs torchao)", "ok": True}
        return [{"check": FLOAT8_SPEED_CHECK, **skipped}, {"check": FLOAT8_LOSS_CHECK, **skipped}]
    options = argparse.Namespace(layers=FLOAT8_LAYERS, seq_len=8192, steps=FLOAT8_STEPS, warmup=5)
    options = gpu_float8.dry_run_sized(argparse.Namespace(**vars(options), cpu_dry_run=dry_run))
    recipes = ("bf16", "tensorwise")
    runs, failure = in_processes(FLOAT8_SPEED_CHECK, lambda: [gpu_float8.measure(options, r) for r in recipes])
    return [failure] if failure else float8_comparison(options, *runs)


def float8_comparison(options: argparse.Namespace, bf16: dict, float8: dict) -> list[dict]:
    import gpu_float8

    dry_run = options.cpu_dry_run
    speedup = bf16["step_s"] / float8["step_s"]
    shape = f"{options.layers} blocks of 8B, seq {options.seq_len}, compiled"
    shape = f"the tiny model, seq {options.seq_len}, eager, emulated" if dry_run else shape
    memory = "" if dry_run else f"; max active {bf16['max_active_gib']:.1f} and {float8['max_active_gib']:.1f} GiB"
    return [
        {
            "check": f"{FLOAT8_SPEED_CHECK}, {shape}",
            "result": f"{speedup:.2f}x ({bf16['step_s']:.4f} -> {float8['step_s']:.4f} s a step{memory})",
            "target": f">= {FLOAT8_TARGET}x",
            "ok": speedup >= FLOAT8_TARGET or dry_run,
        },
        {
            "check": f"{FLOAT8_LOSS_CHECK} after {options.steps} steps (mean of the last {gpu_float8.LOSS_STEPS})",
            "result": f"{float8['loss']:.4f} vs {bf16['loss']:.4f} ({100 * (float8['loss'] / bf16['loss'] - 1):+.2f}%)",
            "target": "(reported: a short run's gap is noise, not accuracy)",
            "ok": True,
        },
    ]


def plan_disk(sizes: Sizes) -> None:
    """Print the checkpoint bytes this check writes; refuse to start when they do not fit."""
    planned = checkpoint_bytes(sizes)
    print(
        f"checkpoints: {planned['written'] / 1e9:.3g} GB written in all, at most {planned['at_once'] / 1e9:.3g} GB "
        f"on disk at once (limit {DISK_LIMIT_BYTES / 1e9:.0f} GB)"
    )
    if planned["at_once"] > DISK_LIMIT_BYTES:
        raise SystemExit(f"gpu_check: the checkpoints of {sizes.flavor} would need {planned['at_once'] / 1e9:.2f} GB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same code on the CPU, debug sizes")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available() and not options.cpu_dry_run:
        print("no GPU: skipped")
        return 0
    sizes = DRY_RUN_SIZES if options.cpu_dry_run else GPU_SIZES
    register_flavors(sizes)
    plan_disk(sizes)
    with tempfile.TemporaryDirectory() as scratch:
        results = {run: run_in_worker(run, options.cpu_dry_run, scratch) for run in RUNS}
    rows = [row for result in results.values() for row in result["rows"]]
    rows.append(ema_cost_row(sizes, results[MFU_RUN].get("mfu"), results[NO_EMA_RUN].get("mfu")))
    finished = [run for run in TRAINING_RUNS if not results[run].get("failed")]
    rows += [row for run in finished for row in memory_rows(sizes, run, results[run])]
    if not any(results[run].get("failed") for run in DOCUMENT_RUNS):
        rows.append(document_loss_row(results[FLEX_RUN], results[SDPA_MASK_RUN]))
    rows += float8_rows(options.cpu_dry_run)
    device_name = "CPU (dry run)" if options.cpu_dry_run else torch.cuda.get_device_name(0)
    return print_table(f"titanlite GPU check on {device_name}, torch {torch.__version__}", rows)


def print_table(title: str, rows: list[dict]) -> int:
    """The table, then one last line: how many checks passed and each failed one with its
    result, which says why. Returns the exit status: 1 if any failed."""
    print(title)
    print("| check | result | target | ok |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {row['result']} | {row['target']} | {'yes' if row['ok'] else 'NO'} |")
    failed = [f"{row['check']} ({row['result']})" for row in rows if not row["ok"]]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} checks passed" + (f"; failed: {'; '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
