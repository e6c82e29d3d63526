from titanlite.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titanlite.models.qwen3.hf_config import MODEL_TYPE, MODEL_TYPES, args_to_hf_config, hf_config_to_args
from titanlite.models.qwen3.model import Qwen3Transformer
from titanlite.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = [
    "MODEL_TYPE",
    "MODEL_TYPES",
    "QWEN3_FLAVORS",
    "Qwen3Args",
    "Qwen3StateDictAdapter",
    "Qwen3Transformer",
    "args_to_hf_config",
    "hf_config_to_args",
]
