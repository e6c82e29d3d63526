"""ParallelDims: degrees resolved against the world size and the tensor-parallel degree, the
strategy named in the logs, and each rank's place in the mesh it builds."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import tiny_args
from tests.rank_jobs import run_on_ranks
from titanlite.config import ConfigError, parse_args
from titanlite.models.deepseek_v3.model import LatentAttention
from titanlite.models.llama.model import Attention
from titanlite.parallel import ParallelDims
from titanlite.parallel.context_parallel import SequenceSplit, kv_gather_line, sequence_positions
from titanlite.plan import plan_run, unused_layout_keys
from titanlite.registry import get_model_args
from titanlite.train import main


@pytest.mark.parametrize(
    "replicate, shard, world, tp, resolved, strategy",
    [
        (1, -1, 1, 1, (1, 1), "single process"),
        (1, -1, 4, 1, (1, 4), "FSDP"),
        (-1, 1, 4, 1, (4, 1), "DDP"),
        (2, -1, 4, 1, (2, 2), "HSDP"),
        (1, -1, 2, 2, (1, 1), "TP"),
        (1, -1, 8, 2, (1, 4), "FSDP + TP"),  # -1 takes what TP leaves of the world
        (2, -1, 4, 2, (2, 1), "DDP + TP"),
        (-1, 2, 8, 2, (2, 2), "HSDP + TP"),
        (2, 2, 16, 4, (2, 2), "HSDP + TP"),
    ],
)
def test_resolve(replicate, shard, world, tp, resolved, strategy):
    dims = ParallelDims.resolve(replicate, shard, world, tp=tp)
    assert (dims.dp_replicate, dims.dp_shard, dims.world_size, dims.tp) == (*resolved, world, tp)
    assert dims.strategy == strategy
    assert dims.dp_degree == world // tp
    # fully_shard wraps the model exactly when there is data parallelism, TP or not.
    assert dims.fsdp_applied == (dims.dp_degree > 1)


@pytest.mark.parametrize(
    "tp, ranks_per_node, crosses", [(1, 3, False), (2, 8, False), (8, 8, False), (16, 8, True), (4, 6, True)]
)
def test_a_tp_group_across_nodes_is_named(tp, ranks_per_node, crosses):
    dims = ParallelDims.resolve(1, -1, 48, tp=tp)
    warning = dims.tensor_parallel_crosses_nodes(ranks_per_node)
    assert (warning is not None) == crosses
    if crosses:
        assert warning.startswith(
            f"parallelism.tensor_parallel_degree ({tp}) does not divide the {ranks_per_node} ranks"
        )


def test_batch_plan_counts_data_parallel_ranks_only():
    # 8 ranks, 2 per TP group: 4 data-parallel ranks read 2 sequences each per micro-step.
    dims = ParallelDims.resolve(1, -1, 8, tp=2)
    assert dims.batch_plan(local_batch_size=2, global_batch_size=16) == (16, 2)
    with pytest.raises(ValueError, match=r"data-parallel degree \(4\)"):
        dims.batch_plan(local_batch_size=2, global_batch_size=12)


@pytest.mark.parametrize(
    "replicate, shard, world, tp, message",
    [
        (1, -1, 4, 3, r"^parallelism\.tensor_parallel_degree \(3\) must divide the world size \(4\)$"),
        (3, -1, 8, 2, r"^parallelism\.data_parallel_replicate_degree \(3\) must divide the world size \(8\) / "),
        (2, 4, 8, 2, r"must equal the world size \(8\) / parallelism\.tensor_parallel_degree \(2\);"),
    ],
)
def test_resolve_names_the_key(replicate, shard, world, tp, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(replicate, shard, world, tp=tp)


# (dp_replicate, dp_shard, tp) over 4 ranks.
MESH_LAYOUTS = ((1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1))


def places_in_meshes() -> dict:
    dist.init_process_group("gloo")
    places = {}
    for replicate, shard, tp in MESH_LAYOUTS:
        dims = ParallelDims(replicate, shard, 4, tp)
        mesh = dims.build_mesh("cpu")
        tp_mesh, dp_mesh = dims.tp_mesh(mesh), dims.dp_mesh(mesh)
        places[(replicate, shard, tp)] = {
            "dp_rank": dims.dp_rank(mesh),
            "tp_group": None if tp_mesh is None else tp_mesh.mesh.flatten().tolist(),
            "dp_group": dp_mesh.mesh.flatten().tolist(),
        }
    dist.destroy_process_group()
    return places


def test_dp_rank_and_groups_on_a_real_mesh():
    for rank, places in enumerate(run_on_ranks(4, places_in_meshes)):
        for (replicate, shard, tp), place in places.items():
            # The tp ranks of a group are consecutive and read the same data-parallel part.
            assert place["dp_rank"] == rank // tp, (replicate, shard, tp)
            if tp > 1:
                first = rank // tp * tp
                assert place["tp_group"] == list(range(first, first + tp))
            else:
                assert place["tp_group"] is None
            # The data-parallel ranks: one from each TP group, at this rank's TP position.
            assert place["dp_group"] == list(range(rank % tp, 4, tp))


# --- keys a layout never reads ---------------------------------------------------------------

LAYOUT_ONLY = {
    "training.mixed_precision_reduce": "bfloat16",
    "parallelism.fsdp_reshard_after_forward": "never",
    "parallelism.enable_sequence_parallel": "false",
    "parallelism.disable_loss_parallel": "true",
    "parallelism.context_parallel_load_balancer": "none",
}
FSDP_KEYS = ["training.mixed_precision_reduce", "parallelism.fsdp_reshard_after_forward"]
TP_KEYS = ["parallelism.enable_sequence_parallel", "parallelism.disable_loss_parallel"]
CP_KEY = "parallelism.context_parallel_load_balancer"


@pytest.mark.parametrize(
    "world_size, layout, ignored",
    [
        (1, [], [CP_KEY, *FSDP_KEYS, *TP_KEYS]),
        (2, [], [CP_KEY, *TP_KEYS]),  # FSDP
        (2, ["--parallelism.data_parallel_replicate_degree=2"], [CP_KEY, *TP_KEYS]),  # DDP is FSDP2 too
        (2, ["--parallelism.tensor_parallel_degree=2"], [CP_KEY, *FSDP_KEYS]),  # TP alone
        (4, ["--parallelism.tensor_parallel_degree=2"], [CP_KEY]),  # FSDP + TP
        (2, ["--parallelism.context_parallel_degree=2"], TP_KEYS),  # CP alone is sharded over by FSDP
    ],
    ids=["single", "fsdp", "ddp", "tp", "fsdp_tp", "cp"],
)
def test_a_key_the_layout_ignores_is_one_warning_line(world_size, layout, ignored):
    settings = [f"--{key}={value}" for key, value in LAYOUT_ONLY.items()]
    config = parse_args(tiny_args() + layout + settings)
    lines = unused_layout_keys(config, plan_run(config, world_size).parallel_dims)
    assert [line.split(" = ")[0].removeprefix("titanlite: warning: ") for line in lines] == ignored
    for key, line in zip(ignored, lines, strict=True):
        assert f"{key} = {LAYOUT_ONLY[key]} has no effect in this layout" in line
    # At their defaults the same keys say nothing, whatever the layout.
    config = parse_args(tiny_args() + layout)
    assert unused_layout_keys(config, plan_run(config, world_size).parallel_dims) == []


def test_the_trainer_prints_the_warning_at_start_up(capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "TITANLITE_CONFIG_WARNINGS_SHOWN"):
        monkeypatch.delenv(name, raising=False)
    argv = tiny_args() + ["--training.mixed_precision_reduce=bfloat16", "--job.validate_only"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "mixed_precision_reduce" in line] == [
        "titanlite: warning: training.mixed_precision_reduce = bfloat16 has no effect in this layout "
        "(single process, 1 rank(s)); only FSDP (more than one data-parallel rank) reads it"
    ]
    monkeypatch.setenv("RANK", "1")  # one line for the job: rank 0's
    assert main(argv) == 0
    assert "mixed_precision_reduce" not in capsys.readouterr().err


def test_expert_parallel_borrows_the_tp_ranks_then_the_shard_ranks():
    dims = ParallelDims.resolve(1, -1, 8, tp=2, ep=2)
    assert (dims.dp_shard, dims.ep, dims.strategy) == (4, 2, "FSDP + EP + TP")
    assert (dims.ep_shard, dims.expert_fsdp) == (1, 4)  # the ep group is the TP group
    dims = ParallelDims.resolve(1, -1, 8, tp=2, ep=8)
    assert (dims.ep_shard, dims.expert_fsdp) == (4, 1)
    dims = ParallelDims.resolve(1, -1, 8, ep=4)  # without TP, shard ranks only
    assert (dims.ep_shard, dims.expert_fsdp) == (4, 2)
    message = r"expert_parallel_degree \(4\) must divide .*data_parallel_shard_degree \(2\)"
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(2, -1, 4, ep=4)
    with pytest.raises(
        ValueError, match=r"expert_parallel_degree \(2\) must be a multiple of .*tensor_parallel_degree \(4\)"
    ):
        ParallelDims.resolve(1, -1, 8, tp=4, ep=2)
    message = r"expert_parallel_degree / parallelism.tensor_parallel_degree \(4\) must divide .*shard_degree \(2\)"
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(1, 2, 4, tp=2, ep=8)


# --- context parallelism ----------------------------------------------------------------------


def test_context_parallel_is_a_dimension_that_fsdp_shards_over():
    dims = ParallelDims.resolve(1, -1, 16, tp=2, pp=2, cp=2)
    assert (dims.dp_shard, dims.dp_degree, dims.strategy) == (2, 2, "PP + FSDP + CP + TP")
    dims = ParallelDims.resolve(1, -1, 2, cp=2)  # CP alone: FSDP over the cp ranks, one dp rank
    assert (dims.dp_degree, dims.fsdp_applied, dims.strategy) == (1, True, "CP")
    with pytest.raises(ValueError, match=r"context_parallel_degree \(3\) must divide the world size \(4\)"):
        ParallelDims.resolve(1, -1, 4, cp=3)
    dims = ParallelDims.resolve(1, -1, 4, cp=2, ep=2)  # EP borrows the cp ranks, then shard ranks
    assert (dims.expert_fsdp, dims.strategy) == (2, "FSDP + CP + EP")
    with pytest.raises(ValueError, match=r"\(4\) must divide .*shard_degree x context_parallel_degree \(2\)"):
        ParallelDims.resolve(1, -1, 2, cp=2, ep=4)
    # EP may borrow cp and TP ranks together, and sits beside replicas.
    dims = ParallelDims.resolve(1, -1, 4, cp=2, ep=4, tp=2)
    assert (dims.ep_shard, dims.expert_fsdp, dims.strategy) == (2, 1, "CP + EP + TP")
    assert ParallelDims.resolve(2, -1, 4, cp=2, ep=2).expert_fsdp == 1
    with pytest.raises(ValueError, match=r"expert_parallel_degree / .*tensor_parallel_degree \(4\) must divide"):
        ParallelDims.resolve(1, -1, 4, cp=2, ep=8, tp=2)


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            ["--training.seq_len=34"],
            r"training.seq_len \(34\) must be a multiple of 2 x .*degree \(2\) for the headtail",
        ),
        (["--training.seq_len=33", "--parallelism.context_parallel_load_balancer=none"], r"seq_len \(33\) .* of par"),
        (["--parallelism.tensor_parallel_degree=2", "--training.seq_len=36"], r"x parallelism.tensor_parallel_degree"),
    ],
    ids=["headtail", "none", "sequence_parallel"],
)
def test_a_sequence_that_does_not_cut_into_cp_chunks_is_a_config_error(layout, message):
    config = parse_args(tiny_args() + ["--parallelism.context_parallel_degree=2", *layout])
    with pytest.raises(ConfigError, match=message):
        plan_run(config, 4)


def test_cp_ranks_keep_head_and_tail_chunks_and_together_the_whole_sequence():
    assert sequence_positions(8, 2, 0, headtail=True).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1, headtail=True).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 2, 1, headtail=False).tolist() == [4, 5, 6, 7]
    for headtail in (True, False):
        kept = torch.cat([sequence_positions(32, 4, rank, headtail) for rank in range(4)])
        assert sorted(kept.tolist()) == list(range(32))
    split = SequenceSplit(2, 1, headtail=True)
    batch = torch.arange(16).view(2, 8)
    assert split.columns(batch).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert split.local_positions(4).tolist() == [2, 3, 4, 5]
    assert split.gathered_positions(4).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_the_start_up_line_counts_the_gathered_key_value_heads():
    llama = get_model_args("llama3", "tiny")  # 2 key/value heads of 16: 64 numbers per token
    line = kv_gather_line(llama, Attention, 4, 2**16, tp=2, cp=4, dtype_bytes=2)
    assert "keys and values of 16.0 MiB per micro-batch (12.0 MiB from the other ranks" in line
    deepseek = get_model_args("deepseek_v3", "tiny")  # every head's key and value
    width = deepseek.n_heads * (deepseek.qk_head_dim + deepseek.v_head_dim)
    expected = 4 * 2**16 * width * 2 / 2**20
    assert f"{expected:,.1f} MiB per micro-batch" in kv_gather_line(deepseek, LatentAttention, 4, 2**16, 1, 2, 2)
