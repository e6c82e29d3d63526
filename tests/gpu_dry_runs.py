"""What tests/test_gpu_check.py runs under coverage, in one process: the CPU dry runs of the
GPU scripts (benchmarks/gpu_check.py, gpu_mfu.py, gpu_memory.py, gpu_float8.py,
checkpoint_stall.py), their "no GPU" exits, and each refusal they make, with its message
checked. Run with no CUDA device visible (CUDA_VISIBLE_DEVICES=""). Any failed expectation
raises, so the exit status says whether everything held, and the last line printed says why
(which part failed, and the error's last line); coverage then says what ran."""

import contextlib
import functools
import io
import multiprocessing
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

import torch.multiprocessing as mp

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import checkpoint_stall  # noqa: E402
import gpu_check  # noqa: E402
import gpu_float8  # noqa: E402
import gpu_memory  # noqa: E402
import gpu_mfu  # noqa: E402

SCRIPT_MODULES = ["titanlite.train", "gpu_check", "gpu_mfu", "gpu_memory", "gpu_float8", "checkpoint_stall"]


def start_from_the_fork_server(start_processes):
    """The scripts start each rank with `spawn` (a CUDA process cannot fork): here the rank forks
    from multiprocessing's fork server instead, which imported torch, titanlite and the scripts
    once, where each spawned rank imported them again (about 2.5 s of CPU each, 11 ranks). A
    forked rank is as fresh as a spawned one: the server's modules were imported in a process of
    their own, so a rank sees nothing this process changed (a registered flavor, say); it
    unpickles its arguments and imports this module as __mp_main__ as a spawned one does, and
    coverage starts in it the same way (its hook rides in the start's preparation data)."""

    @functools.wraps(start_processes)
    def forked(*args, **kwargs):
        assert kwargs.get("start_method") == "spawn", kwargs
        return start_processes(*args, **{**kwargs, "start_method": "forkserver"})

    return forked


def printed(main, argv: list[str]) -> list[str]:
    """The non-empty lines a script's main prints; it must return 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    sys.stdout.write(out.getvalue())
    assert status in (0, None), f"{main.__module__} {argv} returned {status}:\n" + "\n".join(lines)
    return lines


def refused(call, words: str) -> None:
    """`call` must stop with SystemExit, saying `words` (argparse prints its own message)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            call()
    except SystemExit as stop:
        said = f"{stop.code} {err.getvalue()}"
        assert words in said, said
        return
    raise AssertionError(f"expected a refusal saying {words!r}")


def raised(call, error: type, words: str) -> None:
    try:
        call()
    except error as caught:
        assert words in str(caught), caught
        return
    raise AssertionError(f"expected {error.__name__} saying {words!r}")


def printed_table(rows: list[dict]) -> tuple[int, list[str]]:
    """gpu_check's exit status for ``rows``, and the lines of its table."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = gpu_check.print_table("title", rows)
    return status, out.getvalue().splitlines()


def passed_row(lines: list[str], check: str) -> None:
    """The table in ``lines`` has a row starting with ``check`` that passed."""
    assert any(line.startswith(f"| {check}") and line.endswith("| yes |") for line in lines), (check, lines)


def last_line_says_why(part: str, error: BaseException) -> str:
    """The line a failed dry run ends with: the part that failed and the error's last line
    (an assertion's message ends with the script's own last line, which names what failed)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"gpu_dry_runs failed in {part}: {type(error).__name__}: {lines[-1][-400:] if lines else '(no message)'}"


def run_parts(parts: dict) -> None:
    """Each of ``parts`` (name -> callable) in order; on a failure the traceback, then one last
    line saying why, and exit status 1."""
    for name, part in parts.items():
        try:
            part()
        except BaseException as error:  # whatever it is, the last line names it
            traceback.print_exc()
            print(last_line_says_why(name, error), file=sys.stderr, flush=True)
            raise SystemExit(1) from None


def check_gpu_check() -> None:
    assert printed(gpu_check.main, []) == ["no GPU: skipped"]
    lines = printed(gpu_check.main, ["--cpu-dry-run"])
    assert lines[-1].endswith("checks passed"), lines
    table = "\n".join(lines)
    for dtype in ("bf16", "fp32"):  # the SDPA rows ran here, on the CPU's fused kernel
        assert f"| SDPA kernel, {dtype} | aten::_scaled_dot_product_flash_attention_for_cpu |" in table, lines
    assert any("vs its stream-ordered clone |" in line and line.endswith("| yes |") for line in lines), lines
    passed_row(lines, "block_causal: FlexAttention forward vs the SDPA mask")
    passed_row(lines, "block_causal loss, FlexAttention vs the SDPA mask")
    refused(lambda: gpu_check.plan_disk(replace(gpu_check.GPU_SIZES, flavor="8B")), "would need")
    # A run whose process fails is one failed row saying why; the table's last line repeats it.
    with tempfile.TemporaryDirectory() as scratch:
        failed = gpu_check.run_in_worker("no such run", True, scratch)
    assert failed["failed"] and failed["rows"][0]["result"].endswith(
        "ValueError: gpu_check: no run named 'no such run'"
    )
    status, lines = printed_table(failed["rows"])
    assert status == 1 and lines[-1] == f"0 of 1 checks passed; failed: no such run ({failed['rows'][0]['result']})"
    # Without torchao the float8 rows say so, and pass.
    hidden, sys.modules["torchao"] = sys.modules.get("torchao"), None  # None: import raises, as when missing
    try:
        rows = gpu_check.float8_rows(dry_run=True)
    finally:
        sys.modules["torchao"] = hidden
        if hidden is None:
            del sys.modules["torchao"]
    status, lines = printed_table(rows)
    skipped = "| skipped: torchao missing (pip install titanlite[float8]) | (needs torchao) | yes |"
    assert status == 0 and len(lines) == 6 and all(line.endswith(skipped) for line in lines[3:5]), lines
    assert lines[-1] == "2 of 2 checks passed", lines


def check_gpu_mfu() -> None:
    assert printed(gpu_mfu.main, []) == ["no GPU: skipped"]
    lines = printed(gpu_mfu.main, ["--cpu-dry-run"])
    assert lines[-1].startswith("MFU = ") and lines[-2].startswith("MFU counting whole attention"), lines
    refused(lambda: gpu_mfu.parse_options(["--steps", "2", "--warmup", "3"]), "--steps must be larger than --warmup")
    with tempfile.TemporaryDirectory() as empty:
        raised(lambda: gpu_mfu.read_metrics(Path(empty)), RuntimeError, "wrote no metrics.jsonl")
    raised(lambda: gpu_mfu.summarise([], 3), RuntimeError, "no step after the 3 warm-up steps")
    assert gpu_mfu.estimate([], "a CPU")[1] == "the estimator has no hardware row for a CPU"
    assert gpu_mfu.estimate(["--training.steps", "x"], "NVIDIA H100 80GB HBM3")[1].startswith("estimator failed")


def check_gpu_memory() -> None:
    assert printed(gpu_memory.main, []) == ["no GPU: skipped"]
    with tempfile.TemporaryDirectory() as scratch:
        argv = ["--cpu-dry-run", "--modes", "eager", "--snapshots", f"{scratch}/snaps", "--json", f"{scratch}/m.json"]
        lines = printed(gpu_memory.main, argv)
    assert any(line.startswith("| eager | 128 |") for line in lines), lines
    assert any(line.startswith("  estimate: ") for line in lines), lines
    # The allocator trace the CUDA run replays, written out: 100 B freed before a 120 B block
    # makes the peak (baseline 1000 + 50 + 120); a free of a block from before recording began
    # (addr 9) counts too.
    frame = {"filename": "/x/titanlite/models/llama/model.py", "line": 148, "name": "forward"}
    torch_frame = {"filename": "/t/functional.py", "line": 1, "name": "f"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_frame]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 120, "frames": [frame]},
        {"action": "free_requested", "addr": 9, "size": 30},
        {"action": "free_requested", "addr": 3, "size": 120},
    ]
    live = gpu_memory.live_at_peak(trace, baseline=1000)
    assert (live["peak_bytes"], live["peak_site"]) == (1170, "models/llama/model.py:148 forward"), live
    assert [(g["site"], g["bytes"]) for g in live["groups"]] == [("models/llama/model.py:148 forward", 120), ("?", 50)]
    lines = printed(lambda _: gpu_memory.print_live(live, {"parameters": 2**30}), [])
    assert "0.00 GiB before it (parameters 1.00)" in lines[0] and len(lines) == 3, lines


def check_gpu_float8() -> None:
    assert printed(gpu_float8.main, []) == ["no GPU: skipped"]
    lines = printed(gpu_float8.main, ["--cpu-dry-run", "--recipes", "tensorwise"])
    assert lines[-2].startswith("| bf16 | ") and lines[-1].startswith("| tensorwise | "), lines


def check_checkpoint_stall() -> None:
    lines = printed(checkpoint_stall.main, ["--cpu-dry-run"])
    assert lines[-1].startswith("step slowdown async_with_pinned_mem/sync save = "), lines
    refused(lambda: checkpoint_stall.main(["--repeats", "1"]), "--repeats must be at least 2")
    refused(lambda: checkpoint_stall.main(["--world-size", "1"]), "--world-size must be at least 2")


def main() -> None:
    multiprocessing.set_forkserver_preload([*SCRIPT_MODULES, "tests.gc_frozen"])
    mp.start_processes = start_from_the_fork_server(mp.start_processes)
    run_parts(
        {
            "gpu_check": check_gpu_check,
            "gpu_mfu": check_gpu_mfu,
            "gpu_memory": check_gpu_memory,
            "gpu_float8": check_gpu_float8,
            "checkpoint_stall": check_checkpoint_stall,
        }
    )


# The ranks each script spawns import this module again: only the first process runs it.
if __name__ == "__main__":
    main()
