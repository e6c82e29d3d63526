from titanlite.models.llama.args import LLAMA2_FLAVORS, LLAMA3_FLAVORS, LlamaArgs, RopeScaling
from titanlite.models.llama.model import Transformer
from titanlite.models.llama.state_dict_adapter import LlamaStateDictAdapter

__all__ = ["LLAMA2_FLAVORS", "LLAMA3_FLAVORS", "LlamaArgs", "LlamaStateDictAdapter", "RopeScaling", "Transformer"]
