from titanlite.models.llama.args import LLAMA2_FLAVORS, LLAMA3_FLAVORS, LLAMA31_ROPE_SCALING, LlamaArgs, RopeScaling
from titanlite.models.llama.hf_config import args_to_hf_config, hf_config_to_args, hf_model_name
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.state_dict_adapter import LlamaStateDictAdapter

__all__ = [
    "LLAMA2_FLAVORS",
    "LLAMA3_FLAVORS",
    "LLAMA31_ROPE_SCALING",
    "LlamaArgs",
    "LlamaStateDictAdapter",
    "RopeScaling",
    "Transformer",
    "args_to_hf_config",
    "hf_config_to_args",
    "hf_model_name",
]
