"""The run's tokenizer as Hugging Face files: AutoTokenizer on the exported folder encodes
a text exactly as training began each document, BOS (when the tokenizer has one) and the
text's ids, no EOS.

Training frames every document as [BOS] + ids + [EOS] with ids encoded without special
tokens, and scripts/generate.py gives the model [BOS] + the prompt's ids. A tokenizer.json
says what to add around a text in its post_processor, which the training run never used,
so the export writes it: a TemplateProcessing that adds the BOS training adds, and
nothing else (a ByteLevel post-processor, which only trims offsets, is kept).
tokenizer_config.json gets add_bos_token / add_eos_token to match: transformers 5 rebuilds
the post-processor from them when they are present (TokenizersBackend.update_post_processor),
and they name the tokens, so bos_token_id and eos_token_id are the ones training used.

A byte-tokenizer run gets a tokenizer.json that gives the same ids as ByteTokenizer: the
tokenizers library's ByteLevel pre-tokenizer turns each UTF-8 byte into one character, a
BPE model without merges maps that character to the byte's value, and <s> (256) and </s>
(257) are added as special tokens. split_special_tokens keeps a literal "<s>" in a text
as its bytes, as ByteTokenizer does.
"""

import json
import logging
import shutil
from pathlib import Path

from titanlite.data.tokenizer import ByteTokenizer, HFTokenizer

try:  # a dependency of titanlite; an environment without it cannot export (require_tokenizers)
    import tokenizers
except ImportError:
    tokenizers = None

logger = logging.getLogger("titanlite")

# Files of a Hugging Face tokenizer that are copied as they are when they sit beside tokenizer.json.
COPIED_COMPANIONS = ("special_tokens_map.json", "tokenizer.model")
BYTE_SPECIAL_TOKENS = ("<s>", "</s>")  # ids 256 and 257, ByteTokenizer's BOS and EOS


def require_tokenizers() -> None:
    """Refuse an export that could not write the run's tokenizer: a folder without one makes
    transformers fail on empty ids. A ValueError, raised before anything is written."""
    if tokenizers is None:
        raise ValueError(
            "the export writes the run's tokenizer with the 'tokenizers' package, which is not importable "
            "(it is a dependency of titanlite: pip install -e . or pip install tokenizers)"
        )


def byte_symbols() -> list[str]:
    """The character that the ByteLevel pre-tokenizer writes for each byte value: the
    printable Latin-1 bytes stand for themselves, every other byte takes the next code
    point from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, next_free = [], 256
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(next_free))
            next_free += 1
    return symbols


def is_byte_tokenizer(tokenizer_json: str | Path) -> bool:
    """Whether a tokenizer.json is the byte tokenizer as this module exports it: its 256
    byte symbols in byte order, then <s> and </s>. (An import keeps such a folder's rows, as
    a byte-tokenizer run keeps its flavor's.)"""
    content = json.loads(Path(tokenizer_json).read_text())
    byte_vocabulary = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    added = [token.get("content") for token in content.get("added_tokens", [])]
    return content.get("model", {}).get("vocab") == byte_vocabulary and added == list(BYTE_SPECIAL_TOKENS)


def byte_tokenizer():
    """A tokenizers-library Tokenizer with ByteTokenizer's ids (no post-processor yet)."""
    vocabulary = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    # Added after the 256 bytes, in order: ids 256 and 257.
    specials = [tokenizers.AddedToken(token, special=True, normalized=False) for token in BYTE_SPECIAL_TOKENS]
    tokenizer.add_special_tokens(specials)
    return tokenizer


def _frame_as_training(tokenizer, bos_id: int | None) -> None:
    """Give `tokenizer` the post-processor that adds what training adds before a text."""
    processors = tokenizers.processors
    kept = [tokenizer.post_processor] if isinstance(tokenizer.post_processor, processors.ByteLevel) else []
    if bos_id is not None:
        bos = tokenizer.id_to_token(bos_id)
        # The pair form is the one transformers builds from add_bos_token, so both agree.
        kept.append(
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
            )
        )
    tokenizer.post_processor = processors.Sequence(kept) if len(kept) > 1 else (kept[0] if kept else None)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def _tokenizer_config(original: dict, tokenizer, bos_id: int | None, eos_id: int | None) -> dict:
    config = dict(original)
    config.update(add_bos_token=bos_id is not None, add_eos_token=False)
    for key, token_id in (("bos_token", bos_id), ("eos_token", eos_id)):
        if token_id is not None:
            config[key] = tokenizer.id_to_token(token_id)
    return config


def special_ids(tokenizer_json: Path | None) -> dict[str, int]:
    """bos_token_id / eos_token_id as training found them (HFTokenizer's rules; the byte
    tokenizer's for None), the ones it has."""
    trained = ByteTokenizer() if tokenizer_json is None else HFTokenizer(str(tokenizer_json))
    ids = {"bos_token_id": trained.bos_id, "eos_token_id": trained.eos_id}
    return {key: value for key, value in ids.items() if value is not None}


def write_hf_tokenizer(tokenizer_json: Path | None, folder: Path) -> None:
    """Write the run's tokenizer into `folder` (tokenizer_json None: the byte tokenizer)."""
    ids = special_ids(tokenizer_json)
    bos_id, eos_id = ids.get("bos_token_id"), ids.get("eos_token_id")
    if tokenizer_json is None:
        tokenizer, config = byte_tokenizer(), {"split_special_tokens": True}
        saved = json.loads(tokenizer.to_str())
        logger.info("exported the byte tokenizer as tokenizer.json")
    else:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        config_path = tokenizer_json.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        # The file as it was, but for its post_processor: what the library writes back
        # may differ in form from what it read.
        saved = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        for name in COPIED_COMPANIONS:
            if (tokenizer_json.parent / name).is_file():
                shutil.copyfile(tokenizer_json.parent / name, folder / name)
        logger.info(f"exported the tokenizer from {tokenizer_json}")
    _frame_as_training(tokenizer, bos_id)
    saved["post_processor"] = json.loads(tokenizer.to_str())["post_processor"]
    _write_json(folder / "tokenizer.json", saved)
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(config, tokenizer, bos_id, eos_id))
