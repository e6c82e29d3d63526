from titanlite.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, YarnScaling
from titanlite.models.deepseek_v3.hf_config import MODEL_TYPE, MODEL_TYPES, args_to_hf_config, hf_config_to_args
from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer
from titanlite.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "MODEL_TYPE",
    "MODEL_TYPES",
    "DeepSeekV3Args",
    "DeepSeekV3StateDictAdapter",
    "DeepSeekV3Transformer",
    "YarnScaling",
    "args_to_hf_config",
    "hf_config_to_args",
]
