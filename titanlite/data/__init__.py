"""The data package: tokenizers, document sources, prepared (tokenized-once) data, the global
window order, and the data-parallel loader that reads ahead and resumes anywhere.

It takes plain arguments; from titanlite it imports only the config's dataset names and the
fsync helper (titanlite.files). The prepare command lives in
``titanlite.data.prepare``, which the package does not import, so that
``python -m titanlite.data.prepare`` runs it as a fresh module.
"""

from .build import open_windows, parse_mixture, stream_warning, verify_share
from .loader import DataLoader, PackedLoader, PreparedWindows
from .prepared import PreparedFolder
from .sources import build_documents
from .stream import StreamWindows
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, tokenizer_file


def build_loader(
    dataset: str,
    dataset_path: str | None,
    tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    split: str = "train",
) -> PackedLoader:
    """A raw stream of ``dataset`` packed into windows for one data-parallel rank (no read-ahead)."""
    return PackedLoader(
        build_documents(dataset, dataset_path, split), tokenizer, seq_len, local_batch_size, dp_rank, dp_degree
    )


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "tokenizer_file",
    "build_documents",
    "DataLoader",
    "PackedLoader",
    "PreparedWindows",
    "PreparedFolder",
    "StreamWindows",
    "build_loader",
    "open_windows",
    "parse_mixture",
    "stream_warning",
    "verify_share",
]
