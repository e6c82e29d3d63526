"""Where checkpoints live: a local (or shared) folder, or object storage through fsspec.

A location is a ``pathlib.Path`` for a plain path and an ``ObjectPath`` for a URL
(``s3://bucket/run``, ``gs://bucket/run``, ``memory://run`` in tests). ObjectPath offers the
few Path methods that reading a checkpoint needs (``/``, ``name``, ``exists``, ``is_file``,
``is_dir``, ``iterdir``, ``read_text``, ``open``, ``stat().st_size``), so the code that lists
and reads step folders is the same for both; what differs is committing and deleting, since
object stores have no rename of a folder (see ``manager.py``).

fsspec and the backend are imported only for a URL: a local run never imports them.
Credentials come from the backend's standard places (``AWS_*`` variables, including
``AWS_ENDPOINT_URL``, the AWS config files, ``GOOGLE_APPLICATION_CREDENTIALS``); a URL that
carries them itself is refused, so that none is written into a config, a log or a checkpoint.
"""

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
# The optional extra that installs each scheme's fsspec backend.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# Environment variables whose values never appear in a message (an error of the backend
# may quote a request).
_SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def is_url(location) -> bool:
    return isinstance(location, ObjectPath) or (isinstance(location, str) and _URL.match(location) is not None)


def scheme(url: str) -> str:
    return _URL.match(url).group(1).lower()


def redact(text: str) -> str:
    """``text`` without the values of the credential variables set in this environment."""
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "<redacted>")
    return text


def url_problem(url: str) -> str | None:
    """What is wrong with a storage URL before anything is read or written, or None: credentials
    in the URL, a scheme fsspec does not know, or a backend that is not installed. Names the
    scheme only (the rest may hold a secret)."""
    protocol, rest = scheme(url), _URL.match(url).group(2)
    if "@" in rest.split("/", 1)[0]:
        return (
            f"a {protocol}:// URL with credentials in it (user:secret@...) is refused: give them in the backend's "
            "standard places (AWS_* variables or ~/.aws for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://)"
        )
    from fsspec.registry import get_filesystem_class, known_implementations

    if protocol not in known_implementations:
        return f"{protocol}:// is not a storage scheme fsspec knows (use s3://, gs:// or a local path)"
    try:
        get_filesystem_class(protocol)
    except ImportError:
        extra = EXTRAS.get(protocol)
        install = f'pip install "titanlite[{extra}]"' if extra else known_implementations[protocol].get("err", "")
        return f"{protocol}:// needs its fsspec backend, which is not installed: {install}"
    return None


def _filesystem(url: str):
    """(fsspec filesystem, path in it) for a URL, listing without a cache: the checkpoint
    manager must see what other ranks and processes wrote a moment ago."""
    from fsspec.core import url_to_fs

    return url_to_fs(url, use_listings_cache=False)


class ObjectPath:
    """A file or folder (a key prefix) in object storage, by URL; see the module docstring."""

    def __init__(self, url: str, _fs=None):
        self.url = url.rstrip("/")
        if _fs is None:
            _fs, _ = _filesystem(self.url)
        self.fs = _fs
        self.path = self.fs._strip_protocol(self.url)

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(f"{self.url}/{name}", self.fs)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.url.rsplit("/", 1)[0], self.fs)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path)

    def iterdir(self):
        if not self.is_dir():
            return iter(())
        # Without the zero-byte object some tools create to stand for the folder itself.
        entries = {entry.rstrip("/") for entry in self.fs.ls(self.path, detail=False)} - {self.path.rstrip("/")}
        return iter([self / entry.rsplit("/", 1)[-1] for entry in sorted(entries)])

    def stat(self):
        return SimpleNamespace(st_size=int(self.fs.size(self.path)))

    def open(self, mode: str = "rb"):
        return self.fs.open(self.path, mode)

    def read_text(self) -> str:
        return self.fs.cat_file(self.path).decode()

    def write_text(self, text: str) -> None:
        self.fs.pipe_file(self.path, text.encode())

    def remove(self, recursive: bool = False) -> None:
        """Delete the object (with ``recursive``, every object under the prefix); gone already is fine."""
        try:
            self.fs.rm(self.path, recursive=recursive)
        except FileNotFoundError:
            pass

    def copy_to(self, target: "ObjectPath", last: str) -> None:
        """Copy every object under this prefix to ``target`` (server-side where the store can),
        the one named ``last`` (a commit marker) after all others."""
        sources = sorted(self.fs.find(self.path), key=lambda source: source.rsplit("/", 1)[-1] == last)
        for source in sources:
            self.fs.copy(source, target.path + source[len(self.path) :])


def location(value: str | os.PathLike) -> "Path | ObjectPath":
    """A Path for a plain path, an ObjectPath for a URL (checked with url_problem: ValueError)."""
    if isinstance(value, (Path, ObjectPath)):
        return value
    text = os.fspath(value)
    if not is_url(text):
        return Path(text)
    problem = url_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return ObjectPath(text)


_PROBE_OPTIONS = {
    "s3": {"config_kwargs": {"connect_timeout": 5, "retries": {"max_attempts": 2}}},
}


def checkpoint_folder(dump_folder: str, folder: str) -> "Path | ObjectPath":
    """Where a run's step folders go: checkpoint.folder itself when it is a URL, else the
    folder under job.dump_folder (an absolute folder stands for itself)."""
    return location(folder) if is_url(folder) else Path(dump_folder) / folder


def probe(url: str) -> str | None:
    """Whether the folder at ``url`` can be listed (its bucket exists, the credentials are
    accepted, the endpoint answers): None, or one line saying why not, with no secret in it."""
    problem = url_problem(url)
    if problem is not None:
        return problem
    from fsspec.core import url_to_fs

    try:
        # Few retries: a wrong endpoint is told in seconds, not after the backend's back-off.
        if scheme(url) not in EXTRAS:
            return None  # no buckets (memory://, a local file://): the folder is made on the first save
        fs, path = url_to_fs(url, skip_instance_cache=True, **_PROBE_OPTIONS.get(scheme(url), {}))
        fs.ls(path.split("/", 1)[0], detail=False)
    except FileNotFoundError:
        return f"the bucket of {url} does not exist"
    except Exception as error:  # credentials refused, no network, ...: the backend's own words
        text = " ".join(str(error).split())[:300]
        return f"{url} cannot be listed ({type(error).__name__}: {redact(text)})"
    return None


@contextlib.contextmanager
def upload_slot(folder_url: str, slots: int):
    """Hold one of ``slots`` upload slots of this node for ``folder_url`` (0: no limit), so that
    at most that many ranks of a node upload to it at once. A slot is an flock on a file in
    the node's temporary folder: any process of any job on the node writing to the same
    folder takes turns, and the kernel frees a slot whose holder died."""
    if slots <= 0:
        yield
        return
    key = hashlib.sha256(folder_url.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"titanlite-uploads-{os.getuid()}-{key}"
    folder.mkdir(exist_ok=True)
    handles = [os.open(folder / f"slot-{index}", os.O_CREAT | os.O_RDWR, 0o600) for index in range(slots)]
    try:
        held = None
        while held is None:
            for handle in handles:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                held = handle
                break
            else:
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    finally:
        for handle in handles:
            os.close(handle)
