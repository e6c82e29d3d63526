"""Load a trained model for evaluation: one call, one process, no process group.

    model, description = load_model("outputs/checkpoint/step-1000")
    model, description = load_model("outputs/checkpoint/step-1000", use_ema=True)
    model, description = load_model("my-hf-llama")  # config.json + safetensors

A DCP ``step-N`` folder (full or model-only) is recognised by its ``.metadata`` file; a
Hugging Face folder by its ``config.json``. The model is built on the meta device, moved
to ``device`` with ``to_empty``, filled from the checkpoint (never randomly initialised),
given its RoPE tables and put in eval mode.

A Hugging Face folder is read tensor by tensor straight into the model, by the same
reader (``hf.HFWeights``) that convert_hf_to_dcp.py and seeding a training run use.
"""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from titanlite.checkpoint import hf
from titanlite.checkpoint.description import ModelDescription, read_model_description
from titanlite.checkpoint.files import reader_for, single_process
from titanlite.registry import get_model_spec
from titanlite.storage import location


def _build(description: ModelDescription, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model_cls = get_model_spec(description.name).model_cls
    with torch.device("meta"):
        model = model_cls(description.args)
    model.to_empty(device=device)
    model.to(dtype)
    return model


def _finish(model: nn.Module, description: ModelDescription, device: torch.device) -> nn.Module:
    """Fill the non-persistent buffers (never saved: derived from the args) and switch to eval."""
    model.init_buffers(device)
    return model.eval()


def _load_dcp(
    step_dir: Path, device: torch.device, dtype: torch.dtype, use_ema: bool
) -> tuple[nn.Module, ModelDescription]:
    description = read_model_description(step_dir)
    metadata = reader_for(step_dir).read_metadata()
    model = _build(description, device, dtype)
    prefix = hf.EMA_PREFIX if use_ema else ""
    weights = model.state_dict()  # views of the parameters: dcp.load fills them in place
    state = {prefix + name: tensor for name, tensor in weights.items()}
    missing = sorted(key for key in state if key not in metadata.state_dict_metadata)
    if use_ema and len(missing) == len(state):
        raise ValueError(f"{step_dir}: use_ema asks for EMA weights but the checkpoint has no 'ema.' entries")
    if missing:
        raise ValueError(f"{step_dir}: the checkpoint lacks {len(missing)} model weight(s), e.g. {missing[0]}")
    single_process(dcp.load, state, storage_reader=reader_for(step_dir), no_dist=True)
    for name, tensor in weights.items():
        if tensor.data_ptr() != state[prefix + name].data_ptr():  # loaded into a new tensor, not in place
            tensor.copy_(state[prefix + name])
    return _finish(model, description, device), description


def _load_hf(hf_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, ModelDescription]:
    description, weights = hf.open_hf_folder(hf_dir)
    model = _build(description, device, dtype)
    for name, tensor in model.state_dict().items():
        weights.copy_into(name, tensor)
    return _finish(model, description, device), description


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    use_ema: bool = False,
) -> tuple[nn.Module, ModelDescription]:
    """(model in eval mode, its ModelDescription) from a step-N folder or a Hugging Face
    folder. Raises ValueError, one line naming the path, when PATH is not one."""
    path, device = location(path), torch.device(device)
    if not path.exists():
        raise ValueError(f"{path}: no such checkpoint folder")
    if not path.is_dir():
        raise ValueError(f"{path}: not a checkpoint folder (a file, expected a step-N or Hugging Face folder)")
    if (path / ".metadata").exists():
        with torch.no_grad():
            return _load_dcp(path, device, dtype, use_ema)
    if (path / "config.json").is_file():
        if use_ema:
            raise ValueError(f"{path}: use_ema asks for EMA weights but a Hugging Face folder has none")
        with torch.no_grad():
            return _load_hf(path, device, dtype)
    raise ValueError(f"{path}: not a checkpoint (no .metadata) nor a Hugging Face folder (no config.json)")
