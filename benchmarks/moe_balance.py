"""Expert load over training under each way of load balancing: max / mean tokens per expert
of qwen3 debugmodel_moe (or deepseek_v3 debugmodel with --model deepseek_v3), trained by the
trainer in one process (on a GPU where there is one).

    python benchmarks/moe_balance.py                        # every setting, 200 steps of 8 x 128 tokens (hours)
    python benchmarks/moe_balance.py --model deepseek_v3 --settings none,flavor
    python benchmarks/moe_balance.py --quick                # tiny_moe, 4 steps of 4 settings (seconds)
    python benchmarks/moe_balance.py --settings none,lb,bias_sigmoid --steps 1000
    python benchmarks/moe_balance.py --settings aux --aux-coefs 0.001,0.01
    python benchmarks/moe_balance.py --model deepseek_v3 --settings none,flavor --lr 5e-4

Each setting trains the same model from the same seed on the same batches (the built-in
python_stdlib data, train_configs/debug_model.toml's optimizer and schedule, float32), with
every balancing key of [model] off unless the setting turns it on:
  none                  no balancing;
  aux@C                 transformers' pooled auxiliary loss (model.moe_aux_loss_coef) at each
                        C of --aux-coefs;
  lb@C                  the per-layer load-balancing loss (model.moe_load_balance_coef) at each
                        C of --lb-coefs;
  seq@C                 DeepSeek-V3's sequence-wise loss (model.moe_seq_balance_coef) at each C
                        of --seq-coefs;
  z@C                   the router z-loss (model.moe_z_loss_coef) at each C of --z-coefs;
  bias_softmax          the expert bias at --bias-rate (stepped by --bias-rule) on the softmax
                        router (Qwen3-MoE's);
  bias_sigmoid          the expert bias at --bias-rate on a sigmoid router (DeepSeek-V3's);
  bias_sigmoid_seq      the same plus the sequence-wise loss at --bias-seq-coef (DeepSeek-V3's
                        recipe);
  flavor                the flavor's own router and balancing, nothing overridden (for
                        deepseek_v3: sigmoid, the bias stepped in proportion to the load's
                        distance from even at 0.05 and the sequence-wise loss at 1e-3; for
                        qwen3: the per-layer loss at 0.1).
The settings other than flavor keep the model's default router: softmax for qwen3, sigmoid for
deepseek_v3 (whose "none" is then its sigmoid router with no balancing).
--settings picks settings by name or by family (aux, lb, seq, z: every coefficient of it).
--quick trains none, aux and lb at their first coefficient and bias_sigmoid_seq (unless
--settings says otherwise) and plans every other setting's run without training it.
After every optimizer step the trainer's balancer holds each MoE layer's max / mean of the
step's (token, expert) pairs per expert (1: even; at most n_experts / top_k = 4 for
debugmodel_moe); the benchmark keeps the largest over the layers. Printed per setting: that
load at step 1, its mean over the first and over the last `--window` steps, the first step
from which it stays below --bound (or "never"), the last step's loss and its ratio to the
none setting's, and "balanced": the last window's load under the per-expert correction,
constant over the window, that balances the window's tokens taken together (a bias on each
layer, as the expert bias is, softmax routers included): what a balancing that is exact on
average still shows at each step, the steps' own content deciding the rest. Under it, the
setting's curve (its mean load over each tenth of the steps) and, where the bias is on, the
bias's spread over the experts (the largest of the layers) at the end of each tenth. --lr
sets every setting's learning rate (default: the config's, 2e-3).
The last line is

    max/mean expert load, mean of the last W steps: none A, aux@0.001 B, ...

--goals trains, for each family, none and flavor (the shipped settings) and prints a Markdown
table of them (with "balanced") and the goals (the last window's load at or below 1.20 for deepseek_v3, 1.30
for qwen3; never above 2.0 after the first window; the loss, a mean over the last window,
within 1% of none's); its exit status is 1 when a goal is missed.
"""

import argparse
import collections
import itertools
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titanlite.config import parse_args  # noqa: E402
from titanlite.config.model import MOE_BALANCING_KEYS  # noqa: E402
from titanlite.models.moe import count_tokens, moe_layers, route_logits  # noqa: E402
from titanlite.plan import plan_run  # noqa: E402
from titanlite.train import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# Every balancing key off: what each setting but flavor starts from.
NO_BALANCING = {f"model.{key}": 0 for key in (*MOE_BALANCING_KEYS, "moe_z_loss_coef")}
# Per --model: (the benchmark's flavor, --quick's flavor, the router the settings start from).
MODELS = {
    "qwen3": ("debugmodel_moe", "tiny_moe", "softmax"),
    "deepseek_v3": ("debugmodel", "tiny", "sigmoid"),
}
LOSS_FAMILIES = {
    "aux": "model.moe_aux_loss_coef",
    "lb": "model.moe_load_balance_coef",
    "seq": "model.moe_seq_balance_coef",
    "z": "model.moe_z_loss_coef",
}


def settings(args: argparse.Namespace) -> dict[str, dict]:
    """{name: the [model] overrides of the setting}, every setting the benchmark knows."""
    start = NO_BALANCING | {"model.moe_score_func": MODELS[args.model][2]}
    table = {"none": {}}
    for family, key in LOSS_FAMILIES.items():
        for coef in getattr(args, f"{family}_coefs"):
            table[f"{family}@{coef:g}"] = {key: coef}
    bias = {"model.moe_bias_update_rate": args.bias_rate, "model.moe_bias_update_rule": args.bias_rule}
    table["bias_softmax"] = bias
    table["bias_sigmoid"] = bias | {"model.moe_score_func": "sigmoid"}
    table["bias_sigmoid_seq"] = table["bias_sigmoid"] | {"model.moe_seq_balance_coef": args.bias_seq_coef}
    return {name: start | overrides for name, overrides in table.items()} | {"flavor": {}}


def chosen_settings(table: dict[str, dict], names: str) -> dict[str, dict]:
    """The settings ``names`` (comma-separated) picks, by name or family, in the table's order;
    exits with one line naming an unknown one."""
    wanted = [name.strip() for name in names.split(",") if name.strip()]

    def picks(name: str, setting: str) -> bool:
        return setting == name or setting.split("@")[0] == name

    unknown = [name for name in wanted if not any(picks(name, setting) for setting in table)]
    if unknown:
        known = ", ".join(table)
        sys.exit(f"moe_balance: unknown setting {unknown[0]!r}; known: {known} and the families aux, lb, seq, z")
    return {setting: overrides for setting, overrides in table.items() if any(picks(name, setting) for name in wanted)}


def run_options(
    overrides: dict, model: str, flavor: str, steps: int, seq_len: int, batch: int, lr: float | None, seed: int
) -> list[str]:
    """The trainer's command line for one setting (lr None: the config's learning rate)."""
    options = {
        **({"optimizer.lr": lr} if lr is not None else {}),
        "debug.seed": seed,
        "model.name": model,
        "model.flavor": flavor,
        "training.steps": steps,
        "training.seq_len": seq_len,
        "training.local_batch_size": batch,
        "lr_scheduler.warmup_steps": max(1, steps // 20),
        "parallelism.data_parallel_shard_degree": 1,
        # Every step's loss is read: the loss column is a mean over the last steps, since one
        # step's loss on one batch scatters by about 2% between settings.
        "metrics.log_freq": 1,
        "metrics.enable_jsonl": False,
        **overrides,
    }
    config_file = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]
    return config_file + [f"--{key}={value}" for key, value in options.items()]


def bias_spread(model: torch.nn.Module) -> float:
    """The largest spread (max - min over the experts) of any MoE layer's expert bias: how far
    the bias has pushed the experts apart. The update moves each expert by its rate a step,
    so the spread grows by at most twice the rate a step."""
    biases = [module.expert_bias for module in model.modules() if getattr(module, "expert_bias", None) is not None]
    return max((float(bias.max() - bias.min()) for bias in biases), default=0.0)


class WindowLogits:
    """Each MoE layer's router logits of the last ``window`` optimizer steps of a run, kept for
    window_balanced_load. A forward hook on each router gate adds a training forward's logits to the
    step's; ``end_step`` (an optimizer step post-hook) closes the step."""

    def __init__(self, model: torch.nn.Module, window: int):
        self.layers = moe_layers(model)
        self.steps = [collections.deque(maxlen=window) for _ in self.layers]
        self.current = [[] for _ in self.layers]
        for index, layer in enumerate(self.layers):
            layer.gate.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def keep(module, inputs, logits):
            if module.training:
                self.current[index].append(logits.detach().float().clone())

        return keep

    def end_step(self, *_) -> None:
        for steps, current in zip(self.steps, self.current, strict=True):
            steps.append(torch.cat(current))
            current.clear()


def step_load(logits: torch.Tensor, args, bias: torch.Tensor) -> torch.Tensor:
    """One step's (token, expert) pairs per expert, routed with ``bias``, float32."""
    return count_tokens(route_logits(logits, torch.float32, args, bias).experts, args.n_experts).float()


def window_balanced_load(kept: WindowLogits, iterations: int = 300) -> float:
    """The load of the window's steps under a per-expert correction that is constant over the
    window and balances its tokens taken together: for each layer, the bias (added to the
    scores for choosing, as the expert bias is; softmax routers included) found by
    proportional steps on the window's summed counts. Returned: the mean over the window of
    each step's largest layer load under those biases."""
    per_layer = []
    for layer, steps in zip(kept.layers, kept.steps, strict=True):
        bias = torch.zeros(layer.args.n_experts)
        for _ in range(iterations):
            total = sum(step_load(logits, layer.args, bias) for logits in steps)
            bias += 0.02 * (total.mean() - total) / total.mean()
        loads = [step_load(logits, layer.args, bias) for logits in steps]
        per_layer.append([float(load.max() / load.mean()) for load in loads])
    return statistics.fmean(max(layer_loads) for layer_loads in zip(*per_layer, strict=True))


def train_setting(options: list[str], window: int) -> tuple[list[float], list[float], list[float], float]:
    """(largest max / mean over the layers at each step, the bias spread after each step,
    the loss of each step, the last ``window`` steps' window_balanced_load)."""
    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(parse_args(options + ["--job.dump_folder", dump]))
        loads, spreads = [], []
        kept = WindowLogits(trainer.model, window)

        def record(*_):
            loads.append(trainer.balancer.step_load.max())
            spreads.append(bias_spread(trainer.model))
            kept.end_step()

        # Runs after the balancer's own hook (registered first): the step's loads are kept.
        trainer.optimizer.register_step_post_hook(record)
        records = trainer.train()
    return torch.stack(loads).tolist(), spreads, [record.loss for record in records], window_balanced_load(kept)


def first_step_staying_below(loads: list[float], bound: float) -> str:
    for step in range(len(loads), 0, -1):
        if loads[step - 1] >= bound:
            return str(step + 1) if step < len(loads) else "never"
    return "1"


def _tenth_ends(length: int) -> list[int]:
    """Where each tenth of a run of ``length`` steps ends (fewer parts for fewer steps)."""
    parts = min(10, length)
    return [round(length * part / parts) for part in range(parts + 1)]


def tenths(loads: list[float]) -> list[float]:
    """The mean load over each tenth of the run: whether a setting is still moving at its end."""
    return [statistics.fmean(loads[start:end]) for start, end in itertools.pairwise(_tenth_ends(len(loads)))]


def at_tenths(values: list[float]) -> list[float]:
    """The values at the end of each tenth of the run."""
    return [values[end - 1] for end in _tenth_ends(len(values))[1:]]


def coefficients(text: str) -> list[float]:
    return [float(value) for value in text.split(",") if value.strip()]


def parse_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--window", type=int, default=20, help="steps averaged at the start and at the end")
    parser.add_argument("--bound", type=float, default=1.3, help="the load the 'below from' column tracks")
    parser.add_argument("--aux-coefs", type=coefficients, default=[0.001, 0.01], help="the aux settings' weights")
    parser.add_argument("--lb-coefs", type=coefficients, default=[0.001, 0.01], help="the lb settings' weights")
    parser.add_argument("--seq-coefs", type=coefficients, default=[0.001, 0.01], help="the seq settings' weights")
    parser.add_argument("--z-coefs", type=coefficients, default=[0.001, 0.01], help="the z settings' weights")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="the bias settings' rate")
    parser.add_argument(
        "--bias-rule", choices=("sign", "proportional"), default="sign", help="the bias settings' update rule"
    )
    parser.add_argument("--seed", type=int, default=0, help="debug.seed: the weights' initialisation")
    parser.add_argument("--bias-seq-coef", type=float, default=1e-4, help="bias_sigmoid_seq's sequence-wise weight")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3", help="the model family trained")
    parser.add_argument("--settings", default="all", help="names or families, comma-separated (default: all)")
    parser.add_argument("--lr", type=float, default=None, help="every setting's learning rate (default: the config's)")
    parser.add_argument("--quick", action="store_true", help="tiny_moe, 4 steps of 2 x 16 tokens")
    parser.add_argument(
        "--goals", action="store_true", help="both families' shipped settings against none, as a table with the goals"
    )
    return parser.parse_args()


# The goals for the shipped settings (each flavor's own balancing, nothing overridden):
# the mean max / mean load of the last window of steps, per family.
GOALS = {"deepseek_v3": 1.20, "qwen3": 1.30}
# Neither may pass this load after the first window of steps (no early collapse), nor end with
# a loss (mean of the last window) more than LOSS_GOAL times that of no balancing.
EARLY_BOUND, LOSS_GOAL = 2.0, 1.01


@dataclass
class Outcome:
    """One setting's run, summarised."""

    first_load: float
    start: float  # mean load over the first window
    end: float  # mean load over the last window
    worst_after_start: float  # the largest load after the first window
    below_from: str  # the step from which the load stays below --bound, or "never"
    loss: float  # mean loss over the last window
    balanced: float  # the last window's window_balanced_load
    curve: list[float]
    spreads: list[float]


def run_setting(options: list[str], window: int, bound: float) -> Outcome:
    loads, spreads, losses, balanced = train_setting(options, window)
    return Outcome(
        first_load=loads[0],
        start=statistics.fmean(loads[:window]),
        end=statistics.fmean(loads[-window:]),
        worst_after_start=max(loads[window:], default=loads[-1]),
        below_from=first_step_staying_below(loads, bound),
        loss=statistics.fmean(losses[-window:]),
        balanced=balanced,
        curve=tenths(loads),
        spreads=spreads,
    )


def print_setting(name: str, outcome: Outcome, none: Outcome | None) -> None:
    ratio = f"{outcome.loss / none.loss:7.4f}" if none is not None else f"{'-':>7}"
    print(
        f"{name:17} {outcome.first_load:7.2f} {outcome.start:9.2f} {outcome.end:8.2f} "
        f"{outcome.worst_after_start:9.2f} {outcome.below_from:>11} {outcome.loss:7.4f} {ratio} "
        f"{outcome.balanced:8.2f}",
        flush=True,
    )
    print(f"  curve, mean load per tenth of the steps: {' '.join(f'{value:.2f}' for value in outcome.curve)}")
    if max(outcome.spreads) > 0:  # the bias is on: how far it has moved, at the end of each tenth
        spread_curve = " ".join(f"{value:.3f}" for value in at_tenths(outcome.spreads))
        print(f"  bias spread (max - min) at the end of each tenth: {spread_curve}")


def goals_table(args: argparse.Namespace) -> int:
    """Both families' shipped settings against no balancing, as a Markdown table with the
    goals; exit status 1 when one is missed."""
    window = min(args.window, args.steps)
    rows, missed = [], 0
    for model, (flavor, _, _) in MODELS.items():
        args.model = model
        table = settings(args)
        shape = (model, flavor, args.steps, args.seq_len, args.batch, args.lr, args.seed)
        none, shipped = (run_setting(run_options(table[key], *shape), window, args.bound) for key in ("none", "flavor"))
        met = (
            shipped.end <= GOALS[model]
            and shipped.worst_after_start <= EARLY_BOUND
            and shipped.loss <= LOSS_GOAL * none.loss
        )
        missed += not met
        for name, outcome in (("none", none), ("shipped", shipped)):
            goal = f"<= {GOALS[model]:.2f}, <= {EARLY_BOUND:.1f} after step {window}" if name == "shipped" else ""
            verdict = ("met" if met else "MISSED") if name == "shipped" else ""
            rows.append(
                f"| {model} {flavor} | {name} | {outcome.first_load:.2f} | {outcome.start:.2f} | {outcome.end:.2f} | "
                f"{outcome.worst_after_start:.2f} | {outcome.balanced:.2f} | {outcome.loss:.4f} | "
                f"{outcome.loss / none.loss:.4f} | {goal} | "
                f"{verdict} | {' '.join(f'{value:.2f}' for value in outcome.curve)} |"
            )
    print(f"{args.steps} steps of {args.batch} x {args.seq_len} tokens; load: max / mean, the largest over the layers")
    print(
        f"| model | setting | step 1 | first {window} | last {window} | max after step {window} | "
        f"balanced over the last {window} | loss (last {window}) | / none | goal | | curve (mean load per tenth) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if missed else 0


def main() -> int:
    args = parse_options()
    if args.goals:
        return goals_table(args)
    flavor, quick_flavor, _ = MODELS[args.model]
    table = settings(args)
    names = args.settings
    if args.quick:
        flavor, args.steps, args.seq_len, args.batch, args.window = quick_flavor, 4, 16, 2, 2
        if names == "all":
            names = f"none,aux@{args.aux_coefs[0]:g},lb@{args.lb_coefs[0]:g},bias_sigmoid_seq"
    window = min(args.window, args.steps)
    chosen = table if names == "all" else chosen_settings(table, names)
    shape = (args.model, flavor, args.steps, args.seq_len, args.batch, args.lr, args.seed)
    options = {name: run_options(overrides, *shape) for name, overrides in table.items()}
    for name in table.keys() - chosen.keys():  # a setting left out still plans (its keys fit the model)
        plan_run(parse_args(options[name]), world_size=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the trainer puts a single process
    lr = f"learning rate {args.lr:g}" if args.lr is not None else "the config's learning rate"
    tokens = f"{args.steps} steps of {args.batch} x {args.seq_len} tokens"
    print(f"{args.model} {flavor}, {tokens}, {lr}, one process on {device}")
    first, last, below = f"first {window}", f"last {window}", f"< {args.bound:g} from"
    header = f"{'max after':>9} {below:>11} {'loss':>7} {'/ none':>7} {'balanced':>8}"
    print(f"{'setting':17} {'step 1':>7} {first:>9} {last:>8} {header}")
    outcomes = {}
    for name in chosen:
        outcomes[name] = run_setting(options[name], window, args.bound)
        print_setting(name, outcomes[name], outcomes.get("none"))
    tail = ", ".join(f"{name} {outcome.end:.2f}" for name, outcome in outcomes.items())
    print(f"max/mean expert load, mean of the last {window} steps: {tail}")
    print(f"settings planned without training: {len(table) - len(chosen)} of {len(table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
