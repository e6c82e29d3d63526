"""Model registry: name -> model class, flavors, parallelize function, state-dict adapter.

The trainer looks a model up here and holds no model-specific line itself. The
registry lives beside the rooms, not in models/, because it joins a model to its
parallelize function and models must not import parallel code.
"""

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from titanlite.config import ConfigError
from titanlite.models.llama import LLAMA2_FLAVORS, LLAMA3_FLAVORS, LlamaStateDictAdapter, Transformer
from titanlite.parallel import parallelize_decoder


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict
    parallelize_fn: Callable
    state_dict_adapter: type


MODELS = {
    "llama2": ModelSpec("llama2", Transformer, LLAMA2_FLAVORS, parallelize_decoder, LlamaStateDictAdapter),
    "llama3": ModelSpec("llama3", Transformer, LLAMA3_FLAVORS, parallelize_decoder, LlamaStateDictAdapter),
}


def _unknown(kind: str, value: str, choices) -> ConfigError:
    close = difflib.get_close_matches(value, list(choices), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"{kind} '{value}' is not known (choose from {', '.join(choices)}){hint}")


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise _unknown("model.name", name, MODELS)
    return MODELS[name]


def get_model_args(name: str, flavor: str):
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise _unknown(f"model.flavor of {name}", flavor, spec.flavors)
    return spec.flavors[flavor]
