"""What every model family's hyper-parameters dataclass gives the shared code (the registry,
the trainer's planning, the FLOP count), beside the fields docs/model.md lists."""

from dataclasses import replace


class ModelArgs:
    """Base of each family's frozen dataclass of hyper-parameters (LlamaArgs, Qwen3Args)."""

    def with_seq_len(self, seq_len: int):
        """The same model with RoPE tables for ``seq_len`` positions (max_seq_len)."""
        return replace(self, max_seq_len=seq_len)

    def with_rope_scaling(self, factor: float, original_seq_len: int | None):
        """The same model with its family's RoPE scaling for a context ``factor`` times longer
        than ``original_seq_len`` (None: the flavor's, or max_seq_len / factor); ValueError for
        a family without one."""
        raise ValueError(f"{type(self).__name__.removesuffix('Args').lower()} has no RoPE scaling in titanlite")

    def original_seq_len(self, factor: float, given: int | None) -> int:
        """The context length RoPE scaling stretches: ``given``, else the flavor's scaling's,
        else max_seq_len (the run's seq_len) / factor."""
        if given is not None:
            return given
        scaling = getattr(self, "rope_scaling", None)
        return scaling.original_max_position_embeddings if scaling else int(self.max_seq_len / factor)

    @classmethod
    def model_cls(cls) -> type:
        """The decoder these hyper-parameters describe: what the registry builds and what the
        FLOP count measures (on the meta device). Each family imports it inside the method, as
        its model.py imports its args.py."""
        raise NotImplementedError(f"{cls.__name__} names no model class")
