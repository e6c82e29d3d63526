"""The layout: how many pipeline stages, how many model replicas per stage, how many shards
each, how many tensor-parallel ranks per layer, and the one device mesh they make."""

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# The mesh's dimensions, outermost first. Ranks fill it row by row, so the ranks of one
# tensor-parallel group are consecutive: on the same node, where TP's per-layer collectives
# need the fast link. Data parallelism, which talks once per block, spans the nodes; pipeline
# parallelism, which sends one activation per micro-batch between neighbouring stages, is
# outermost, so the slowest links carry the least traffic. Context parallelism, which
# all-gathers every layer's keys and values, sits between data and tensor parallelism.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Under context parallelism FSDP shards over dp_shard x cp flattened into one dimension: the
# cp ranks hold the same parameters and their gradients sum like data-parallel ranks'.
SHARD_CP = "dp_shard_cp"

# Expert parallelism's view of the mesh: the dp_shard dimension split into (efsdp, ep), or
# under tensor parallelism into (efsdp, ep_shard). An ep group is the ep_shard consecutive
# shard ranks of the inner dimension together with all the tp ranks of each (under TP every
# TP rank routes its own slice of the sequence, so for the experts the TP ranks are ranks with
# tokens of their own, like the shard ranks): ep = ep_shard x tp consecutive ranks, so an
# all-to-all stays within the ranks closest together. efsdp counts the groups, and FSDP
# shards the experts over it (and replicates them over dp_replicate).
EXPERT_MESH_DIMS = ("efsdp", "ep")
EXPERT_MESH_DIMS_UNDER_TP = ("efsdp", "ep_shard")

# The attribute of a run's mesh that holds its expert view and ep mesh (see ParallelDims.build_mesh).
_EXPERT_VIEW = "titanlite_expert_view"


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees; ``pp * dp_replicate * dp_shard * cp * tp == world_size`` always holds.

    The data-parallel strategies are points of the (replicate, shard) grid: single
    process (1 x 1), FSDP (1 x N), DDP (N x 1) and HSDP (R x S). Tensor parallelism (tp)
    splits each layer within every data-parallel rank, so the ``tp`` ranks of one group
    see the same batch. Pipeline parallelism (pp) splits the layers into stages, each on
    its own set of ranks laid out as above; the ``pp`` ranks of one pipeline read the same
    batch too (the first stage its tokens, the last its labels). Context parallelism (cp)
    splits each sequence: the ``cp`` ranks of one group read the same batch and each keeps
    its chunks of every sequence (titanlite/parallel/context_parallel.py).
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: all the tp ranks and a split of the dp_shard ranks, not a dimension of its own
    cp: int = 1

    @classmethod
    def resolve(
        cls, dp_replicate: int, dp_shard: int, world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1
    ) -> "ParallelDims":
        """Fill in a -1 data-parallel degree with the ranks left over after the others; raise
        ValueError naming the key when the degrees do not multiply to the world size or the
        expert-parallel degree does not fit the TP and shard ranks it borrows (ep_problem)."""
        names = (
            "parallelism.data_parallel_replicate_degree",
            "parallelism.data_parallel_shard_degree",
            "parallelism.tensor_parallel_degree",
            "parallelism.pipeline_parallel_degree",
            "parallelism.context_parallel_degree",
        )
        model_parallel = ((names[3], pp), (names[4], cp), (names[2], tp))
        for name, degree in (*model_parallel, (" x ".join(n for n, _ in model_parallel), pp * cp * tp)):
            if world_size % degree != 0:
                raise ValueError(f"{name} ({degree}) must divide the world size ({world_size})")
        dp_ranks = world_size // (tp * pp * cp)
        # What the data-parallel degrees must fill: the world, or what TP, CP and PP leave of it.
        others = " x ".join(f"{name} ({degree})" for name, degree in model_parallel if degree > 1)
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
        problem = ep_problem(ep, dp_shard * cp, tp, cp > 1)
        if problem is not None:
            raise ValueError(problem)
        return cls(dp_replicate, dp_shard, world_size, tp, pp, ep, cp)

    @property
    def ep_shard(self) -> int:
        """The shard ranks each ep group takes (ep_shard_ranks)."""
        return ep_shard_ranks(self.ep, self.tp)

    @property
    def expert_fsdp(self) -> int:
        """The ranks FSDP shards each rank's experts over under expert parallelism (efsdp):
        the shard ranks holding the same experts, dp_shard / ep_shard (dp_shard x cp / ep under
        context parallelism, whose ranks route tokens of their own like shard ranks)."""
        return self.dp_shard * self.cp // self.ep_shard

    def batch_plan(self, local_batch_size: int, global_batch_size: int, replica_groups: int = 1) -> tuple[int, int]:
        """(sequences per optimizer step, micro-batches per step) for these degrees; -1
        means no accumulation. ``replica_groups``: fault-tolerant replica groups, each with
        these degrees, that read disjoint parts of the global batch. Raise ValueError unless
        the global batch is a positive multiple of local_batch_size x dp degree x groups."""
        per_micro_step = local_batch_size * self.dp_degree * replica_groups
        global_batch = per_micro_step if global_batch_size == -1 else global_batch_size
        if global_batch < 1 or global_batch % per_micro_step != 0:
            groups = f" x replica groups ({replica_groups})" if replica_groups > 1 else ""
            raise ValueError(
                f"training.global_batch_size ({global_batch}) must be a multiple of training.local_batch_size "
                f"({local_batch_size}) x data-parallel degree ({self.dp_degree}){groups} = {per_micro_step}"
            )
        return global_batch, global_batch // per_micro_step

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: how many different micro-batches one micro-step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_applied(self) -> bool:
        """Whether fully_shard wraps the model: with any data or context parallelism (DDP is
        FSDP2 replicating over a shard group of one; cp ranks are sharded over like dp_shard's)."""
        return self.dp_degree * self.cp > 1

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
        present = (
            ("PP", self.pp > 1),
            (data_parallel, True),
            ("CP", self.cp > 1),
            ("EP", self.ep > 1),
            ("TP", self.tp > 1),
        )
        parts = [name for name, wanted in present if wanted]
        return " + ".join(part for part in parts if part)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The run's one mesh. With pipeline parallelism the 4-D (pp, dp_replicate, dp_shard,
        tp) mesh; else without tensor parallelism the data-parallel mesh FSDP shards over
        (1-D for FSDP, 2-D (replicate, shard) for HSDP and DDP); with it, the 3-D
        (dp_replicate, dp_shard, tp) mesh. None for a single process.

        With expert parallelism the mesh also carries its expert view: the same ranks with
        dp_shard unflattened into (efsdp, ep) (DeviceMesh._unflatten), and the 1-D ep mesh;
        under TP dp_shard is unflattened into (efsdp, ep_shard) and the ep mesh is the view's
        (ep_shard, tp) flattened into one dimension (DeviceMesh._flatten). Everything that
        shards or reads over dp_shard or tp (FSDP of the dense parameters, TP, the data
        loader's rank, the collective timeouts) keeps using the mesh as it is; ep_mesh and
        expert_fsdp_mesh read the view. Under context parallelism it is dp_shard x cp, flattened,
        that is unflattened (_shard_cp_mesh). Both are made once, here, because unflattening and
        flattening create process groups on every call."""
        mesh = self._build_layout_mesh(device_type)
        if mesh is not None and self.ep > 1:
            names = EXPERT_MESH_DIMS_UNDER_TP if self.tp > 1 else EXPERT_MESH_DIMS
            base, shard = (self._shard_cp_mesh(mesh), SHARD_CP) if self.cp > 1 else (mesh, "dp_shard")
            view = base._unflatten(shard, (self.expert_fsdp, self.ep_shard), names)
            ep_mesh = view["ep_shard", "tp"]._flatten("ep") if self.tp > 1 else view["ep"]
            setattr(mesh, _EXPERT_VIEW, (view, ep_mesh))
        return mesh

    def _shard_cp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """Under context parallelism, the dimensions an expert view splits: dp_shard x cp
        flattened (the cp ranks route tokens of their own, as shard ranks do, so EP borrows
        them first), with dp_replicate before it and tp after it where they are."""
        names = (*(["dp_replicate"] if self.dp_replicate > 1 else []), SHARD_CP, *(["tp"] if self.tp > 1 else []))
        return _slice(mesh, names)

    def _build_layout_mesh(self, device_type: str) -> DeviceMesh | None:
        if self.world_size == 1:
            return None
        if self.cp > 1:
            # The whole 5-D mesh, and dp_shard x cp flattened for FSDP (made once, here).
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
            override = _gloo_pipeline_group(device_type) if self.pp > 1 else None
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS, backend_override=override)
            mesh["dp_shard", "cp"]._flatten(SHARD_CP)
            return mesh
        if self.pp > 1:
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
            override = _gloo_pipeline_group(device_type)
            names = ("pp", "dp_replicate", "dp_shard", "tp")
            return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
        if self.tp > 1:
            shape, names = (self.dp_replicate, self.dp_shard, self.tp), ("dp_replicate", "dp_shard", "tp")
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
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
        shard = SHARD_CP if self.cp > 1 else "dp_shard"
        return _slice(mesh, (shard,) if self.dp_replicate == 1 else ("dp_replicate", shard))

    def cp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The context-parallel part of ``mesh`` (the ranks splitting the same sequences), or
        None without context parallelism."""
        return mesh["cp"] if mesh is not None and self.cp > 1 else None

    def cp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index in its context-parallel group (which chunks of each sequence it keeps)."""
        return self.coordinate(mesh).get("cp", 0)

    def ep_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The 1-D expert-parallel group of ``mesh`` (this rank and the ranks holding the other
        experts of each MoE layer), or None without expert parallelism."""
        return expert_view(mesh)[1] if mesh is not None and self.ep > 1 else None

    def expert_fsdp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """What FSDP shards (and replicates) the experts over under expert parallelism: the
        data-parallel ranks holding the same experts, efsdp (with dp_replicate under HSDP
        and DDP), or None without expert parallelism. It may have one rank: FSDP over it then
        only gathers nothing and reduces nothing, but keeps the experts' gradients in the
        same units and reductions (the replicas' all-reduce, the divide factor) as the rest."""
        if mesh is None or self.ep == 1:
            return None
        view, _ = expert_view(mesh)
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
        from its place in the mesh: the tp ranks (and cp ranks) of one group share it."""
        coordinate = self.coordinate(mesh)
        return coordinate.get("dp_replicate", 0) * self.dp_shard + coordinate.get("dp_shard", 0)


def _slice(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """mesh[names]. torch 2.13 slices a flattened dimension (dp_shard_cp) from the root mesh as
    it slices any other, but warns that a later release may stop doing so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        return mesh[names]


def ep_shard_ranks(ep: int, tp: int) -> int:
    """The shard ranks each ep group takes: ep / tp, the rest of the group being the tp ranks
    of each (1 without expert parallelism)."""
    return ep // tp if ep > 1 else 1


def ep_problem(ep: int, dp_shard: int, tp: int, with_cp: bool = False) -> str | None:
    """Why ``ep`` ranks cannot hold the experts in this layout (one line naming the keys), or
    None. An ep group takes all the tp ranks (each routes tokens of its own) and ep / tp of
    the shard ranks, as torchtitan's expert parallelism borrows TP and FSDP ranks; ``with_cp``:
    ``dp_shard`` is the shard degree times the context-parallel degree, whose ranks EP borrows too."""
    key, shard_key, tp_key = (
        "parallelism.expert_parallel_degree",
        "parallelism.data_parallel_shard_degree" + (" x context_parallel_degree" if with_cp else ""),
        "parallelism.tensor_parallel_degree",
    )
    if ep == 1:
        return None
    if tp == 1:
        if dp_shard % ep == 0:
            return None
        return f"{key} ({ep}) must divide {shard_key} ({dp_shard}): expert parallelism borrows the FSDP ranks"
    borrows = "expert parallelism borrows all the TP ranks, then FSDP ranks"
    if ep % tp != 0:
        return f"{key} ({ep}) must be a multiple of {tp_key} ({tp}): {borrows}"
    if dp_shard % (ep // tp) != 0:
        return f"{key} / {tp_key} ({ep // tp}) must divide {shard_key} ({dp_shard}): {borrows}"
    return None


def expert_view(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """(expert view, ep mesh) that build_mesh keeps on a run's mesh under expert parallelism:
    its dimensions with dp_shard split into (efsdp, ep) or (efsdp, ep_shard), and the 1-D ep
    mesh."""
    view = getattr(mesh, _EXPERT_VIEW, None)
    if view is None:
        raise ValueError("this mesh has no expert view: build it with ParallelDims.build_mesh and ep > 1")
    return view


def all_groups(mesh: DeviceMesh | None) -> list:
    """Every process group of ``mesh``'s dimensions, and of its expert view's and ep mesh's
    when it has them."""
    if mesh is None:
        return []
    views = getattr(mesh, _EXPERT_VIEW, ())
    return [*mesh.get_all_groups(), *(group for view in views for group in view.get_all_groups())]


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
