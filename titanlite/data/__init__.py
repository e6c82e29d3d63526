"""The data room: tokenizers, document sources and the packed, resumable data-parallel loader.

It takes plain arguments and imports nothing else from titanlite.
"""

from .loader import PackedLoader, build_loader
from .sources import build_documents
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, tokenizer_file

__all__ = ["ByteTokenizer", "HFTokenizer", "build_tokenizer", "tokenizer_file", "build_documents", "PackedLoader", "build_loader"]
