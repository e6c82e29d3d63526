"""Did my change move the loss? Train two sides and compare their per-step loss and grad norm.

python scripts/loss_compare.py --steps 20 --common "--training.global_batch_size 16" --a-ranks 2 --b-ranks 1 --rtol 1e-5
python scripts/loss_compare.py --steps 20 --b "--optimizer.lr 3e-3" --assert-equal
python scripts/loss_compare.py --steps 20 --a-commit HEAD --b-commit HEAD~1

A side is the config (--config) with the shared overrides (--common) and its own (--a, --b),
launched on --a-ranks/--b-ranks processes with torchrun, from this checkout or from a git
commit (--a-commit/--b-commit, checked out in a temporary worktree that is removed
afterwards). Both sides train deterministically, with the same seed, from the same seed
checkpoint. Exit status: 0 (equal within the tolerance, or report only), 1 (a step beyond
the tolerance of --assert-equal or --rtol/--atol), 2 (bad input, or a side that failed).
"""

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

PROG = "loss_compare"
DEFAULT_CONFIG = "train_configs/debug_model.toml"
# The source entries a run must share with an --import file for the comparison to mean
# anything: the config file, and the resolved keys that say which model learns from which
# tokens in which order and from which start. Everything else (layout, ranks, learning rate,
# optimizer, commit, torch version, device) may differ: it is what one compares.
MUST_MATCH_SETTINGS = (
    "model.name",
    "model.flavor",
    "model.hf_assets_path",
    "training.dataset",
    "training.dataset_path",
    "training.seq_len",
    "training.global_batch_size",
    "data.shuffle",
    "data.seed",
    "debug.seed",
)


# --pin-kernels: the CPU kernels every rank of both sides runs, on any x86 host with AVX2.
# ATen's vector kernels, MKL's GEMMs (its conditional numerical reproducibility branch) and
# oneDNN's each pick their code by the CPU, and another pick sums in another order: the same
# run differed in the last bit between an AVX-512 Intel host and an AVX-512 AMD one
# (tests/reference_losses/README.md). This is the one place the pin lives; the reference test
# pins its ranks with it too.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


class InputError(Exception):
    """Bad input or a side that failed: one line, exit status 2."""


# --- command line ------------------------------------------------------------------------


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(REPO_ROOT / DEFAULT_CONFIG), help=f"the TOML config of both sides ({DEFAULT_CONFIG})"
    )
    parser.add_argument("--common", default="", help='overrides for both sides, e.g. "--training.steps 20"')
    parser.add_argument("--steps", type=int, help="training.steps of both sides (default: the config's)")
    parser.add_argument("--seed", type=int, default=0, help="debug.seed of both sides and of the seed checkpoint")
    for side in ("a", "b"):
        upper = side.upper()
        parser.add_argument(f"--{side}", default="", help=f"side {upper}'s own overrides, after --common")
        parser.add_argument(f"--{side}-ranks", type=int, default=1, help=f"processes side {upper} runs on (1)")
        parser.add_argument(
            f"--{side}-commit", help=f"run side {upper} from this git commit of the repository (a temporary worktree)"
        )
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank (1): results must not follow the cores"
    )
    parser.add_argument(
        "--pin-kernels",
        action="store_true",
        help="run every rank on AVX2 kernels (ATen, MKL, oneDNN) whatever the x86 CPU: the last bits then follow "
        "the run, not the host (needs a CPU with AVX2)",
    )
    parser.add_argument("--out", help="output folder, new or empty (default: outputs/loss_compare/<time>)")
    parser.add_argument("--no-seed-checkpoint", action="store_true", help="let each side initialise its weights itself")
    parser.add_argument(
        "--seed-checkpoint",
        metavar="STEP_DIR",
        help="start both sides from this step-N folder's weights (a path or a URL: s3://...) instead of writing one",
    )
    parser.add_argument("--assert-equal", action="store_true", help="exit 1 unless bit-exact at every step")
    parser.add_argument("--rtol", type=float, help="relative tolerance: exit 1 beyond it")
    parser.add_argument("--atol", type=float, help="absolute tolerance: exit 1 beyond it")
    parser.add_argument(
        "--loss-only", action="store_true", help="the exit status follows the loss alone (grad norms are still shown)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="plot both curves and their difference (matplotlib)")
    parser.add_argument("--export", metavar="FILE", help="write side A's losses, and what produced them, as JSON")
    parser.add_argument("--import", dest="import_file", metavar="FILE", help="side B is this loss file")
    parser.add_argument("--repo", default=str(REPO_ROOT), help=argparse.SUPPRESS)  # the tests' throwaway clone
    args = parser.parse_args(argv)
    if args.assert_equal and (args.rtol is not None or args.atol is not None):
        parser.error("--assert-equal means bit-exact; give it or --rtol/--atol, not both")
    if args.import_file and (args.b or args.b_commit or args.b_ranks != 1):
        parser.error("--import replaces side B: --b, --b-ranks and --b-commit do not apply")
    for side in ("a", "b"):
        if getattr(args, f"{side}_ranks") < 1:
            parser.error(f"--{side}-ranks must be at least 1")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def split_overrides(text: str, option: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as error:
        raise InputError(f"{option} {text!r}: {error}") from None


# --- git ---------------------------------------------------------------------------------


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def resolve_commit(repo: Path, revision: str, option: str) -> str:
    result = git(repo, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if result.returncode != 0:
        raise InputError(f"{option} {revision}: not a commit of the repository {repo}")
    return result.stdout.strip()


def checkout_description(repo: Path) -> str:
    """The commit this checkout is at, with '+changes' when its files differ from it."""
    head = git(repo, "rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


@contextlib.contextmanager
def commit_worktree(repo: Path, commit: str):
    """A detached worktree of ``commit`` in a temporary folder, removed afterwards. Only
    git's list of worktrees changes meanwhile: the checkout's HEAD, index, files and
    branches stay as they are."""
    folder = Path(tempfile.mkdtemp(prefix=f"{PROG}-{commit[:10]}-"))
    added = git(repo, "worktree", "add", "--detach", str(folder), commit)
    if added.returncode != 0:
        folder.rmdir()
        raise InputError(f"git worktree add {commit[:10]} failed: {last_line(added.stderr)}")
    try:
        yield folder
    finally:
        git(repo, "worktree", "remove", "--force", str(folder))
        git(repo, "worktree", "prune")


# --- the sides ---------------------------------------------------------------------------


class Side:
    """One side: its overrides, launch size and commit (None: this checkout)."""

    def __init__(self, name: str, overrides: list[str], ranks: int, commit: str | None):
        self.name, self.overrides, self.ranks, self.commit = name, overrides, ranks, commit

    def config_path(self, config: str, repo: Path, tree: Path) -> str:
        """The config this side reads: for a commit, that commit's own copy of a config
        inside the repository; otherwise the file as given."""
        path = Path(config).resolve()
        if self.commit is not None and path.is_relative_to(repo.resolve()):
            return str(tree / path.relative_to(repo.resolve()))
        return str(path)


def trainer_arguments(args, config: str, overrides: list[str]) -> list[str]:
    """The trainer's command line before the settings the comparison needs: the config, the
    shared seed and steps, then the user's overrides (which win over the config)."""
    head = ["--job.config_file", config, "--debug.seed", str(args.seed)]
    if args.steps is not None:
        head += ["--training.steps", str(args.steps)]
    return head + split_overrides(args.common, "--common") + overrides


def comparison_settings(out: Path, side: str, seed_checkpoint: Path | str | None) -> list[str]:
    """What every side gets last, so that no override can undo it: every step logged,
    deterministic kernels, its own dump folder and a TensorBoard folder beside the other
    side's (tensorboard --logdir OUT/tb overlays them), and the seed checkpoint."""
    settings = [
        "--metrics.log_freq=1",
        "--metrics.enable_jsonl=true",
        "--metrics.enable_tensorboard=true",
        "--debug.deterministic=true",
        f"--job.dump_folder={out / side}",
        f"--metrics.save_tb_folder=../tb/{side}",
    ]
    if seed_checkpoint is not None:
        settings += [f"--checkpoint.initial_load_path={seed_checkpoint}", "--checkpoint.initial_load_model_only=true"]
    return settings


def resolved_settings(args, side: Side) -> tuple[dict, int]:
    """(MUST_MATCH_SETTINGS, training.steps) as this checkout's parser resolves the side's
    command line; the global batch as the run on the side's ranks derives it."""
    from titanlite.config import ConfigError, parse_args
    from titanlite.plan import plan_run

    try:
        job_config = parse_args(trainer_arguments(args, args.config, side.overrides))
        plan = plan_run(job_config, side.ranks)
    except ConfigError as error:
        raise InputError(f"side {side.name.upper()}: config error: {error}") from None
    settings = {}
    for key in MUST_MATCH_SETTINGS:
        section, name = key.split(".")
        settings[key] = getattr(getattr(job_config, section), name)
    settings["training.global_batch_size"] = plan.global_batch_size
    return settings, job_config.training.steps


def config_name(config: str, repo: Path) -> str:
    """How a loss file names the config: inside the repository by its path there (the same
    on every machine), elsewhere by its absolute path."""
    path = Path(config).resolve()
    return str(path.relative_to(repo.resolve())) if path.is_relative_to(repo.resolve()) else str(path)


def device_name(pinned: bool = False) -> str:
    """The device, and on a CPU the vector instructions torch's kernels use ("cpu (AVX512)",
    "cpu (AVX2, pinned)" under --pin-kernels): with other kernels the same run sums in another
    order (tests/reference_losses/README.md)."""
    import torch

    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name()})"
    if pinned:
        return f"cpu ({PINNED_KERNELS['ATEN_CPU_CAPABILITY'].upper()}, pinned)"
    return f"cpu ({torch.backends.cpu.get_cpu_capability()})"


def cpu_vendor() -> str:
    """The CPU's vendor (GenuineIntel, AuthenticAMD), as the kernel reports it: MKL promises its
    pinned branch's bits on Intel CPUs only, so a loss file says which vendor wrote it."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def trainer_error_line(log_text: str) -> str:
    """The line that says why a side failed: the trainer's own one-line error when it wrote
    one, else the last line of a traceback, else the last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("titanlite: ") and "error" in line]
    if own:
        return own[-1]
    raised = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return raised[-1] if raised else last_line(log_text)


def launch(side: Side, tree: Path, argv: list[str], out: Path, threads: int, pin_kernels: bool):
    """Run the trainer for ``side`` as users do (torchrun, the trainer module of ``tree``);
    the series its metrics.jsonl holds."""
    from titanlite.metrics.compare import series_from_jsonl

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(side.ranks),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        "-m",
        "titanlite.train",
        *argv,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    # Intra-op threads split a matmul's or a reduction's work by the thread count, and the
    # order partial sums are added in follows that split: the same run on a machine with
    # more cores would give other last bits. A fixed count per rank makes the numbers a
    # property of the run, not of the machine (and keeps N ranks from oversubscribing it).
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    # On CUDA, debug.deterministic (torch.use_deterministic_algorithms) refuses cuBLAS
    # matmuls unless cuBLAS is given a fixed workspace; PyTorch documents this value.
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if pin_kernels:
        env.update(PINNED_KERNELS)
    log_path = out / side.name / "train.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    where = f"commit {side.commit[:10]}" if side.commit else "this checkout"
    print(f"{PROG}: side {side.name.upper()}: {side.ranks} rank(s), {where}; log {log_path}", flush=True)
    with open(log_path, "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        status = subprocess.run(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        error = trainer_error_line(log_path.read_text())
        raise InputError(f"side {side.name.upper()} failed (exit {status}): {error} (log: {log_path})")
    jsonl = sorted((out / side.name / "metrics").glob("*/metrics.jsonl"))
    if len(jsonl) != 1:
        raise InputError(
            f"side {side.name.upper()}: expected one metrics.jsonl under {out / side.name}, found {len(jsonl)}"
        )
    try:
        return series_from_jsonl(jsonl[0])
    except ValueError as error:
        raise InputError(f"side {side.name.upper()}: {error}") from None


def run_side(side: Side, args, out: Path, seed_checkpoint: Path | str | None, settings: dict):
    """Train ``side`` and return its LossSeries, its source filled in (``settings``: the
    side's resolved_settings)."""
    import torch

    repo = Path(args.repo)
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(commit_worktree(repo, side.commit)) if side.commit else REPO_ROOT
        config = side.config_path(args.config, repo, tree)
        argv = trainer_arguments(args, config, side.overrides) + comparison_settings(out, side.name, seed_checkpoint)
        series = launch(side, tree, argv, out, args.threads, args.pin_kernels)
    series.source = {
        "config": config_name(args.config, repo),
        "overrides": split_overrides(args.common, "--common") + side.overrides,
        "settings": settings,
        "ranks": side.ranks,
        "threads": args.threads,
        "seed_checkpoint": seed_checkpoint is not None,
        "commit": side.commit or checkout_description(repo),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device_name(args.pin_kernels),
        "cpu_vendor": cpu_vendor(),
        "pinned_kernels": PINNED_KERNELS if args.pin_kernels else None,
    }
    return series


# --- the seed checkpoint -----------------------------------------------------------------


def write_seed_checkpoint(args, folder: Path) -> Path:
    """The weights both sides start from: the config's model (with --common), built and
    initialised at debug.seed by the trainer's own build_model in this single process,
    saved model-only with its description as folder/step-0. A side whose own overrides
    change the model cannot load it: run with --no-seed-checkpoint then."""
    import torch

    from titanlite.checkpoint.description import MODEL_ARGS, ModelDescription
    from titanlite.checkpoint.files import write_model_checkpoint
    from titanlite.config import ConfigError, parse_args
    from titanlite.plan import build_model, plan_run

    # One process, and nothing that changes the parameters' names or stops the plan: the
    # weights alone matter here (a side's own batch need not fit one process).
    single = [
        "--training.global_batch_size=-1",
        "--parallelism.data_parallel_replicate_degree=1",
        "--parallelism.data_parallel_shard_degree=1",
        "--parallelism.tensor_parallel_degree=1",
        "--compile.enable=false",
        "--activation_checkpoint.mode=none",
    ]
    try:
        job_config = parse_args(trainer_arguments(args, args.config, []) + single)
        plan = plan_run(job_config, 1)
    except ConfigError as error:
        raise InputError(f"the seed checkpoint's config (--config, --common): {error}") from None
    torch.manual_seed(job_config.debug.seed)
    model = build_model(job_config, plan, plan.parallel_dims.build_mesh("cpu"), "cpu")
    description = ModelDescription.of_run(job_config.model, plan.model_args, plan.tokenizer_vocab_size)
    state = {**model.state_dict(), MODEL_ARGS: description.to_state()}
    step = write_model_checkpoint(state, folder)
    print(f"{PROG}: seed checkpoint {step} ({job_config.model.name} {job_config.model.flavor}, seed {args.seed})")
    return step


# --- importing, plotting -----------------------------------------------------------------


def read_reference(path: str, config: str, settings: dict, steps: int):
    """The --import file, after checking, before anything trains, that it comes from the
    same config and MUST_MATCH_SETTINGS as side A and holds its steps 1..``steps``."""
    from titanlite.metrics.compare import LossSeries, read_series

    try:
        reference = read_series(path)
    except ValueError as error:
        raise InputError(str(error)) from None
    recorded = reference.source
    if recorded.get("config") != config:
        raise InputError(f"{path}: from config {recorded.get('config')!r}, this run uses {config!r}")
    for key, value in settings.items():
        theirs = recorded.get("settings", {}).get(key, "(not recorded)")
        if theirs != value:
            raise InputError(f"{path}: from a run with {key} = {theirs!r}, this run has {value!r}")
    planned = LossSeries(list(range(1, steps + 1)), [], [])
    if reference.steps != planned.steps:
        raise InputError(
            f"the runs cover different steps: A has {planned.describe_steps()}, B {reference.describe_steps()}"
        )
    return reference


def check_plot_available(path: str | None) -> None:
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install -e '.[plot]'") from None


def plot(comparison, path: str, labels: tuple[str, str]) -> None:
    """Both loss curves above, B - A below."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot
    from matplotlib.ticker import MaxNLocator

    rows = comparison.loss.rows
    steps = [r.step for r in rows]
    figure, (curves, difference) = pyplot.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    curves.plot(steps, [r.a for r in rows], label=labels[0])
    curves.plot(steps, [r.b for r in rows], label=labels[1], linestyle="--")
    curves.set_ylabel("loss")
    curves.legend()
    difference.plot(steps, [r.diff for r in rows], color="tab:red")
    difference.axhline(0, color="gray", linewidth=0.5)
    difference.set_ylabel("loss B - A")
    difference.set_xlabel("step")
    difference.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, not 2.5
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


# --- main --------------------------------------------------------------------------------


def output_folder(requested: str | None) -> Path:
    out = Path(requested or Path("outputs", PROG, datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def side_label(side: Side) -> str:
    parts = [f"{side.ranks} rank(s)"]
    if side.commit:
        parts.append(side.commit[:10])
    if side.overrides:
        parts.append(shlex.join(side.overrides))
    return f"{side.name.upper()}: " + ", ".join(parts)


def compare_sides(args) -> int:
    from titanlite.metrics.compare import compare, format_table, write_series

    repo = Path(args.repo)
    if not Path(args.config).is_file():
        raise InputError(f"--config {args.config}: no such file")
    check_plot_available(args.plot)
    sides = []
    for name in ("a", "b") if not args.import_file else ("a",):
        commit_option = getattr(args, f"{name}_commit")
        commit = resolve_commit(repo, commit_option, f"--{name}-commit") if commit_option else None
        overrides = split_overrides(getattr(args, name), f"--{name}")
        sides.append(Side(name, overrides, getattr(args, f"{name}_ranks"), commit))
    plans = {side.name: resolved_settings(args, side) for side in sides}
    if args.import_file:
        reference = read_reference(args.import_file, config_name(args.config, repo), *plans["a"])
    out = output_folder(args.out)
    if args.seed_checkpoint and args.no_seed_checkpoint:
        raise InputError("--seed-checkpoint and --no-seed-checkpoint exclude each other")
    seed = args.seed_checkpoint
    if seed is None and not args.no_seed_checkpoint:
        seed = write_seed_checkpoint(args, out / "seed")
    run_a = run_side(sides[0], args, out, seed, plans["a"][0])
    if args.export:
        write_series(run_a, args.export)
        print(f"{PROG}: wrote side A's losses to {args.export}")
    if args.import_file:
        run_b, labels = reference, (side_label(sides[0]), f"B: {args.import_file}")
    else:
        run_b = run_side(sides[1], args, out, seed, plans["b"][0])
        labels = (side_label(sides[0]), side_label(sides[1]))
    tolerance_given = args.assert_equal or args.rtol is not None or args.atol is not None
    try:
        comparison = compare(run_a, run_b, rtol=args.rtol or 0.0, atol=args.atol or 0.0)
    except ValueError as error:
        raise InputError(str(error)) from None
    print("\n".join(labels))
    print(format_table(comparison))
    if args.plot:
        plot(comparison, args.plot, labels)
        print(f"{PROG}: plot written to {args.plot}")
    if not args.import_file:
        print(f"{PROG}: tensorboard --logdir {out / 'tb'}")
    equal = comparison.loss.equal if args.loss_only else comparison.equal
    if args.loss_only and tolerance_given:
        print(f"{PROG}: the loss alone decides (--loss-only): {'equal' if equal else 'different'}")
    return 1 if tolerance_given and not equal else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    try:
        return compare_sides(args)
    except InputError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
