"""Tests for the Llama model: sizes, configs, RoPE, forward, init, state-dict names and the HF adapter."""

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from titanlite import train
from titanlite.config import parse_args
from titanlite.config.model import MOE_KEYS
from titanlite.estimate import check_memory_floor, floor
from titanlite.models.attention import attend
from titanlite.models.llama import LLAMA31_ROPE_SCALING, LlamaArgs, LlamaStateDictAdapter, Transformer
from titanlite.models.llama.model import apply_rope, rope_frequencies, rope_tables
from titanlite.plan import plan_run
from titanlite.registry import get_model_args, get_model_spec
from titanlite.trainer_setup import config_ok_line

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((REPO_ROOT / "train_configs").glob("*.toml"))

# A model small enough that a forward pass takes milliseconds; head_dim 16, grouped-query.
SMALL = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=32)


def build_on_meta(args: LlamaArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def build_real(args: LlamaArgs, seed: int = 0) -> Transformer:
    model = build_on_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


# ---------------------------------------------------------------------------
# Published sizes
# ---------------------------------------------------------------------------

PUBLISHED = [
    # name, flavor, parameter count, SwiGLU hidden size
    ("llama2", "7B", 6_738_415_616, 11008),
    ("llama2", "13B", 13_015_864_320, 13824),
    ("llama2", "70B", 68_976_648_192, 28672),
    ("llama3", "8B", 8_030_261_248, 14336),
    ("llama3", "70B", 70_553_706_496, 28672),
    ("llama3", "405B", 405_853_388_800, 53248),
]


@pytest.mark.parametrize("name,flavor,n_params,ffn_hidden", PUBLISHED, ids=[f"{n}-{f}" for n, f, *_ in PUBLISHED])
def test_flavor_sizes_match_published_figures(name, flavor, n_params, ffn_hidden):
    spec = get_model_spec(name)
    args = get_model_args(name, flavor)
    assert args.ffn_hidden_dim == ffn_hidden
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert model.layers["0"].feed_forward.w1.weight.shape == (ffn_hidden, args.dim)
    # Built on meta, nothing is allocated: every parameter and buffer is a meta tensor.
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


# ---------------------------------------------------------------------------
# Every shipped training config
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How a config's header comment says to start it."""

    world_size: int
    ranks_per_node: int
    on_gpus: bool  # False: run_train.sh's CPU processes


def _header(path: Path) -> str:
    """A config's leading comment as one line, its shell continuations joined."""
    lines = itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines())
    return " ".join(line.lstrip("#").strip().removesuffix("\\").strip() for line in lines)


def launch_of(path: Path) -> Launch:
    """The GPU count of a shipped config, read from the launch command its header gives (the one
    place it is written): torchrun's nodes x processes per node, run_train.sh's NGPU, or
    run_train.sh alone, which trains its default config with its default CPU processes."""
    header = _header(path)
    torchrun = re.search(r"torchrun --nnodes (\d+) --nproc_per_node (\d+) .*?--job\.config_file (\S+)", header)
    if torchrun:
        nodes, per_node, config = torchrun.groups()
        assert config == f"train_configs/{path.name}", f"{path.name}'s launch command trains {config}"
        return Launch(int(nodes) * int(per_node), int(per_node), on_gpus=True)
    run_train = re.search(r"NGPU=(\d+) CONFIG_FILE=(\S+) \./run_train\.sh", header)
    if run_train:
        gpus, config = run_train.groups()
        assert config == f"train_configs/{path.name}", f"{path.name}'s launch command trains {config}"
        return Launch(int(gpus), int(gpus), on_gpus=True)
    assert "./run_train.sh" in header, f"{path.name}: no launch command in its header comment"
    script = (REPO_ROOT / "run_train.sh").read_text()
    assert f'CONFIG_FILE="${{CONFIG_FILE:-$checkout/train_configs/{path.name}}}"' in script, (
        f"{path.name}'s header starts ./run_train.sh bare, whose default config is another"
    )
    cpu_processes = int(re.search(r"else NGPU=(\d+); fi", script).group(1))
    return Launch(cpu_processes, cpu_processes, on_gpus=False)


# `or [None]`: an empty folder must fail below, not turn into a skipped parametrization.
@pytest.mark.parametrize("path", TRAIN_CONFIGS or [None], ids=[p.name for p in TRAIN_CONFIGS] or ["empty"])
def test_train_config_validates_at_its_own_gpu_count(path, monkeypatch, capsys, tmp_path):
    """Every shipped config passes the real --job.validate_only (layout, memory floor of the GPU
    of job.validate_hardware, an 80 GiB h100, or of this host's GPU, tokenizer, data) at the
    world size its launch command starts, and plans the flavor's model and the batch it says."""
    assert path is not None, f"no *.toml files in {REPO_ROOT / 'train_configs'}"
    launch = launch_of(path)
    monkeypatch.setenv("WORLD_SIZE", str(launch.world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(launch.ranks_per_node))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)  # job.dump_folder "./outputs" holds no other run's checkpoint
    if launch.on_gpus:
        monkeypatch.setattr(floor, "device_memory_bytes", lambda device_type, ranks: (80 * 2**30, "an 80 GiB GPU"))
    status = train.main(["--job.config_file", str(path), "--job.validate_only"])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    job_config = parse_args(["--job.config_file", str(path), "--job.validate_only"])
    plan = plan_run(job_config, launch.world_size)
    ok_line = printed.out.splitlines()[-1]
    assert ok_line == config_ok_line(plan, check_memory_floor(job_config, plan))
    assert f" over {launch.world_size} rank(s)" in ok_line, ok_line

    name, flavor = job_config.model.name, job_config.model.flavor
    args = get_model_args(name, flavor).with_seq_len(job_config.training.seq_len)
    if job_config.model.rope_scaling_factor is not None:  # a long-context phase's
        args = args.with_rope_scaling(job_config.model.rope_scaling_factor, job_config.model.rope_original_seq_len)
    # The flavor's args, with the router and balancing a config's [model] section sets (MoE only).
    chosen = {field: getattr(job_config.model, key) for key, field in MOE_KEYS.items()}
    assert plan.model_args == dataclasses.replace(
        args, **{field: value for field, value in chosen.items() if value is not None}
    )
    dims = plan.parallel_dims
    assert dims.pp * dims.dp_degree * dims.cp * dims.tp == launch.world_size
    per_micro_step = job_config.training.local_batch_size * dims.dp_degree
    assert plan.global_batch_size == plan.grad_accum_steps * per_micro_step


# ---------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------


def _rotated(args: LlamaArgs, x: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_tables(args)
    return apply_rope(x, cos, sin)


def test_rope_preserves_norms_and_rotates():
    torch.manual_seed(0)
    x = torch.randn(2, 20, 3, SMALL.head_dim)
    out = _rotated(SMALL, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    # Position 0 is the identity; every later position actually moves the vector.
    torch.testing.assert_close(out[:, 0], x[:, 0])
    assert ((out[:, 1:] - x[:, 1:]).abs().amax(dim=-1) > 1e-3).all()


def test_rope_scores_depend_only_on_position_difference():
    torch.manual_seed(1)
    seq = SMALL.max_seq_len
    q, k = torch.randn(SMALL.head_dim), torch.randn(SMALL.head_dim)
    # The same q (and k) at every position of a sequence: [1, seq, 1, head_dim].
    rq = _rotated(SMALL, q.expand(1, seq, 1, -1).contiguous())[0, :, 0]
    rk = _rotated(SMALL, k.expand(1, seq, 1, -1).contiguous())[0, :, 0]
    scores_by_offset = {}
    for d in (0, 1, 3, 7):
        scores = torch.stack([rq[p] @ rk[p + d] for p in (0, 2, 5, 11, seq - 1 - d)])
        torch.testing.assert_close(scores, scores[0].expand_as(scores), rtol=1e-5, atol=1e-5)
        scores_by_offset[d] = scores[0].item()
    # ... and they do depend on the difference (no rotation at all would pass the check above).
    values = list(scores_by_offset.values())
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]) > 1e-4
    assert not torch.allclose(rq[0], rq[5])


def test_rope_scaling_changes_only_low_frequencies():
    base = get_model_args("llama3", "8B")
    assert base.rope_scaling is None
    scaling = LLAMA31_ROPE_SCALING
    scaled_args = dataclasses.replace(base, rope_scaling=scaling)
    plain, scaled = rope_frequencies(base), rope_frequencies(scaled_args)
    # Frequencies in our own words: theta^(-2i/head_dim), highest first.
    i = torch.arange(base.head_dim // 2, dtype=torch.float64)
    expected = base.rope_theta ** (-2 * i / base.head_dim)
    torch.testing.assert_close(plain.double(), expected, rtol=1e-6, atol=0)

    wavelength = 2 * math.pi / expected
    high = wavelength < scaling.original_max_position_embeddings / scaling.high_freq_factor
    low = wavelength > scaling.original_max_position_embeddings / scaling.low_freq_factor
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / scaling.factor)
    # The lowest frequency of all is slowed by exactly the factor; the highest is untouched.
    torch.testing.assert_close(scaled[-1], plain[-1] / scaling.factor)
    assert scaled[0] == plain[0]
    # In between, the frequencies are blended: strictly between the two extremes.
    assert (scaled[middle] < plain[middle]).all()
    assert (scaled[middle] > plain[middle] / scaling.factor).all()


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def test_forward_shape():
    model = build_real(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, SMALL.vocab_size)
    assert torch.isfinite(logits).all()


def test_forward_is_causal():
    model = build_real(SMALL, seed=3)
    torch.manual_seed(3)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    changed = tokens.clone()
    t = 5
    changed[:, t] = (tokens[:, t] + 1) % SMALL.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    # The change is seen from position t on.
    for position in range(t, tokens.shape[1]):
        assert not torch.allclose(after[:, position], before[:, position], atol=1e-4)


def test_gqa_flavor_runs():
    args = get_model_args("llama3", "debugmodel").with_seq_len(16)
    assert args.kv_heads < args.n_heads
    model = build_real(args)
    assert model.layers["0"].attention.wk.weight.shape == (args.kv_heads * args.head_dim, args.dim)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size)
    assert torch.isfinite(logits).all()


def test_gqa_equals_attention_with_repeated_kv_heads():
    assert SMALL.kv_heads < SMALL.n_heads
    model = build_real(SMALL, seed=4)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    # The same model with each key/value head copied to the query heads that share it.
    mha = build_real(dataclasses.replace(SMALL, n_kv_heads=None), seed=99)
    group, head_dim = SMALL.n_heads // SMALL.kv_heads, SMALL.head_dim
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            value = value.view(SMALL.kv_heads, head_dim, SMALL.dim).repeat_interleave(group, dim=0)
            value = value.reshape(SMALL.n_heads * head_dim, SMALL.dim)
        state[key] = value
    mha.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(mha(tokens), model(tokens), rtol=1e-5, atol=1e-5)


def grouped_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out in float64, query head h reading key/value head h // group."""
    group = q.shape[1] // k.shape[1]
    kv_head = torch.arange(q.shape[1]) // group
    q, k, v = q.double(), k.double()[:, kv_head], v.double()[:, kv_head]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    seq_len = q.shape[2]
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_causal_attention_matches_the_grouped_definition(dtype, kv_heads):
    # float32 with grouped heads takes the copied-heads path, bf16 SDPA's own grouping;
    # both must pair each query head with the same key/value head.
    generator = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, 12, 16, generator=generator).to(dtype)
    k, v = (torch.randn(2, kv_heads, 12, 16, generator=generator).to(dtype) for _ in range(2))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    # Plain causal attention, and the same through a boolean mask (context parallelism's path).
    for out in (attend(q, k, v), attend(q, k, v, mask=causal)):
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), grouped_attention_reference(q, k, v), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("precision", ["float32", "bf16_autocast"])
def test_float32_gives_sdpa_one_key_value_head_per_query_head(monkeypatch, precision):
    # Given fewer key/value heads than query heads (enable_gqa), SDPA on a GPU has no fused
    # kernel for float32 and falls back to one that stores every [seq, seq] score matrix.
    # Which kernel runs can only be seen on a GPU; here the arguments SDPA gets are checked.
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        calls.append((q.dtype, q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    assert SMALL.kv_heads < SMALL.n_heads
    model = build_real(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    bf16 = precision == "bf16_autocast"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(tokens)
    assert len(calls) == SMALL.n_layers
    if bf16:  # SDPA's own grouping, with no copies of k and v
        expected = (torch.bfloat16, SMALL.n_heads, SMALL.kv_heads, SMALL.kv_heads, True)
    else:
        expected = (torch.float32, SMALL.n_heads, SMALL.n_heads, SMALL.n_heads, False)
    assert calls == [expected] * SMALL.n_layers


# ---------------------------------------------------------------------------
# Initialisation and buffers
# ---------------------------------------------------------------------------


def test_init_weights_is_deterministic_per_seed():
    a, b, c = build_real(SMALL, seed=7), build_real(SMALL, seed=7), build_real(SMALL, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
        if key.endswith("norm.weight"):
            assert torch.equal(sa[key], sc[key]), key  # norms are ones whatever the seed
        else:
            assert not torch.equal(sa[key], sc[key]), key


def test_init_weights_overwrites_everything_and_norms_start_at_one():
    model = build_on_meta(SMALL)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(7.0)
    model.init_weights(seed=0)
    norms = [m.weight for name, m in model.named_modules() if name.endswith("norm")]
    assert len(norms) == 2 * SMALL.n_layers + 1
    for weight in norms:
        assert torch.equal(weight, torch.ones(SMALL.dim))
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            assert not (param == 7.0).any(), name
            assert 0 < param.std() < 1.5, name


def test_rope_buffers_are_real_and_not_in_state_dict():
    model = build_on_meta(SMALL)
    assert model.rope_cos.is_meta and model.rope_sin.is_meta
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert not model.rope_cos.is_meta and not model.rope_sin.is_meta
    assert model.rope_cos.device.type == "cpu"
    half = SMALL.head_dim // 2
    assert model.rope_cos.shape == model.rope_sin.shape == (SMALL.max_seq_len, half)
    positions = torch.arange(SMALL.max_seq_len, dtype=torch.float64)[:, None]
    angles = positions * SMALL.rope_theta ** (-2 * torch.arange(half, dtype=torch.float64) / SMALL.head_dim)
    torch.testing.assert_close(model.rope_cos.double(), angles.cos(), rtol=0, atol=1e-5)
    torch.testing.assert_close(model.rope_sin.double(), angles.sin(), rtol=0, atol=1e-5)
    assert {name for name, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    assert not any("rope" in key for key in model.state_dict())


# ---------------------------------------------------------------------------
# State-dict names and the Hugging Face adapter
# ---------------------------------------------------------------------------

TWO_LAYER = dataclasses.replace(SMALL, n_layers=2)

TITANLITE_KEYS_2_LAYERS = {
    "tok_embeddings.weight",
    "layers.0.attention.wq.weight",
    "layers.0.attention.wk.weight",
    "layers.0.attention.wv.weight",
    "layers.0.attention.wo.weight",
    "layers.0.feed_forward.w1.weight",
    "layers.0.feed_forward.w2.weight",
    "layers.0.feed_forward.w3.weight",
    "layers.0.attention_norm.weight",
    "layers.0.ffn_norm.weight",
    "layers.1.attention.wq.weight",
    "layers.1.attention.wk.weight",
    "layers.1.attention.wv.weight",
    "layers.1.attention.wo.weight",
    "layers.1.feed_forward.w1.weight",
    "layers.1.feed_forward.w2.weight",
    "layers.1.feed_forward.w3.weight",
    "layers.1.attention_norm.weight",
    "layers.1.ffn_norm.weight",
    "norm.weight",
    "output.weight",
}

HF_KEYS_2_LAYERS = {
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
}


def test_state_dict_keys_are_the_documented_names():
    model = build_on_meta(TWO_LAYER)
    keys = list(model.state_dict())
    assert len(keys) == len(set(keys))
    assert set(keys) == TITANLITE_KEYS_2_LAYERS


def test_adapter_round_trip_is_bit_identical_and_uses_hf_names():
    model = build_real(TWO_LAYER, seed=5)
    state = model.state_dict()
    adapter = LlamaStateDictAdapter(TWO_LAYER)
    hf_state = adapter.to_hf(state)
    assert set(hf_state) == HF_KEYS_2_LAYERS
    # Shapes follow HF: q_proj [heads*head_dim, hidden], k_proj [kv_heads*head_dim, hidden], ...
    assert hf_state["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert hf_state["lm_head.weight"].shape == (TWO_LAYER.vocab_size, TWO_LAYER.dim)
    # Only q and k are permuted; everything else is passed through unchanged.
    for key, value in state.items():
        hf_value = hf_state[adapter.to_hf_name(key)]
        if key.endswith(("wq.weight", "wk.weight")):
            assert not torch.equal(hf_value, value), key
            assert torch.equal(hf_value.sort(dim=0).values, value.sort(dim=0).values), key  # rows permuted
        else:
            assert torch.equal(hf_value, value), key
    back = adapter.from_hf(hf_state)
    assert set(back) == set(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def _hf_style_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Reference Hugging Face Llama RoPE on x [batch, seq, heads, head_dim]: the two halves
    (x[i], x[i + head_dim/2]) are rotated together, cos/sin repeated over both halves."""
    seq_len, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]

    def rotate_half(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    x64 = x.double()
    return (x64 * cos + rotate_half(x64) * sin).float()


def test_adapter_qk_permutation_matches_hf_rotate_half_rope():
    args = LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=11, max_seq_len=12, rope_theta=500.0)
    n_heads, kv_heads, head_dim, seq = args.n_heads, args.kv_heads, args.head_dim, args.max_seq_len
    assert head_dim == 16 and kv_heads < n_heads
    generator = torch.Generator().manual_seed(0)
    wq = torch.randn(n_heads * head_dim, args.dim, generator=generator) / 8
    wk = torch.randn(kv_heads * head_dim, args.dim, generator=generator) / 8
    x = torch.randn(1, seq, args.dim, generator=generator)

    adapter = LlamaStateDictAdapter(args)
    hf = adapter.to_hf({"layers.0.attention.wq.weight": wq, "layers.0.attention.wk.weight": wk})
    hf_wq = hf["model.layers.0.self_attn.q_proj.weight"]
    hf_wk = hf["model.layers.0.self_attn.k_proj.weight"]

    cos, sin = rope_tables(args)
    q_ours = apply_rope((x @ wq.T).view(1, seq, n_heads, head_dim), cos, sin)
    k_ours = apply_rope((x @ wk.T).view(1, seq, kv_heads, head_dim), cos, sin)
    q_hf = _hf_style_rope((x @ hf_wq.T).view(1, seq, n_heads, head_dim), args.rope_theta)
    k_hf = _hf_style_rope((x @ hf_wk.T).view(1, seq, kv_heads, head_dim), args.rope_theta)

    # Head-dim layouts: our pair i is (2i, 2i+1), HF's is (i, i + head_dim/2).
    half = head_dim // 2
    for ours, theirs in ((q_ours, q_hf), (k_ours, k_hf)):
        torch.testing.assert_close(theirs[..., :half], ours[..., 0::2], rtol=0, atol=1e-5)
        torch.testing.assert_close(theirs[..., half:], ours[..., 1::2], rtol=0, atol=1e-5)

    # Attention scores, query head h against its shared key head h // group, all positions.
    group = n_heads // kv_heads
    scores_ours = torch.einsum("bihd,bjhd->bhij", q_ours, k_ours.repeat_interleave(group, dim=2))
    scores_hf = torch.einsum("bihd,bjhd->bhij", q_hf, k_hf.repeat_interleave(group, dim=2))
    assert scores_ours.abs().max() > 1.0  # the comparison below is not between near-zeros
    torch.testing.assert_close(scores_hf, scores_ours, rtol=0, atol=1e-5)

    # from_hf undoes it exactly.
    back = adapter.from_hf(hf)
    assert torch.equal(back["layers.0.attention.wq.weight"], wq)
    assert torch.equal(back["layers.0.attention.wk.weight"], wk)


@pytest.mark.parametrize(
    "name,flavor,expected",
    [
        ("llama2", "7B", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                              rope_theta=10000.0)),
        ("llama3", "8B", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                              rope_theta=500000.0)),
        ("llama3", "70B", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                               rope_theta=500000.0)),
        ("llama3", "405B", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                                rope_theta=500000.0)),
    ],
    ids=["llama2-7B", "llama3-8B", "llama3-70B", "llama3-405B"],
)  # fmt: skip
def test_hf_config(name, flavor, expected):
    config = LlamaStateDictAdapter(get_model_args(name, flavor)).hf_config()
    for key, value in expected.items():
        assert config[key] == value, key
        assert type(config[key]) is type(value), key
    assert config["head_dim"] == expected["hidden_size"] // expected["num_attention_heads"]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    if flavor == "405B":
        assert config["rope_scaling"] == {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }  # fmt: skip
    else:
        assert "rope_scaling" not in config
