"""Reading Hugging Face Llama folders, and what the checkpoint tools share.

Import reads a Hugging Face folder (one ``model.safetensors`` or a sharded index) and
writes a DCP checkpoint ``step-0`` holding the weights under titanlite's names and a
``model_args`` description; it runs in one process without a process group and writes
into a temporary sibling folder that is renamed into place only when everything is
written. (Export, the other direction, is in hf_export.py.)

All renaming and the q/k RoPE permutation come from the model's state-dict adapter.
"""

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from titanlite.checkpoint.states import MODEL_ARGS
from titanlite.models.llama.args import LlamaArgs, RopeScaling
from titanlite.registry import get_model_spec

EMA_PREFIX = "ema."
# Buffers some Hugging Face checkpoints carry; they are recomputed, never trained.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _single_process(call, *args, **kwargs):
    """Run a dcp.save/dcp.load call without DCP's warning that no process group exists:
    one process working alone is what these tools do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return call(*args, **kwargs)


# --- helpers ---------------------------------------------------------------------------


def _check_output(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir}: the output folder already exists and is not empty")


def _temporary_sibling(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    return temporary


def _publish(temporary: Path, out_dir: Path) -> None:
    _check_output(out_dir)  # it may have appeared meanwhile
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(temporary, out_dir)


def _write_atomically(out_dir: Path, write) -> None:
    """Run write(folder) on a temporary sibling folder and rename it to out_dir at the end;
    on any failure the temporary folder is removed and out_dir is left untouched."""
    out_dir = Path(out_dir)
    _check_output(out_dir)
    temporary = _temporary_sibling(out_dir)
    try:
        write(temporary)
        _publish(temporary, out_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _checkpoint_metadata(step_dir: Path):
    if not step_dir.is_dir():
        raise ValueError(f"{step_dir}: no such checkpoint folder")
    if not (step_dir / ".metadata").is_file():
        raise ValueError(f"{step_dir}: not a checkpoint folder (no .metadata)")
    try:
        return FileSystemReader(str(step_dir)).read_metadata()
    except Exception as error:  # corrupt or unreadable metadata
        raise ValueError(f"{step_dir}: cannot read the checkpoint metadata ({type(error).__name__})") from None


def _nest(flat_keys: list[str], prefix: str) -> dict:
    """A nested dict of placeholders shaped like the flattened keys under `prefix`."""
    root: dict = {}
    for key in flat_keys:
        parts = key[len(prefix) + 1:].split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = None
    return root


# --- reading a checkpoint --------------------------------------------------------------


def read_model_description(step_dir: str | Path) -> dict:
    """{"name", "flavor", "args", "tokenizer_path"} as saved under model_args; "args" is a
    LlamaArgs, "tokenizer_path" the run's tokenizer.json (None for the byte tokenizer or
    a checkpoint that predates the field)."""
    step_dir = Path(step_dir)
    metadata = _checkpoint_metadata(step_dir)
    keys = [k for k in metadata.state_dict_metadata if k.startswith(MODEL_ARGS + ".")]
    if not keys:
        raise ValueError(f"{step_dir}: the checkpoint has no model_args (it does not say which model it holds)")
    state = {MODEL_ARGS: _nest(keys, MODEL_ARGS)}
    _single_process(dcp.load, state, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    description = state[MODEL_ARGS]
    args = dict(description["args"])
    if isinstance(args.get("rope_scaling"), dict):
        args["rope_scaling"] = RopeScaling(**args["rope_scaling"])
    try:
        model_args = LlamaArgs(**args)
    except TypeError as error:
        raise ValueError(f"{step_dir}: model_args do not describe a Llama model ({error})") from None
    return {"name": description["name"], "flavor": description["flavor"], "args": model_args,
            "tokenizer_path": description.get("tokenizer_path")}


def _titanlite_names(args: LlamaArgs) -> list[str]:
    per_layer = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm"]
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    names += [f"layers.{i}.{part}.weight" for i in range(args.n_layers) for part in per_layer]
    return names


# --- import ----------------------------------------------------------------------------


def _ffn_sizing(dim: int, intermediate: int) -> tuple[int, float | None]:
    """multiple_of and ffn_dim_multiplier such that LlamaArgs.ffn_hidden_dim == intermediate."""
    def hidden_of(multiple_of, multiplier):
        return LlamaArgs(dim=dim, n_heads=1, multiple_of=multiple_of, ffn_dim_multiplier=multiplier).ffn_hidden_dim

    for multiple_of in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if intermediate % multiple_of == 0 and hidden_of(multiple_of, None) == intermediate:
            return multiple_of, None
    base = int(2 * (4 * dim) / 3)
    for multiplier in (intermediate / base, (intermediate + 0.5) / base):
        if hidden_of(intermediate, multiplier) == intermediate:
            return intermediate, multiplier
    raise ValueError(f"intermediate_size {intermediate} cannot be expressed for hidden_size {dim}")


def hf_config_to_args(config: dict, where: str = "config.json") -> LlamaArgs:
    def need(key):
        if key not in config:
            raise ValueError(f"{where}: no '{key}'")
        return config[key]

    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type '{config.get('model_type')}' is not llama")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{where}: biases in attention or MLP are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act '{config['hidden_act']}' is not supported (only silu)")
    dim, n_heads = need("hidden_size"), need("num_attention_heads")
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"{where}: head_dim {config['head_dim']} differs from hidden_size / num_attention_heads")
    # Newer transformers keep rope_theta and the scaling under rope_parameters.
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type not in ("default", None):
        raise ValueError(f"{where}: rope type '{rope_type}' is not supported (only llama3 scaling)")
    multiple_of, multiplier = _ffn_sizing(dim, need("intermediate_size"))
    kv_heads = config.get("num_key_value_heads") or n_heads
    return LlamaArgs(
        dim=dim, n_layers=need("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=None if kv_heads == n_heads else kv_heads, vocab_size=need("vocab_size"),
        multiple_of=multiple_of, ffn_dim_multiplier=multiplier, norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling,
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
    )


def _hf_weight_files(hf_dir: Path) -> list[Path]:
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            raise ValueError(f"{index}: not a safetensors index (no weight_map)") from None
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (hf_dir / f).is_file()]
        if absent:
            raise ValueError(f"{hf_dir}: the index names {absent[0]}, which is missing")
        return [hf_dir / f for f in files]
    if single.is_file():
        return [single]
    raise ValueError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def import_from_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Write out_dir/step-0, a DCP checkpoint of a Hugging Face Llama folder. Returns step-0."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir}: no such folder")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{hf_dir}: not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError:
        raise ValueError(f"{config_path}: not valid JSON") from None
    _check_output(out_dir)
    args = hf_config_to_args(config, str(config_path))
    files = _hf_weight_files(hf_dir)
    name = "llama2" if args.vocab_size == 32000 and args.rope_theta == 10000.0 else "llama3"
    adapter = get_model_spec(name).state_dict_adapter(args)

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for hf_name in handle.keys():
                if hf_name.endswith(_IGNORED_HF_SUFFIXES):
                    continue
                try:
                    ours = adapter.from_hf_name(hf_name)
                except KeyError:
                    raise ValueError(f"{file}: tensor '{hf_name}' has no titanlite counterpart") from None
                weights[ours] = adapter.from_hf_tensor(hf_name, handle.get_tensor(hf_name))
    if "output.weight" not in weights and config.get("tie_word_embeddings") and "tok_embeddings.weight" in weights:
        # titanlite keeps the output projection separate: tied embeddings become two copies.
        weights["output.weight"] = weights["tok_embeddings.weight"].clone()
    missing = sorted(set(_titanlite_names(args)) - weights.keys())
    if missing:
        raise ValueError(f"{hf_dir}: the weights lack {len(missing)} tensor(s), e.g. {adapter.to_hf_name(missing[0])}")
    state = {**weights, MODEL_ARGS: {"name": name, "flavor": "hf", "args": dataclasses.asdict(args)}}

    def write(folder: Path) -> None:
        _single_process(dcp.save, state, storage_writer=FileSystemWriter(str(folder / "step-0"), sync_files=True), no_dist=True)

    _write_atomically(out_dir, write)
    return out_dir / "step-0"
