"""Print a prompt and a model's continuation of it.

    python scripts/generate.py --checkpoint PATH --prompt TEXT --max_new_tokens N
        [--temperature T] [--top_k K] [--seed S] [--ema] [--hf_assets_path DIR]
        [--device cpu] [--dtype float32]

PATH is a step-N checkpoint folder (full or model-only) or a Hugging Face folder. The
tokenizer is --hf_assets_path's tokenizer.json; without it, the one the checkpoint names
(the training run's, or a Hugging Face folder's own tokenizer.json), else the byte
tokenizer. The prompt is preceded by the
tokenizer's BOS token when it has one, as in training. Temperature 0 (the default) is
greedy decoding.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROG = "generate"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", required=True, help="a step-N folder (a path or a URL: s3://...) or a Hugging Face folder"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max_new_tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ema", action="store_true", help="use the EMA weights (ema.*) of a step-N folder")
    parser.add_argument("--hf_assets_path", default=None, help="a tokenizer.json or its folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 0:
        print(f"{PROG}: error: --max_new_tokens {args.max_new_tokens} must be >= 0", file=sys.stderr)
        return 2
    if args.temperature < 0:
        print(f"{PROG}: error: --temperature {args.temperature} must be >= 0", file=sys.stderr)
        return 2
    if args.top_k is not None and args.top_k < 1:
        print(f"{PROG}: error: --top_k {args.top_k} must be >= 1", file=sys.stderr)
        return 2
    from titanlite.checkpoint.load import load_model
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.dtypes import DTYPES
    from titanlite.models.generate import generate

    checkpoint = args.checkpoint  # a path or a URL (s3://...), which a Path would mangle
    try:
        model, description = load_model(checkpoint, device=args.device, dtype=DTYPES[args.dtype], use_ema=args.ema)
        tokenizer = build_tokenizer(args.hf_assets_path or description.tokenizer_path)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    vocab = description.real_vocab_size  # the rows past it pad the embedding: never tokens
    prompt_ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(args.prompt)
    if not prompt_ids:
        print(f"{PROG}: error: the prompt is empty and the tokenizer has no BOS token", file=sys.stderr)
        return 2
    if max(prompt_ids) >= vocab:
        print(
            f"{PROG}: error: {checkpoint}: the tokenizer gives id {max(prompt_ids)}, beyond the model's "
            f"vocabulary of {vocab} (pass the right --hf_assets_path)",
            file=sys.stderr,
        )
        return 2
    new_ids = generate(
        model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        eos_id=tokenizer.eos_id,
        vocab_size=vocab,
    )
    print(args.prompt + tokenizer.decode(new_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
