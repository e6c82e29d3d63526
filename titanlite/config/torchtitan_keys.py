"""torchtitan 0.2 TOML keys that titanlite reads differently or not at all.

A torchtitan 0.2 config file should load here after changing at most `[model] name`.
The parser consults these tables (through torchtitan_compat.py) only for names titanlite
itself does not define, so a titanlite key always wins:

- RENAMED: torchtitan's name -> titanlite's name. The value is applied to titanlite's
  key, with one warning line.
- TORCHTITAN_ONLY: keys titanlite does not implement, each with torchtitan 0.2's default
  and a verdict:
    IGNORE            no value of it changes what titanlite trains (logging switches,
                      settings of a feature that is off unless another key turns it on):
                      one warning line, whatever the value.
    IGNORE_IF_DEFAULT harmless only at torchtitan's default (or a listed neutral value):
                      one warning line there; any other value is a ConfigError naming the
                      key, the value and what to do instead.
- SHARED_KEYS: torchtitan 0.2 keys titanlite has under the same name (see
  torchtitan_compat.md for the differences in defaults and accepted values).

The key list follows torchtitan's `torchtitan/config/job_config.py` as of the 0.2 era
(the layout with `[quantize.linear.float8]`, `[debug]` and `hf_assets_path`); the older
and newer spellings of a few `[job]` keys (`print_args`, `print_config`, ...) are all
listed, since files written for either circulate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Verdict = Literal["IGNORE", "IGNORE_IF_DEFAULT"]

# The sections of torchtitan 0.2's JobConfig, in its order.
TORCHTITAN_SECTIONS = (
    "job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training",
    "parallelism", "checkpoint", "activation_checkpoint", "compile", "quantize", "comm",
    "memory_estimation", "fault_tolerance", "experimental", "validation", "debug",
)  # fmt: skip


@dataclass(frozen=True)
class TorchtitanKey:
    default: Any
    """torchtitan 0.2's default (None: unset)."""

    verdict: Verdict
    advice: str = ""
    """For IGNORE_IF_DEFAULT: what to do instead, shown in the error."""

    neutral: tuple = field(default=())
    """Values besides the default that are harmless too."""

    def is_harmless(self, value: Any) -> bool:
        if self.verdict == "IGNORE":
            return True
        return any(same_value(value, allowed) for allowed in (self.default, *self.neutral))


def same_value(a: Any, b: Any) -> bool:
    """Equality that keeps true apart from 1 and 1.0 apart from "1"."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _ignore(default: Any) -> TorchtitanKey:
    return TorchtitanKey(default, "IGNORE")


def _only_default(default: Any, advice: str, *neutral: Any) -> TorchtitanKey:
    return TorchtitanKey(default, "IGNORE_IF_DEFAULT", advice, tuple(neutral))


RENAMED: dict[str, str] = {
    # Deprecated in torchtitan 0.2 itself in favour of hf_assets_path; titanlite reads
    # only tokenizer.json (and tokenizer_config.json) from that folder.
    "model.tokenizer_path": "model.hf_assets_path",
    # torchtitan's older spelling of print_config.
    "job.print_args": "job.print_config",
}

TORCHTITAN_ONLY: dict[str, TorchtitanKey] = {
    # [job]
    "job.use_for_integration_test": _ignore(False),
    "job.save_config_file": _ignore(None),
    "job.custom_config_module": _only_default("", "titanlite cannot extend its config from a module; remove it"),
    # [profiling]
    "profiling.profiler_active": _ignore(1),
    "profiling.profiler_warmup": _ignore(3),
    # [model]
    "model.print_after_conversion": _ignore(False),
    # [optimizer]
    "optimizer.early_step_in_backward": _only_default(
        False, "titanlite steps the optimizer after the backward (with gradient clipping); remove it"
    ),
    # [training]
    "training.dtype": _only_default(
        "float32", 'titanlite keeps float32 master weights; use training.mixed_precision_param = "bfloat16"'
    ),
    "training.gc_debug": _ignore(False),
    "training.dataloader.num_workers": _ignore(0),
    "training.dataloader.persistent_workers": _ignore(False),
    "training.dataloader.pin_memory": _ignore(False),
    "training.dataloader.prefetch_factor": _ignore(None),
    # [parallelism]
    "parallelism.enable_compiled_autograd": _ignore(False),
    "parallelism.pipeline_parallel_split_points": _only_default(
        [], "list the stages' modules in parallelism.module_fqns_per_model_part instead"
    ),
    "parallelism.pipeline_parallel_schedule_csv": _only_default(
        "", "titanlite runs the built-in schedules only; name one in parallelism.pipeline_parallel_schedule"
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": _ignore(True),
    "parallelism.expert_tensor_parallel_degree": _ignore(1),
    "parallelism.expert_parallel_comm_backend": _ignore("standard"),
    # [checkpoint]
    "checkpoint.enable_ft_dataloader_checkpoints": _ignore(True),
    "checkpoint.initial_load_in_hf_quantized": _only_default(
        False, "titanlite reads unquantized Hugging Face weights only; dequantize the folder first"
    ),
    "checkpoint.last_save_in_hf": _only_default(
        False, "titanlite saves DCP checkpoints; export with scripts/convert_dcp_to_hf.py after training"
    ),
    "checkpoint.enable_first_step_checkpoint": _ignore(False),
    "checkpoint.create_seed_checkpoint": _only_default(
        False, "titanlite has no seed-checkpoint mode (its initialisation is the same for every layout); remove it"
    ),
    "checkpoint.load_only": _only_default(
        False,
        "titanlite always saves when checkpoint.enable is set; "
        "use checkpoint.initial_load_path without checkpoint.enable",
    ),
    # [activation_checkpoint]
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": _ignore(["moe.router.gate"]),
    "activation_checkpoint.early_stop": _ignore(False),
    "activation_checkpoint.memory_budget": _ignore(0.5),
    "activation_checkpoint.visualize_memory_budget_pareto": _ignore(False),
    "activation_checkpoint.preserve_rng_state": _ignore(False),
    "activation_checkpoint.determinism_check": _ignore("default"),
    "activation_checkpoint.debug": _ignore(False),
    # [compile]
    "compile.backend": _only_default(
        "inductor", "titanlite compiles with torch.compile's default backend (inductor); remove it"
    ),
    # [quantize]: each table is read only with its converter in model.converters; titanlite has
    # float8's for the linear layers ([quantize.linear.float8], its own section) and refuses
    # the MX and grouped-GEMM converters (config/quantize.py).
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": _ignore("triton"),
    "quantize.linear.mx.recipe_name": _ignore("mxfp8_cublas"),
    "quantize.linear.mx.filter_fqns": _ignore(["output"]),
    "quantize.grouped_mm.float8.fqns": _ignore([]),
    "quantize.grouped_mm.mx.recipe_name": _ignore("mxfp8"),
    "quantize.grouped_mm.mx.fqns": _ignore([]),
    # [comm]
    "comm.mode": _only_default(
        "default", "titanlite has no fake or local-tensor backends; use --job.validate_only for a dry run"
    ),
    # [memory_estimation]
    "memory_estimation.enable": _only_default(
        False, "titanlite estimates memory before a run with scripts/estimate.py; remove it"
    ),
    "memory_estimation.disable_fake_mode": _ignore(False),
    # [experimental]
    "experimental.custom_import": _only_default(
        "", "titanlite has no import hook; register a model in titanlite/models instead"
    ),
    "experimental.custom_args_module": _only_default("", "titanlite cannot extend its config from a module; remove it"),
    # [validation]
    "validation.dataloader.num_workers": _ignore(0),
    "validation.dataloader.persistent_workers": _ignore(False),
    "validation.dataloader.pin_memory": _ignore(False),
    "validation.dataloader.prefetch_factor": _ignore(None),
    # [debug]
    "debug.deterministic_warn_only": _ignore(False),
    "debug.moe_force_load_balance": _ignore(False),
}

# torchtitan 0.2 keys titanlite has under the same name.
SHARED_KEYS = (
    "job.config_file", "job.dump_folder", "job.description", "job.print_config",
    "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.profile_freq",
    "profiling.enable_memory_snapshot", "profiling.save_memory_snapshot_folder",
    "metrics.log_freq", "metrics.enable_tensorboard", "metrics.disable_color_printing",
    "metrics.save_tb_folder", "metrics.save_for_all_ranks", "metrics.enable_wandb",
    "model.name", "model.flavor", "model.hf_assets_path", "model.converters",
    "optimizer.name", "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps",
    "optimizer.weight_decay", "optimizer.implementation",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor",
    "training.dataset", "training.dataset_path", "training.local_batch_size",
    "training.global_batch_size", "training.seq_len", "training.max_norm", "training.steps",
    "training.enable_cpu_offload", "training.mixed_precision_param",
    "training.mixed_precision_reduce", "training.gc_freq",
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
    "parallelism.disable_loss_parallel", "parallelism.enable_async_tensor_parallel",
    "parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_microbatch_size", "parallelism.pipeline_parallel_layers_per_stage",
    "parallelism.pipeline_parallel_first_stage_less_layers", "parallelism.pipeline_parallel_last_stage_less_layers",
    "parallelism.module_fqns_per_model_part", "parallelism.expert_parallel_degree",
    "parallelism.context_parallel_degree", "parallelism.context_parallel_load_balancer",
    "parallelism.context_parallel_rotate_method",
    "checkpoint.enable", "checkpoint.folder", "checkpoint.interval",
    "checkpoint.initial_load_path", "checkpoint.initial_load_model_only",
    "checkpoint.initial_load_in_hf", "checkpoint.last_save_model_only",
    "checkpoint.export_dtype", "checkpoint.async_mode", "checkpoint.keep_latest_k",
    "checkpoint.load_step", "checkpoint.exclude_from_loading",
    "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
    "compile.enable", "compile.components",
    "quantize.linear.float8.recipe_name", "quantize.linear.float8.filter_fqns", "quantize.linear.float8.emulate",
    "quantize.linear.float8.enable_fsdp_float8_all_gather",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "comm.init_timeout_seconds", "comm.train_timeout_seconds", "comm.trace_buf_size",
    "comm.save_traces_folder", "comm.save_traces_file_prefix",
    "validation.enable", "validation.dataset", "validation.dataset_path",
    "validation.local_batch_size", "validation.seq_len", "validation.freq", "validation.steps",
    "debug.seed", "debug.deterministic",
    "fault_tolerance.enable", "fault_tolerance.replica_id", "fault_tolerance.group_size",
    "fault_tolerance.min_replica_size", "fault_tolerance.process_group",
    "fault_tolerance.process_group_timeout_ms", "fault_tolerance.semi_sync_method",
)  # fmt: skip

ALL_KEYS = frozenset(SHARED_KEYS) | frozenset(TORCHTITAN_ONLY) | frozenset(RENAMED)
