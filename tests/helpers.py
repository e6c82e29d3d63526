"""What many tests share: the tiny model's run arguments, rendezvous ports, the whole weights of a
sharded model, small Hugging Face folders and a trained tiny run.

Plain functions rather than fixtures: rank processes (spawned by tests.rank_jobs, or
started by the fault harness with `python -c`) call them where no fixture reaches, and the
argument lists of many modules are built from them at import time. tests/conftest.py turns
the expensive ones into shared fixtures.
"""

import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch.distributed import TCPStore
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanlite.config import parse_args
from titanlite.models.llama import LLAMA3_FLAVORS
from titanlite.train import Trainer

TINY = LLAMA3_FLAVORS["tiny"]

# What nearly every run of the tiny model has in common: short sequences, small batches,
# float32 (so that layouts can be compared closely), no activation checkpointing, a log line
# a step. tiny_args overrides it per test.
TINY_RUN = {
    "model.flavor": "tiny",
    "training.seq_len": 32,
    "training.local_batch_size": 2,
    "training.mixed_precision_param": "float32",
    "activation_checkpoint.mode": "none",
    "metrics.log_freq": 1,
}


@dataclasses.dataclass(frozen=True)
class NoArgs:
    """The hyper-parameters of a test's plain model (a Linear): none to record."""

    def architecture(self) -> dict:
        return {}


class StepCounter(Stateful):
    """A test's stand-in for the trainer's train_state: the step alone."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]


class LogLines(logging.Handler):
    """The messages of the records a logger passes on (those its level lets through), with
    their level names."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.levels: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.levels.append(record.levelname)

    def warnings(self) -> list[str]:
        return [line for line, level in zip(self.lines, self.levels, strict=True) if level == "WARNING"]


def capture_log_lines(name: str = "titanlite") -> LogLines:
    """Collect what the logger ``name`` logs from now on in this process."""
    handler = LogLines()
    logging.getLogger(name).addHandler(handler)
    return handler


def tiny_args(overrides: dict[str, object] | None = None) -> list[str]:
    """Command-line arguments for a run of the tiny model: TINY_RUN with `overrides` (dotted
    keys, as on the command line) replacing or adding options. True is a bare flag; None
    drops one of TINY_RUN's options, leaving it at the config's default."""
    options = {**TINY_RUN, **(overrides or {})}
    args = []
    for key, value in options.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not None:
            args.append(f"--{key}={value}")
    return args


# Ranks started by the tests find each other through a TCPStore that the test process hosts,
# as torchrun's agent hosts one for its workers. The store listens on a port the kernel picks
# (port 0) from before the ranks start until the test session ends, so nothing else can take
# that port in between: a port merely found free, and bound by rank 0 minutes later, can be
# (EADDRINUSE under load). With TORCHELASTIC_USE_AGENT_STORE=True, torch's env:// rendezvous
# makes every rank, rank 0 included, a client of the store at MASTER_ADDR:MASTER_PORT
# (torch/distributed/rendezvous.py, _create_c10d_store), so titanlite's own
# init_process_group needs nothing else.
AGENT_STORE = {"MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
_hosted_stores: list[TCPStore] = []  # alive while the session is: their ports stay taken


def rendezvous_ports(count: int) -> list[int]:
    """The ports of `count` new process-group stores hosted by this process, one per
    init_process_group to come (a new default group on a used store would read the last
    one's keys). The ranks need AGENT_STORE in their environment (run_on_ranks sets it)."""
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(count)]
    _hosted_stores.extend(stores)
    return [store.port for store in stores]


def rendezvous_env() -> dict[str, str]:
    """What a set of rank processes needs to join one process group: AGENT_STORE and the
    port of a store hosted here."""
    return {**AGENT_STORE, "MASTER_PORT": str(rendezvous_ports(1)[0])}


# The names older tests use: the ports they give their ranks are hosted stores now.
free_ports = rendezvous_ports


def free_port() -> int:
    return rendezvous_ports(1)[0]


def load_script(script: Path):
    """A file of scripts/ as a module, so that a test can call its main(argv) in this process
    instead of starting Python (seconds, most of it importing torch)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor, gathered from every rank when it is a DTensor."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_weights(module) -> dict[str, torch.Tensor]:
    """Every entry of module.state_dict() (a model, an EMA), whole and copied, so that it
    can be compared with another run's after this one has gone on training."""
    return {name: full_tensor(value) for name, value in module.state_dict().items()}


# --- Hugging Face folders ----------------------------------------------------------------


def save_hf_llama(folder: Path, seed: int, **overrides) -> Path:
    """A random transformers Llama of the tiny shape, in 20 KB safetensors shards."""
    fields = dict(
        hidden_size=TINY.dim,
        num_hidden_layers=TINY.n_layers,
        num_attention_heads=TINY.n_heads,
        num_key_value_heads=TINY.kv_heads,
        intermediate_size=TINY.ffn_hidden_dim,
        vocab_size=TINY.vocab_size,
        rope_theta=TINY.rope_theta,
        rms_norm_eps=TINY.norm_eps,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    import transformers  # an optional, test-only dependency: tests that need it skip without it

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides}))
    with torch.no_grad():  # the norms start at exactly 1; make them count too
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder


def save_one_layer_hf_llama(folder: Path) -> Path:
    """The smallest transformers Llama worth converting (one block, 40 ids), unseeded: for
    tests that need any Hugging Face checkpoint, not particular values."""
    import transformers  # an optional, test-only dependency, as above

    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=96, vocab_size=40
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def assert_hf_to_dcp_to_hf_is_exact(folder: Path, work: Path) -> None:
    """convert_hf_to_dcp.py then convert_dcp_to_hf.py (in ``work``) give back every tensor of
    the Hugging Face ``folder``, bit for bit and under the same names."""
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    assert load_script(scripts / "convert_hf_to_dcp.py").main([str(folder), str(work / "dcp")]) == 0
    export = load_script(scripts / "convert_dcp_to_hf.py")
    assert export.main([str(work / "dcp" / "step-0"), str(work / "back")]) == 0
    before, after = hf_tensors(folder), hf_tensors(work / "back")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def write_word_tokenizer(folder: Path, n_words: int, specials: tuple[str, ...] = ()) -> int:
    """A word-level tokenizer.json with n_words words plus `specials`; returns its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer  # imported here, as transformers above
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"word{i}": i for i in range(n_words)}
    vocab["[UNK]"] = n_words
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


# --- a trained tiny model ----------------------------------------------------------------

TINY_RUN_STEPS = 3


class TinyRun(NamedTuple):
    step_dir: Path  # the checkpoint written after the last step
    tokens: torch.Tensor  # a fixed input batch
    logits: torch.Tensor  # the trained model's logits on it
    weights: dict  # the trained weights
    ema: dict | None  # the EMA averages, when EMA was on


def train_tiny(dump: Path, extra: list[str] = ()) -> TinyRun:
    """The tiny model trained for a few steps in this process, with checkpoints: the common
    starting point of the export, loading and generation tests."""
    args = tiny_args({"training.steps": TINY_RUN_STEPS, "optimizer.lr": 3e-3, "checkpoint.enable": True})
    trainer = Trainer(parse_args(args + list(extra) + ["--job.dump_folder", str(dump)]))
    trainer.train()
    model = trainer.model.eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens)
    ema = None if trainer.ema is None else full_weights(trainer.ema)
    return TinyRun(dump / "checkpoint" / f"step-{TINY_RUN_STEPS}", tokens, logits, full_weights(model), ema)
