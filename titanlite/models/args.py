"""What every model family's hyper-parameters dataclass gives the shared code (the registry,
the trainer's planning, the FLOP count), beside the fields docs/model.md lists."""

from dataclasses import replace


class ModelArgs:
    """Base of each family's frozen dataclass of hyper-parameters (LlamaArgs, Qwen3Args)."""

    def with_seq_len(self, seq_len: int):
        """The same model with RoPE tables for ``seq_len`` positions (max_seq_len)."""
        return replace(self, max_seq_len=seq_len)

    @classmethod
    def model_cls(cls) -> type:
        """The decoder these hyper-parameters describe: what the registry builds and what the
        FLOP count measures (on the meta device). Each family imports it inside the method, as
        its model.py imports its args.py."""
        raise NotImplementedError(f"{cls.__name__} names no model class")
