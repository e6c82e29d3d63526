"""Hugging Face folders for tests: Llama weights of the tiny test shape written by transformers
itself, and word-level tokenizers."""

from pathlib import Path

import torch

from tests.multiprocess import TINY


def save_hf_llama(folder: Path, seed: int, **overrides) -> Path:
    """A random transformers Llama of the tiny shape, in 20 KB safetensors shards."""
    fields = dict(
        hidden_size=TINY.dim,
        num_hidden_layers=TINY.n_layers,
        num_attention_heads=TINY.n_heads,
        num_key_value_heads=TINY.kv_heads,
        intermediate_size=TINY.ffn_hidden_dim,
        vocab_size=TINY.vocab_size,
        rope_theta=TINY.rope_theta,
        rms_norm_eps=TINY.norm_eps,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    import transformers  # a test-only dependency

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides}))
    with torch.no_grad():  # the norms start at exactly 1; make them count too
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder


def write_word_tokenizer(folder: Path, n_words: int, specials: tuple[str, ...] = ()) -> int:
    """A word-level tokenizer.json with n_words words plus `specials`; returns its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"word{i}": i for i in range(n_words)}
    vocab["[UNK]"] = n_words
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
