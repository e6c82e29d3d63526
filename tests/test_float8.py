"""Float8 training through torchao, in one process: its config keys (torchtitan 0.2's), which
linear layers it converts and why it leaves the others, what the conversion keeps (the
state dict), the checks before a run (torchao, a float8 GPU or emulation), float8's TP
styles, and what the memory estimate makes of it (the step time's is in test_estimate_time).

The float8 runs on several ranks (FSDP 2, TP 2, float8 all-gathers, per-op AC) are jobs of
test_parity's launch, and a float8 checkpoint resumed without float8 and exported is in
test_checkpoint_resume's."""

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from tests.helpers import TINY, tiny_args
from titanlite.config import ConfigError, format_help, parse_args, parse_args_with_warnings, to_toml
from titanlite.estimate import estimate_memory
from titanlite.models.llama import LLAMA3_FLAVORS, Transformer
from titanlite.parallel import ParallelDims
from titanlite.parallel.float8_styles import float8_styles
from titanlite.plan import meta_model, run_model_args, unused_layout_keys
from titanlite.quantize import convert_to_float8, float8_layer_choice, float8_run_problem

torchao_float8 = pytest.importorskip("torchao.float8")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]
EVERY_LAYER = ["--quantize.linear.float8.skip_small_layers", "false"]
ALL_GATHER = "--quantize.linear.float8.enable_fsdp_float8_all_gather"


def meta(args) -> nn.Module:
    with torch.device("meta"):
        return Transformer(args)


def converted(argv: list[str], args=TINY, fsdp: bool = False) -> tuple[nn.Module, list[str]]:
    model = meta(args)
    lines = convert_to_float8(model, parse_args(argv), fsdp=fsdp)
    return model, lines


# --- the keys --------------------------------------------------------------------------------


def test_torchtitans_float8_table_is_read_without_a_warning(tmp_path):
    path = tmp_path / "float8.toml"
    path.write_text(
        '[model]\nconverters = ["quantize.linear.float8"]\n'
        '[quantize.linear.float8]\nrecipe_name = "rowwise"\nfilter_fqns = ["output", "wk"]\nemulate = true\n'
    )
    config, warnings = parse_args_with_warnings(["--job.config_file", str(path)])
    float8 = config.quantize.linear.float8
    assert config.model.converters == ["quantize.linear.float8"]
    assert (float8.recipe_name, float8.filter_fqns, float8.emulate) == ("rowwise", ["output", "wk"], True)
    assert warnings == []
    # The resolved config writes the section where torchtitan has it, and reads back equal.
    text = to_toml(config)
    assert '[quantize.linear.float8]\nrecipe_name = "rowwise"\n' in text
    saved = tmp_path / "resolved.toml"
    saved.write_text(text)
    config.job.config_file = str(saved)  # the only field that records where it came from
    assert parse_args(["--job.config_file", str(saved)]) == config


def test_the_keys_on_the_command_line_and_in_help():
    config = parse_args([*FLOAT8, "--quantize.linear.float8.filter_fqns", "output,w2", *EVERY_LAYER])
    float8 = config.quantize.linear.float8
    assert float8.emulate and not float8.skip_small_layers and float8.filter_fqns == ["output", "w2"]
    text = format_help()
    assert "[quantize.linear.float8]" in text and "--quantize.linear.float8.recipe_name  (one of tensorwise|" in text
    assert "--model.converters  (list of str, default: )" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.converters", "mx"], r"model\.converters: 'mx' is not a converter titanlite has"),
        (
            ["--model.converters", "float8,quantize.grouped_mm.float8"],
            r"'quantize\.grouped_mm\.float8' \(float8 MoE experts\) is not supported: torchao 0\.18's",
        ),
        (["--quantize.linear.float8.recipe_name", "rowwize"], r"expects one of tensorwise\|rowwise\|rowwise_with_gw"),
        (
            [*FLOAT8, "--quantize.linear.float8.recipe_name", "rowwise", ALL_GATHER],
            r"enable_fsdp_float8_all_gather needs quantize\.linear\.float8\.recipe_name = \"tensorwise\"",
        ),
        (
            [*FLOAT8, "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"],
            r"precompute_float8_dynamic_scale_for_fsdp needs quantize\.linear\.float8\.enable_fsdp_float8_all_gather",
        ),
    ],
)  # fmt: skip
def test_keys_that_do_not_go_together_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_args(argv)
    assert "\n" not in str(error.value)


def test_an_unknown_key_in_the_table_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"did you mean '--quantize\.linear\.float8\.emulate'"):
        parse_args(["--quantize.linear.float8.emulat"])


# --- which layers -----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_size_rule_is_torchaos_own(recipe):
    """float8_layer_choice keeps torchao's automatic filter for the recipe, shape for shape."""
    torchaos = torchao_float8._auto_filter_for_recipe(recipe, filter_fqns=[])
    float8 = parse_args(["--quantize.linear.float8.recipe_name", recipe]).quantize.linear.float8
    sizes = (8, 16, 1000, 1024, 1040, 2048, 2064, 4096, 4112, 8192)
    layers = nn.ModuleDict({f"l{i}_{j}": nn.Linear(i, j, bias=False, device="meta") for i in sizes for j in sizes})
    choice = float8_layer_choice(layers, float8)
    for name, layer in layers.items():
        assert (name in choice.converted) == torchaos(layer, name), name
    assert len(choice.converted) > 10 and len(choice.skipped) > 10


def test_the_debug_model_is_too_small_for_float8_on_a_gpu():
    config = parse_args(["--model.converters", "float8"])
    model = meta(LLAMA3_FLAVORS["debugmodel"])
    choice = float8_layer_choice(model, config.quantize.linear.float8)
    assert choice.converted == {}
    assert choice.skipped["output"] == "named in quantize.linear.float8.filter_fqns"
    assert choice.skipped["layers.0.feed_forward.w2"] == "below torchao's tensorwise size thresholds"


def test_the_start_up_lines_name_what_was_converted_and_why_the_rest_was_not():
    model, lines = converted([*FLOAT8, *EVERY_LAYER])
    n = TINY.n_layers
    blocks = "layers.*.attention.wq x{n}, layers.*.attention.wk x{n}, layers.*.attention.wv x{n}"
    assert lines[0] == (
        f"float8 (tensorwise, emulated): {7 * n} of {7 * n + 1} linear layers converted: "
        + blocks.format(n=n)
        + f", layers.*.attention.wo x{n}, layers.*.feed_forward.w1 x{n}, layers.*.feed_forward.w2 x{n}, "
        f"layers.*.feed_forward.w3 x{n}"
    )
    assert lines[1:] == ["float8: 1 left in high precision (named in quantize.linear.float8.filter_fqns): output"]
    swapped = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    assert len(swapped) == 7 * n and "output" not in swapped


def test_a_tied_weight_stays_in_high_precision():
    args = run_model_args(parse_args(["--model.name", "qwen3", "--model.flavor", "tiny_tied"]))
    config = parse_args(["--model.name", "qwen3", "--model.flavor", "tiny_tied", *FLOAT8, *EVERY_LAYER])
    config.quantize.linear.float8.filter_fqns = []
    choice = float8_layer_choice(meta_model(config, args), config.quantize.linear.float8)
    assert choice.skipped == {"output": "weight tied to another module"}


def test_without_float8_nothing_changes():
    model, lines = converted(tiny_args())
    assert lines == [] and not any(isinstance(m, Float8Linear) for m in model.modules())


def test_the_state_dict_keeps_its_names_shapes_and_dtypes():
    """A Float8Linear holds the Linear's own weight: a float8 checkpoint is a plain one."""
    plain = meta(TINY).state_dict()
    for all_gather in ([], [ALL_GATHER]):
        model, _ = converted([*FLOAT8, *EVERY_LAYER, *all_gather], fsdp=True)
        after = model.state_dict()
        assert list(after) == list(plain)
        for name, tensor in plain.items():
            assert (after[name].shape, after[name].dtype) == (tensor.shape, tensor.dtype), name
    model = meta(TINY)
    weight = model.layers["0"].attention.wq.weight
    convert_to_float8(model, parse_args([*FLOAT8, *EVERY_LAYER]), fsdp=False)
    assert model.layers["0"].attention.wq.weight is weight


def test_the_fsdp_keys_warn_in_a_layout_without_fsdp():
    warnings = unused_layout_keys(parse_args([*FLOAT8, ALL_GATHER]), ParallelDims.resolve(1, -1, 1))
    assert len(warnings) == 1, warnings
    assert "quantize.linear.float8.enable_fsdp_float8_all_gather = true has no effect in this layout" in warnings[0]
    assert unused_layout_keys(parse_args([*FLOAT8, ALL_GATHER]), ParallelDims.resolve(1, -1, 2)) == []


# --- before a run: torchao and the device ------------------------------------------------------


def test_a_run_without_torchao_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    problem = float8_run_problem(parse_args(FLOAT8))
    assert (
        problem == "model.converters = ['float8'] needs torchao, which is not installed: pip install titanlite[float8]"
    )
    assert float8_run_problem(parse_args([])) is None  # no float8, no torchao needed


def test_a_run_without_torchao_stops_with_that_line(monkeypatch, tmp_path, capsys, quiet_process_state):
    from titanlite.train import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    dump = tmp_path / "dump"
    assert main([*tiny_args({"training.steps": 1, "job.dump_folder": str(dump)}), *FLOAT8]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [
        "titanlite: config error: model.converters = ['float8'] needs torchao, which is not installed: "
        "pip install titanlite[float8]"
    ]
    assert not dump.exists()


def test_the_device_check(monkeypatch):
    config = parse_args(["--model.converters", "float8"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "found no CUDA GPU (the CPU): set quantize.linear.float8.emulate = true" in float8_run_problem(config)
    assert float8_run_problem(parse_args(FLOAT8)) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    problem = float8_run_problem(config)
    assert (
        "compute capability 8.9 or newer" in problem
        and "found NVIDIA A100-SXM4-80GB (compute capability 8.0)" in problem
    )
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert float8_run_problem(config) is None


# --- tensor parallelism's styles -----------------------------------------------------------------


def block_plan() -> dict:
    return {
        "attention": PrepareModuleInput(input_layouts=(None, None, None), desired_input_layouts=(None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(use_local_output=False),
    }


# float8_styles reads only the mesh's device type: float8 collectives need NCCL.
GPU_MESH, CPU_MESH = SimpleNamespace(device_type="cuda"), SimpleNamespace(device_type="cpu")


def style_names(argv: list[str], mesh=GPU_MESH) -> dict[str, str]:
    model, _ = converted(argv)
    return {name: type(style).__name__ for name, style in float8_styles(model.layers["0"], block_plan(), mesh).items()}


def test_tensorwise_layers_take_float8_styles():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    names = style_names([*FLOAT8, *EVERY_LAYER])
    assert names == {
        "attention": "PrepareFloat8ModuleInput",
        **{f"attention.{w}": "Float8ColwiseParallel" for w in ("wq", "wk", "wv")},
        "attention.wo": "Float8RowwiseParallel",
        "feed_forward.w1": "Float8ColwiseParallel",
    }
    model, _ = converted([*FLOAT8, *EVERY_LAYER])
    w1 = float8_styles(model.layers["0"], block_plan(), GPU_MESH)["feed_forward.w1"]
    assert isinstance(w1, Float8ColwiseParallel) and w1.use_local_output is False  # the layouts carried over


def test_rowwise_and_plain_layers_and_cpu_meshes_keep_the_plain_styles():
    plain = {"PrepareModuleInput", "ColwiseParallel", "RowwiseParallel"}
    assert (
        set(style_names([*FLOAT8, *EVERY_LAYER, "--quantize.linear.float8.recipe_name", "rowwise"]).values()) == plain
    )
    # gloo cannot send float8 tensors: on the CPU the layers gather in high precision and cast.
    assert set(style_names([*FLOAT8, *EVERY_LAYER], CPU_MESH).values()) == plain
    # wk left in high precision: the attention input is no longer cast once for all three readers.
    names = style_names([*FLOAT8, *EVERY_LAYER, "--quantize.linear.float8.filter_fqns", "output,wk"])
    assert names["attention"] == "PrepareModuleInput" and names["attention.wk"] == "ColwiseParallel"
    assert names["attention.wq"] == "Float8ColwiseParallel"


# --- the estimators -----------------------------------------------------------------------------


def test_the_memory_estimate_of_a_float8_run_is_the_bf16_runs():
    """torchao keeps the high-precision input and weight for backward: float8 saves nothing there."""
    base = tiny_args({"training.mixed_precision_param": "bfloat16"})
    bf16 = estimate_memory(parse_args(base), world_size=2, device_type="cpu")
    float8 = estimate_memory(parse_args([*base, *FLOAT8, *EVERY_LAYER]), world_size=2, device_type="cpu")
    assert float8.peak_bytes == bf16.peak_bytes
    assert any("float8 is simulated in bf16" in note for note in float8.notes)
