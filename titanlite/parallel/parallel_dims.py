"""The layout: how many pipeline stages, how many model replicas per stage, how many shards
each, how many tensor-parallel ranks per layer, and the one device mesh they make."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The mesh's dimensions, outermost first. Ranks fill it row by row, so the ranks of one
# tensor-parallel group are consecutive: on the same node, where TP's per-layer collectives
# need the fast link. Data parallelism, which talks once per block, spans the nodes; pipeline
# parallelism, which sends one activation per micro-batch between neighbouring stages, is
# outermost, so the slowest links carry the least traffic.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# Expert parallelism's view of the mesh: the dp_shard dimension split into (efsdp, ep). The
# ep ranks of one group are consecutive shard ranks (the inner dimension), so an all-to-all
# stays within the ranks closest together; efsdp counts the groups, and FSDP shards the
# experts over it (and replicates them over dp_replicate).
EXPERT_MESH_DIMS = ("efsdp", "ep")

# The attribute of a run's mesh that holds its expert view (see ParallelDims.build_mesh).
_EXPERT_VIEW = "titanlite_expert_view"


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees; ``pp * dp_replicate * dp_shard * tp == world_size`` always holds.

    The data-parallel strategies are points of the (replicate, shard) grid: single
    process (1 x 1), FSDP (1 x N), DDP (N x 1) and HSDP (R x S). Tensor parallelism (tp)
    splits each layer within every data-parallel rank, so the ``tp`` ranks of one group
    see the same batch. Pipeline parallelism (pp) splits the layers into stages, each on
    its own set of ranks laid out as above; the ``pp`` ranks of one pipeline read the same
    batch too (the first stage its tokens, the last its labels).
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: a split of the dp_shard ranks, not a dimension of its own

    @classmethod
    def resolve(
        cls, dp_replicate: int, dp_shard: int, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1
    ) -> "ParallelDims":
        """Fill in a -1 data-parallel degree with the ranks left over after the others; raise
        ValueError naming the key when the degrees do not multiply to the world size or the
        expert-parallel degree does not divide the shard degree it borrows its ranks from."""
        names = (
            "parallelism.data_parallel_replicate_degree",
            "parallelism.data_parallel_shard_degree",
            "parallelism.tensor_parallel_degree",
            "parallelism.pipeline_parallel_degree",
        )
        for name, degree in ((names[3], pp), (names[2], tp), (f"{names[3]} x {names[2]}", pp * tp)):
            if world_size % degree != 0:
                raise ValueError(f"{name} ({degree}) must divide the world size ({world_size})")
        dp_ranks = world_size // (tp * pp)
        # What the data-parallel degrees must fill: the world, or what TP and PP leave of it.
        others = " x ".join(f"{name} ({degree})" for name, degree in ((names[3], pp), (names[2], tp)) if degree > 1)
        ranks_left = f"the world size ({world_size})" + (f" / {others}" if others else "")
        if -1 in (dp_replicate, dp_shard):
            known_name, known = (names[1], dp_shard) if dp_replicate == -1 else (names[0], dp_replicate)
            if known == -1 or dp_ranks % known != 0:
                raise ValueError(f"{known_name} ({known}) must divide {ranks_left} when the other degree is -1")
            dp_replicate, dp_shard = (dp_ranks // known, known) if dp_replicate == -1 else (known, dp_ranks // known)
        if dp_replicate * dp_shard != dp_ranks:
            raise ValueError(
                f"{names[0]} ({dp_replicate}) x {names[1]} ({dp_shard}) must equal {ranks_left}; "
                "use -1 for one of them to take the ranks left over"
            )
        if dp_shard % ep != 0:
            raise ValueError(
                f"parallelism.expert_parallel_degree ({ep}) must divide {names[1]} ({dp_shard}): "
                "expert parallelism borrows the FSDP ranks"
            )
        return cls(dp_replicate, dp_shard, world_size, tp, pp, ep)

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
        """Data-parallel ranks: how many different micro-batches one micro-step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_applied(self) -> bool:
        """Whether fully_shard wraps the model: with any data parallelism (DDP is FSDP2
        replicating over a shard group of one)."""
        return self.dp_degree > 1

    @property
    def strategy(self) -> str:
        if self.world_size == 1:
            return "single process"
        if self.dp_degree == 1:
            data_parallel = ""
        elif self.dp_replicate == 1:
            data_parallel = "FSDP"
        else:
            data_parallel = "DDP" if self.dp_shard == 1 else "HSDP"
        present = (("PP", self.pp > 1), (data_parallel, True), ("EP", self.ep > 1), ("TP", self.tp > 1))
        parts = [name for name, wanted in present if wanted]
        return " + ".join(part for part in parts if part)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The run's one mesh. With pipeline parallelism the 4-D (pp, dp_replicate, dp_shard,
        tp) mesh; else without tensor parallelism the data-parallel mesh FSDP shards over
        (1-D for FSDP, 2-D (replicate, shard) for HSDP and DDP); with it, the 3-D
        (dp_replicate, dp_shard, tp) mesh. None for a single process.

        With expert parallelism the mesh also carries its expert view: the same ranks with
        dp_shard unflattened into (efsdp, ep) (DeviceMesh._unflatten). Everything that shards
        or reads over dp_shard (FSDP of the dense parameters, the data loader's rank, the
        collective timeouts) keeps using the mesh as it is; ep_mesh and expert_fsdp_mesh
        slice the view. The view is made once, here, because unflattening creates the
        efsdp and ep process groups on every call."""
        mesh = self._build_layout_mesh(device_type)
        if mesh is not None and self.ep > 1:
            view = mesh._unflatten("dp_shard", (self.dp_shard // self.ep, self.ep), EXPERT_MESH_DIMS)
            setattr(mesh, _EXPERT_VIEW, view)
        return mesh

    def _build_layout_mesh(self, device_type: str) -> DeviceMesh | None:
        if self.world_size == 1:
            return None
        if self.pp > 1:
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
            override = _gloo_pipeline_group(device_type)
            return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS, backend_override=override)
        if self.tp > 1:
            return init_device_mesh(
                device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS[1:]
            )
        if self.dp_replicate == 1:
            return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=MESH_DIMS[1:3])

    def tensor_parallel_crosses_nodes(self, ranks_per_node: int) -> str | None:
        """Why this layout's TP groups are not each inside one node (a warning), or None. A
        TP group is tp consecutive ranks, so it stays on a node when tp divides the ranks
        per node."""
        if self.tp == 1 or ranks_per_node % self.tp == 0:
            return None
        return (
            f"parallelism.tensor_parallel_degree ({self.tp}) does not divide the {ranks_per_node} ranks per node: "
            "some TP groups span nodes, and their per-layer collectives cross the network"
        )

    def dp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The data-parallel part of ``mesh`` that FSDP shards (and replicates) over, or None
        when there is no data parallelism."""
        if mesh is None or not self.fsdp_applied:
            return None
        return mesh["dp_shard"] if self.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]

    def ep_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The 1-D expert-parallel group of ``mesh`` (this rank and the ranks holding the other
        experts of each MoE layer), or None without expert parallelism."""
        return expert_view(mesh)["ep"] if mesh is not None and self.ep > 1 else None

    def expert_fsdp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """What FSDP shards (and replicates) the experts over under expert parallelism: the
        data-parallel ranks holding the same experts, efsdp (with dp_replicate under HSDP
        and DDP), or None without expert parallelism. It may have one rank: FSDP over it then
        only gathers nothing and reduces nothing, but keeps the experts' gradients in the
        same units and reductions (the replicas' all-reduce, the divide factor) as the rest."""
        if mesh is None or self.ep == 1:
            return None
        view = expert_view(mesh)
        return view["efsdp"] if self.dp_replicate == 1 else view["dp_replicate", "efsdp"]

    def tp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The tensor-parallel part of ``mesh``, or None without tensor parallelism."""
        return mesh["tp"] if mesh is not None and self.tp > 1 else None

    def pp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The pipeline part of ``mesh`` (this rank and the ranks holding the other stages of
        its pipeline), or None without pipeline parallelism."""
        return mesh["pp"] if mesh is not None and self.pp > 1 else None

    @staticmethod
    def coordinate(mesh: DeviceMesh | None) -> dict[str, int]:
        """This rank's index along each of the mesh's dimensions, by name; a dimension the
        mesh lacks (or no mesh) is left out, meaning index 0."""
        return {} if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among the data-parallel ranks (which part of each batch it reads),
        from its place in the mesh: tp ranks of one group share it."""
        coordinate = self.coordinate(mesh)
        return coordinate.get("dp_replicate", 0) * self.dp_shard + coordinate.get("dp_shard", 0)


def expert_view(mesh: DeviceMesh) -> DeviceMesh:
    """The expert view build_mesh keeps on a run's mesh under expert parallelism: its
    dimensions with dp_shard split into (efsdp, ep)."""
    view = getattr(mesh, _EXPERT_VIEW, None)
    if view is None:
        raise ValueError("this mesh has no expert view: build it with ParallelDims.build_mesh and ep > 1")
    return view


def all_groups(mesh: DeviceMesh | None) -> list:
    """Every process group of ``mesh``'s dimensions, and of its expert view's when it has one."""
    if mesh is None:
        return []
    view = getattr(mesh, _EXPERT_VIEW, None)
    return [*mesh.get_all_groups(), *(view.get_all_groups() if view is not None else [])]


def _gloo_pipeline_group(device_type: str) -> dict | None:
    """The pp dimension's group options under gloo: the default group's timeout (at start-up,
    comm.init_timeout_seconds), or None to leave the mesh's groups as torch makes them.

    A gloo send or receive waits as long as its group's timeout was when the group was made
    (a timeout set later reaches collectives only), and the mesh makes groups with torch's
    30-minute default: a pipeline stage whose peer stopped would wait that long. NCCL applies
    a timeout set later to sends and receives too."""
    if device_type != "cpu" or not dist.is_gloo_available():
        return None
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    if not isinstance(backend, dist.ProcessGroupGloo):  # e.g. the estimator's fake process group
        return None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = backend.options._timeout
    return {"pp": ("gloo", options)}
