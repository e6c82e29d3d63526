"""Export a titanlite checkpoint (a step-N folder) as a Hugging Face folder of its model's
class (--help lists each model's).

    python scripts/convert_dcp_to_hf.py CHECKPOINT_DIR OUTPUT_DIR [--dtype bfloat16]
        [--max-shard-size 5GB] [--ema] [--tokenizer PATH] [--push-to-hub REPO_ID]

The run's tokenizer (recorded in the checkpoint; the byte tokenizer when none is) is
written beside the weights so that AutoTokenizer adds the BOS training added, and its
BOS/EOS ids go into config.json and generation_config.json; --tokenizer names another
tokenizer.json (or its folder), e.g. when the recorded one has moved. A checkpoint of
any layout (one process, FSDP, TP) is read in one process.

--push-to-hub uploads OUTPUT_DIR with huggingface_hub; the token comes from the
environment (HF_TOKEN) or huggingface_hub's login, never from the command line.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "convert_dcp_to_hf"


def classes_by_model() -> str:
    """'LlamaForCausalLM (llama2, llama3), ...': the classes the registry's models export as."""
    from titanlite.checkpoint.hf_export import exported_classes

    models: dict[str, list[str]] = {}
    for name, classes in exported_classes().items():
        models.setdefault(" or ".join(classes), []).append(name)
    return ", ".join(f"{classes} ({', '.join(names)})" for classes, names in models.items())


def build_parser() -> argparse.ArgumentParser:
    summary = (
        "Export a titanlite checkpoint (a step-N folder) as a Hugging Face folder of its model's class: "
        f"{classes_by_model()}."
    )
    parser = argparse.ArgumentParser(prog=PROG, description=summary)
    parser.add_argument("checkpoint_dir", help="a step-N checkpoint folder: a path or a URL (s3://..., gs://...)")
    parser.add_argument("output_dir", help="the Hugging Face folder to create (must not exist or be empty)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--max-shard-size", default=None, help="e.g. 5GB: write sharded files and an index")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (ema.*) instead of the model's")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="a tokenizer.json or its folder, instead of the one the run recorded",
    )
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the folder to this model repo")
    return parser


def push_to_hub(folder: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi

    HfApi().upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model")


def _log_to_stdout() -> None:
    """The export's progress lines go to stdout, so that stderr holds only an error. Set
    up only when run as a script: a caller's own logging is left alone."""
    logging.basicConfig(stream=sys.stdout, format=f"{PROG}: %(message)s")
    logging.getLogger("titanlite").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from titanlite.checkpoint.hf_export import export_to_hf

    try:
        out = export_to_hf(
            args.checkpoint_dir,
            args.output_dir,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            use_ema=args.ema,
            tokenizer=args.tokenizer,
        )
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {out}")
    if args.push_to_hub:
        try:
            push_to_hub(out, args.push_to_hub)
        except Exception as error:  # network, permissions, a missing token
            print(
                f"{PROG}: error: uploading {out} to {args.push_to_hub} failed ({type(error).__name__})", file=sys.stderr
            )
            return 1
        print(f"{PROG}: uploaded {out} to {args.push_to_hub}")
    return 0


if __name__ == "__main__":
    _log_to_stdout()
    sys.exit(main())
