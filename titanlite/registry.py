"""Model registry: name -> model class, args type, flavors, parallelize function, state-dict
adapter and Hugging Face config conversion.

The trainer and the checkpoint tools look a model up here and hold no model-specific line
themselves. The registry lives beside the packages, not in models/, because it joins a
model to its parallelize function and models must not import parallel code.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from titanlite.config import ConfigError
from titanlite.errors import unknown_name
from titanlite.models import deepseek_v3, llama, qwen3
from titanlite.parallel import parallelize_decoder, tensor_parallel_problem


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict
    state_dict_adapter: type
    args_cls: type  # the hyper-parameters' dataclass, which names its model class (model_cls)
    tensor_parallel_problem: Callable  # (args, tp degree) -> why the TP plan cannot split them, or None
    # Every family here is a Llama-shaped decoder whose TP plan, FSDP, AC and compile the shared
    # code applies; a family built otherwise would name its own.
    parallelize_fn: Callable = parallelize_decoder

    @property
    def model_cls(self) -> type[nn.Module]:
        return self.args_cls.model_cls()


def _qwen3_tensor_parallel_problem(args: qwen3.Qwen3Args, tp: int) -> str | None:
    """Llama's TP plan splits Qwen3's attention, and its dense feed-forward; an MoE
    feed-forward's router and experts are held whole on every TP rank (TP splits its tokens),
    so its sizes need not divide."""
    return tensor_parallel_problem(args, tp, split_ffn=not args.is_moe)


def _deepseek_v3_tensor_parallel_problem(args: deepseek_v3.DeepSeekV3Args, tp: int) -> str | None:
    """The TP plan splits every block's attention, and the dense feed-forward of the first
    first_k_dense_replace blocks (so its size must divide when there is one); an MoE block's
    router and experts are held whole on every TP rank, as Qwen3-MoE's."""
    return tensor_parallel_problem(args, tp, split_ffn=args.first_k_dense_replace > 0)


_LLAMA = dict(
    state_dict_adapter=llama.LlamaStateDictAdapter,
    args_cls=llama.LlamaArgs,
    tensor_parallel_problem=tensor_parallel_problem,
)
# Each entry: name, flavors, state-dict adapter, args class, TP check (ModelSpec's field order).
MODELS = {
    "llama2": ModelSpec("llama2", flavors=llama.LLAMA2_FLAVORS, **_LLAMA),
    "llama3": ModelSpec("llama3", flavors=llama.LLAMA3_FLAVORS, **_LLAMA),
    # Llama's decoder with per-head query/key norms.
    "qwen3": ModelSpec(
        "qwen3", qwen3.QWEN3_FLAVORS, qwen3.Qwen3StateDictAdapter, qwen3.Qwen3Args, _qwen3_tensor_parallel_problem
    ),
    # Llama's decoder with latent attention and DeepSeekMoE blocks; its TP plan is data in
    # its folder (the block's tensor_parallel_plan), read by the shared parallelize code.
    "deepseek_v3": ModelSpec(
        "deepseek_v3",
        deepseek_v3.DEEPSEEK_V3_FLAVORS,
        deepseek_v3.DeepSeekV3StateDictAdapter,
        deepseek_v3.DeepSeekV3Args,
        _deepseek_v3_tensor_parallel_problem,
    ),
}


# A vocabulary sized from a tokenizer is rounded up to a multiple of 128 rows (Megatron-LM's
# default too): the output projection's GEMM then tiles evenly on tensor cores, and any
# power-of-two TP degree up to 128 splits the rows evenly. The multiple does not depend on
# a run's TP degree, so that a checkpoint resumes on any layout (its shape is the model's).
VOCAB_MULTIPLE = 128


def padded_vocab_size(token_ids: int) -> int:
    """The embedding rows for a vocabulary of `token_ids` ids: rounded up to VOCAB_MULTIPLE."""
    return -(-token_ids // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ConfigError(unknown_name("model.name", name, MODELS))
    return MODELS[name]


def get_model_args(name: str, flavor: str):
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise ConfigError(unknown_name(f"model.flavor of {name}", flavor, spec.flavors))
    return spec.flavors[flavor]


def model_from_hf_config(config: dict, where: str = "config.json") -> tuple[str, object]:
    """(registry name, model args) for a Hugging Face config.json; ValueError naming `where`
    for a model no registered class builds. Its model_type picks the family: Qwen3's (dense or MoE),
    DeepSeek-V3's, or Llama's (which refuses every other type)."""
    if config.get("model_type") in qwen3.MODEL_TYPES:
        return "qwen3", qwen3.hf_config_to_args(config, where)
    if config.get("model_type") in deepseek_v3.MODEL_TYPES:
        return "deepseek_v3", deepseek_v3.hf_config_to_args(config, where)
    args = llama.hf_config_to_args(config, where)
    return llama.hf_model_name(args), args
