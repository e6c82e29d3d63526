"""The data-parallel layout: how many replicas, how many shards each, and the mesh."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees; ``dp_replicate * dp_shard == world_size`` always holds.

    The four classic strategies are points of this grid (plus the reshard policy):
    single process (1 x 1), FSDP (1 x N), DDP (N x 1) and HSDP (R x S). Data parallelism
    is the only dimension, so a rank's data-parallel index is its global rank.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, world_size: int) -> "ParallelDims":
        """Fill in a -1 degree with the ranks left over; raise ValueError if the product is wrong."""
        names = ("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree")
        if -1 in (dp_replicate, dp_shard):
            known_name, known = (names[1], dp_shard) if dp_replicate == -1 else (names[0], dp_replicate)
            if world_size % known != 0:
                raise ValueError(
                    f"{known_name} ({known}) must divide the world size ({world_size}) when the other degree is -1"
                )
            dp_replicate, dp_shard = (
                (world_size // known, known) if dp_replicate == -1 else (known, world_size // known)
            )
        if dp_replicate * dp_shard != world_size:
            raise ValueError(
                f"{names[0]} ({dp_replicate}) x {names[1]} ({dp_shard}) must equal the world size "
                f"({world_size}); use -1 for one of them to take the ranks left over"
            )
        return cls(dp_replicate, dp_shard, world_size)

    def batch_plan(self, local_batch_size: int, global_batch_size: int) -> tuple[int, int]:
        """(sequences per optimizer step, micro-batches per step) for these degrees; -1
        means no accumulation. Raise ValueError unless the global batch is a positive
        multiple of local_batch_size x dp degree."""
        per_micro_step = local_batch_size * self.dp_degree
        global_batch = per_micro_step if global_batch_size == -1 else global_batch_size
        if global_batch < 1 or global_batch % per_micro_step != 0:
            raise ValueError(
                f"training.global_batch_size ({global_batch}) must be a multiple of training.local_batch_size "
                f"({local_batch_size}) x data-parallel degree ({self.dp_degree}) = {per_micro_step}"
            )
        return global_batch, global_batch // per_micro_step

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def strategy(self) -> str:
        if self.world_size == 1:
            return "single process"
        if self.dp_replicate == 1:
            return "FSDP"
        return "DDP" if self.dp_shard == 1 else "HSDP"

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The mesh FSDP shards over: 1-D for FSDP, 2-D (replicate, shard) for HSDP and DDP."""
        if self.world_size == 1:
            return None
        if self.dp_replicate == 1:
            return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
