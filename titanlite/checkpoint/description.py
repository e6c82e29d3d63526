"""What model a checkpoint holds: the description recorded under "model_args".

Every checkpoint the trainer writes, and every one imported from Hugging Face, records
the model's registry name, its flavor, every hyper-parameter, (trainer runs) the
tokenizer.json it trained with, and the tokenizer's size: the rows of a padded vocabulary
that are tokens. On disk it is a plain nested dict, so that any DCP reader can list it;
in memory it is a ModelDescription whose args are the registry's args dataclass. This
module is the one place that reads and writes it.
"""

import dataclasses
import typing
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint.files import CheckpointError, read_checkpoint_metadata, reader_for, single_process
from titanlite.data import tokenizer_file
from titanlite.registry import get_model_spec
from titanlite.storage import location

MODEL_ARGS = "model_args"


# Hyper-parameters a checkpoint's weights carry over across: RoPE scaling changes no weight,
# and a long-context phase resumes a short-context checkpoint with a scaling of its own.
CARRIES_OVER = {"rope_scaling"}


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    name: str  # the registry name
    flavor: str  # "hf" for a model read from a Hugging Face folder
    args: typing.Any  # the registry's args dataclass for `name`
    tokenizer_path: str | None = None  # the run's tokenizer.json; None: the byte tokenizer, or not recorded
    # The ids the tokenizer has: the embedding's and the output's rows past them are padding
    # (args.vocab_size is rounded up). None: every row is a token (a byte-tokenizer run, whose
    # model keeps its flavor's rows, or a checkpoint older than this entry).
    tokenizer_vocab_size: int | None = None

    @classmethod
    def of_run(cls, model_config, model_args, tokenizer_vocab_size: int | None) -> "ModelDescription":
        """What a training run with the [model] section ``model_config`` builds: ``model_args``
        as its plan resolved them, and where its tokenizer.json is (None: the byte tokenizer),
        so that an export can ship the tokenizer beside the weights."""
        return cls(
            model_config.name,
            model_config.flavor,
            model_args,
            tokenizer_path=tokenizer_file(model_config.hf_assets_path),
            tokenizer_vocab_size=tokenizer_vocab_size,
        )

    @property
    def real_vocab_size(self) -> int:
        """The rows that are tokens: what an export keeps and what generation may pick."""
        return self.args.vocab_size if self.tokenizer_vocab_size is None else self.tokenizer_vocab_size

    def to_state(self) -> dict:
        """The description as a checkpoint records it."""
        return {
            "name": self.name,
            "flavor": self.flavor,
            "args": dataclasses.asdict(self.args),
            "tokenizer_path": self.tokenizer_path,
            "tokenizer_vocab_size": self.tokenizer_vocab_size,
        }

    @classmethod
    def from_state(cls, state: dict, where: str, args_cls: type | None = None) -> "ModelDescription":
        """The description a checkpoint recorded; `args_cls` defaults to the registry's for its
        name. ValueError naming `where` when the args are not that dataclass's."""
        args_cls = args_cls or get_model_spec(state["name"]).args_cls
        try:
            # DCP stores no key for an empty dict: a model without hyper-parameters has no "args".
            args = _dataclass_from_dict(args_cls, state.get("args", {}))
        except TypeError as error:
            raise ValueError(f"{where}: model_args do not describe a {state['name']} model ({error})") from None
        return cls(state["name"], state["flavor"], args, state.get("tokenizer_path"), state.get("tokenizer_vocab_size"))

    def differences(self, other: "ModelDescription") -> list[str]:
        """The hyper-parameters, by name, in which `other` describes a model that computes
        something else (the args' own architecture() says which count)."""
        ours, theirs = self.args.architecture(), other.args.architecture()
        names = ours.keys() | theirs.keys()
        return sorted(name for name in names - CARRIES_OVER if ours.get(name) != theirs.get(name))

    def mismatch(self, recorded: dict) -> str | None:
        """What tells the model a checkpoint recorded (its "model_args", as to_state writes
        them) from this one, in words; None when it is the same model."""
        try:
            theirs = ModelDescription.from_state(recorded, "the checkpoint's model_args", type(self.args))
        except ValueError:  # another family's hyper-parameters
            return f"the checkpoint holds model {recorded['name']} {recorded['flavor']}, this run builds {self}"
        names = self.differences(theirs)
        if not names:
            return None
        ours, saved = self.args.architecture(), theirs.args.architecture()
        values = ", ".join(f"{name} {saved.get(name)} -> {ours.get(name)}" for name in names)
        different = f"they differ in {values}, checkpoint -> run"
        return f"the checkpoint holds model {theirs}, this run builds {self} ({different})"

    def __str__(self) -> str:
        return f"{self.name} {self.flavor}"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Weight name -> shape, as the model class lays them out (built on the meta device,
        which allocates nothing)."""
        with torch.device("meta"):
            model = get_model_spec(self.name).model_cls(self.args)
        return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _dataclass_in(hint) -> type | None:
    """The dataclass a field's type names, alone or in a union (`RopeScaling | None`)."""
    for candidate in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _dataclass_from_dict(cls: type, values: dict):
    """`cls(**values)`, with nested dataclass fields rebuilt from their dicts."""
    hints = typing.get_type_hints(cls)
    fields = {}
    for key, value in values.items():
        nested = _dataclass_in(hints.get(key))
        if nested is not None and isinstance(value, dict):
            # None recorded where the run's args hold a dataclass (a short-context checkpoint
            # under a run with RopeScaling) reads back as an empty dict: the load asks only for
            # the entries the checkpoint holds (CheckpointManager._skip_absent_records).
            value = nested(**value) if value else None
        fields[key] = value
    return cls(**fields)


def _nest(flat_keys: list[str], prefix: str) -> dict:
    """A nested dict of placeholders shaped like the flattened keys under `prefix`."""
    root: dict = {}
    for key in flat_keys:
        parts = key[len(prefix) + 1 :].split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = None
    return root


def read_recorded(step_dir: Path) -> dict | None:
    """The "model_args" a step-N folder recorded, as to_state wrote them (only they are read,
    no weight); None when it records none (a checkpoint written by another tool)."""
    metadata = read_checkpoint_metadata(step_dir)
    keys = [k for k in metadata.state_dict_metadata if k.startswith(MODEL_ARGS + ".")]
    if not keys:
        return None
    state = {MODEL_ARGS: _nest(keys, MODEL_ARGS)}
    single_process(dcp.load, state, storage_reader=reader_for(step_dir), no_dist=True)
    return state[MODEL_ARGS]


def read_model_description(step_dir: str | Path) -> ModelDescription:
    """The description a step-N folder recorded; ValueError naming the folder when it has none."""
    step_dir = location(step_dir)
    recorded = read_recorded(step_dir)
    if recorded is None:
        raise ValueError(f"{step_dir}: the checkpoint has no model_args (it does not say which model it holds)")
    return ModelDescription.from_state(recorded, str(step_dir))


def refuse_other_model(step_dir: Path, ours: ModelDescription, run_folder: Path) -> None:
    """CheckpointError when the checkpoint in `step_dir` records another model than `ours`,
    told from its description before any weight is read: DCP would fail on every rank at the
    first tensor of another shape, naming only that tensor. A checkpoint that records no
    description (torchtitan's) is left to the load. `run_folder`: the run's own checkpoint
    folder, which says what to do about it."""
    recorded = read_recorded(step_dir)
    mismatch = None if recorded is None else ours.mismatch(recorded)
    if mismatch is None:
        return
    if step_dir.parent == run_folder:
        remedy = f"to train this model, pick another job.dump_folder or remove the old checkpoints in {run_folder}"
    else:
        remedy = "checkpoint.initial_load_path must name a checkpoint of the model this run builds"
    raise CheckpointError(f"{step_dir}: {mismatch}; {remedy}")
