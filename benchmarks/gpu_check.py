"""The GPU path, checked in one command on one CUDA GPU (about 5 minutes on an H100).

    python benchmarks/gpu_check.py                  # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --cpu-dry-run    # the plumbing only, debug model on CPU

Without a CUDA device (and without --cpu-dry-run) it prints "no GPU: skipped" and exits 0.
Otherwise it prints one table row per check and exits 1 if any check failed:

* SDPA kernel, bf16 and fp32, grouped-query attention (32 query heads, 8 key/value heads,
  seq 8192): the model's attention runs with the math backend disabled, so a layout that
  would need the math kernel (which builds the whole score matrix) fails; the profiler
  names the CUDA kernel that ran.
* Training of a Llama-3-shaped 1 B model ("check1b": dim 2048, 16 blocks, 32 heads, 8
  key/value heads, vocabulary 128256), bf16 compute with float32 weights, selective
  activation checkpointing, seq 8192, batch 1, once compiled and once eager:
  - MFU, the trainer's own figure (model FLOPs only, attention counted causally, against
    the GPU's dense bf16 peak; see docs/metrics.md), median of the logged windows after
    warm-up. Target >= 45% compiled.
  - Host syncs in quiet steps: `torch.cuda.set_sync_debug_mode("warn")` is on during the
    steps that are not log steps, save points or SYNC_EVERY steps, and every synchronizing
    CUDA call there is counted. Target 0.
  - Async checkpoint: the compiled run saves step 7 (not a log step) with
    `async_with_pinned_mem`; the state is copied to the host right before that save (the
    synchronous reference), training goes on, and the checkpoint on disk is compared with
    the copy bit for bit, every tensor of the model, optimizer, EMA and schedule.
  - Peak memory: the largest `max_active` of the steady steps against
    `titanlite.estimate.estimate_memory` for the same config (fake tensors, in this
    process). Target within 10%.

--cpu-dry-run runs the same code on the CPU with the debug model (seq 128, no compile),
with the CUDA-only checks reported as "n/a"; its numbers mean nothing.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rank_process import free_port, quiet_every_rank_lines, torchrun_environment  # noqa: E402

from titanlite.models.llama import LLAMA3_FLAVORS, LlamaArgs  # noqa: E402

FLAVOR = "check1b"
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
MFU_TARGET, MEMORY_TOLERANCE = 45.0, 0.10
SAVE_STEP = 7
MFU, MAX_ACTIVE, TPS = "mfu(%)", "memory/max_active(GiB)", "throughput(tps)"


def register_flavor() -> None:
    LLAMA3_FLAVORS.setdefault(FLAVOR, MODEL_ARGS)


def trainer_argv(dump: str, compiled: bool, dry_run: bool) -> list[str]:
    steps, log_freq = (20, 5) if compiled else (12, 4)
    argv = [
        "--model.flavor",
        "debugmodel" if dry_run else FLAVOR,
        "--job.dump_folder",
        dump,
        "--training.seq_len",
        "128" if dry_run else "8192",
        "--training.local_batch_size",
        "1",
        "--training.steps",
        str(steps),
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        "selective",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        str(log_freq),
    ]
    if compiled and not dry_run:
        argv += ["--compile.enable", "--compile.components", "model,loss"]
    if compiled:
        argv += [
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(SAVE_STEP),
            "--checkpoint.async_mode",
            "async_with_pinned_mem",
            "--ema.enable",
        ]
    if dry_run:
        argv += ["--metrics.peak_tflops", "1"]
    return argv


# --------------------------------------------------------------------------- in the worker


def sdpa_rows(device: torch.device) -> list[dict]:
    """Run one GQA attention layer at seq 8192 in bf16 and fp32 with the math backend off."""
    if device.type != "cuda":
        return [
            {"check": f"SDPA kernel, {name}", "result": "n/a (CPU)", "target": "flash or efficient", "ok": True}
            for name in ("bf16", "fp32")
        ]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from titanlite.models.llama import Transformer

    args = LlamaArgs(dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=256, max_seq_len=8192)
    rows = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = Transformer(args).to(device=device)
        model.init_weights(seed=0, buffer_device=device)
        model.to(dtype)
        model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
        tokens = torch.randint(0, 256, (1, 8192), device=device)
        row = {"check": f"SDPA kernel, {name}", "target": "flash or efficient, never math"}
        try:
            with (
                sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
                torch.no_grad(),
                profile(activities=[ProfilerActivity.CUDA]) as prof,
            ):
                model(tokens)
                torch.cuda.synchronize()
            kernels = {event.name for event in prof.events() if event.device_type.name == "CUDA"}
            attention = sorted(
                k
                for k in kernels
                if any(mark in k.lower() for mark in ("flash", "fmha", "efficient", "cudnn", "attention"))
            )
            row.update(result=(attention[0][:60] if attention else "no attention kernel named"), ok=bool(attention))
        except RuntimeError as error:  # no fused kernel takes this layout
            row.update(result=f"needs math: {str(error).splitlines()[0][:80]}", ok=False)
        rows.append(row)
        del model
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


def _host_copy(value):
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.detach().to("cpu", copy=True)
    return value


def training_rows(argv: list[str], compiled: bool, device: torch.device) -> tuple[list[dict], dict]:
    from titanlite.config import parse_args
    from titanlite.nonfinite import SYNC_EVERY
    from titanlite.train import Trainer

    job_config = parse_args(argv)
    trainer = Trainer(job_config)
    log_freq, last = job_config.metrics.log_freq, job_config.training.steps
    syncs: list[str] = []
    reference: dict = {}

    def quiet(step: int) -> bool:
        return not (
            step == 1
            or step % log_freq == 0
            or step == last
            or step % SYNC_EVERY == 0
            or trainer.checkpointer.should_save(step, last)
        )

    one_step = trainer._one_step

    def counted_step(freq):
        step = trainer.step + 1
        if device.type != "cuda" or not quiet(step) or step <= 3:  # the first steps compile and allocate
            return one_step(freq)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return one_step(freq)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))

    save = trainer.checkpointer.save

    def save_with_reference(step, **kwargs):
        if step == SAVE_STEP and not reference:
            if device.type == "cuda":
                torch.cuda.synchronize()  # the reference itself must not race the optimizer
            states = trainer.checkpointer._collect(list(trainer.checkpointer.states))
            reference.update({key: _host_copy(value) for key, value in _flatten(states).items()})
        return save(step, **kwargs)

    trainer._one_step = counted_step
    if compiled:
        trainer.checkpointer.save = save_with_reference
    trainer.train()
    records = _read_metrics(Path(job_config.job.dump_folder))
    steady = [r for r in records if r["step"] > (10 if compiled else 4)]
    mode = "compiled" if compiled else "eager"
    mfu = statistics.median(r[MFU] for r in steady) if steady and all(MFU in r for r in steady) else None
    rows = [
        {
            "check": f"MFU, 1B seq 8192, {mode}",
            "result": "n/a" if mfu is None else f"{mfu:.1f}%",
            "target": f">= {MFU_TARGET:.0f}%" if compiled else "(reference)",
            "ok": mfu is not None and (mfu >= MFU_TARGET or not compiled or device.type != "cuda"),
        }
    ]
    rows.append(
        {
            "check": f"host syncs in quiet steps, {mode}",
            "result": "n/a (CPU)"
            if device.type != "cuda"
            else f"{len(syncs)}" + (f" ({syncs[0][:50]})" if syncs else ""),
            "target": "0",
            "ok": not syncs,
        }
    )
    measured = max((r[MAX_ACTIVE] for r in steady if MAX_ACTIVE in r), default=None)
    if compiled:
        rows.append(_compare_checkpoint(Path(job_config.job.dump_folder) / job_config.checkpoint.folder, reference))
    return rows, {"max_active_gib": measured}


def _compare_checkpoint(folder: Path, reference: dict) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    row = {
        "check": f"async_with_pinned_mem save of step {SAVE_STEP} vs its synchronous copy",
        "target": "bit-identical",
    }
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(folder / f"step-{SAVE_STEP}"), f"{scratch}/state.pt")
        saved = _flatten(torch.load(f"{scratch}/state.pt", weights_only=True))
    tensors = [key for key, value in reference.items() if isinstance(value, torch.Tensor)]
    differing = [key for key in tensors if key not in saved or not torch.equal(saved[key].cpu(), reference[key])]
    row.update(
        result=f"{len(tensors) - len(differing)} of {len(tensors)} tensors equal"
        + (f" (first differing: {differing[0]})" if differing else ""),
        ok=bool(tensors) and not differing,
    )
    return row


def _read_metrics(dump: Path) -> list[dict]:
    files = sorted(dump.glob("metrics/*/metrics.jsonl"))
    lines = files[-1].read_text().splitlines() if files else []
    return [record for record in map(json.loads, lines) if TPS in record]


def _worker(_, port: int, dry_run: bool, out: str) -> None:
    torchrun_environment(0, 1, port, LOG_RANK="")
    if dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    register_flavor()
    quiet_every_rank_lines()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rows, extra = sdpa_rows(device), {}
    for compiled in (True, False):
        with tempfile.TemporaryDirectory(prefix="titanlite-gpu-check-") as dump:
            more, figures = training_rows(trainer_argv(dump, compiled, dry_run), compiled, device)
            rows += more
            extra.setdefault("max_active_gib", figures["max_active_gib"])
    Path(out).write_text(json.dumps({"rows": rows, **extra}))


# --------------------------------------------------------------------------- in the parent


def memory_row(dry_run: bool, measured_gib: float | None) -> dict:
    """The estimator's peak for the compiled run's config against the measured one."""
    from titanlite.config import parse_args
    from titanlite.estimate import estimate_memory

    register_flavor()
    with tempfile.TemporaryDirectory() as dump:
        estimate = estimate_memory(parse_args(trainer_argv(dump, True, dry_run)), 1, device_type="cuda")
    predicted = estimate.peak_bytes / 2**30
    row = {"check": "peak memory, measured vs scripts/estimate.py", "target": f"within {MEMORY_TOLERANCE:.0%}"}
    if measured_gib is None:
        return {**row, "result": f"estimate {predicted:.2f} GiB; nothing measured", "ok": dry_run}
    ratio = measured_gib / predicted
    return {
        **row,
        "result": f"{measured_gib:.2f} vs {predicted:.2f} GiB = {ratio:.2f}",
        "ok": dry_run or abs(ratio - 1) <= MEMORY_TOLERANCE,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="the plumbing only, on the CPU")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available() and not options.cpu_dry_run:
        print("no GPU: skipped")
        return 0
    device_name = "CPU (dry run)" if options.cpu_dry_run else torch.cuda.get_device_name(0)
    register_flavor()
    with tempfile.TemporaryDirectory() as scratch:
        out = f"{scratch}/rows.json"
        mp.start_processes(
            _worker, args=(free_port(), options.cpu_dry_run, out), nprocs=1, start_method="spawn", join=True
        )
        result = json.loads(Path(out).read_text())
    rows = result["rows"] + [memory_row(options.cpu_dry_run, result.get("max_active_gib"))]
    print(f"titanlite GPU check on {device_name}, torch {torch.__version__}")
    print("| check | result | target | ok |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {row['result']} | {row['target']} | {'yes' if row['ok'] else 'NO'} |")
    failed = [row["check"] for row in rows if not row["ok"]]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
