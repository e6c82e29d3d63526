"""A real S3-compatible server for the tests: moto's server, in this process, on a port the
kernel picks (no port race), serving the S3 API over HTTP as a bucket would. The ranks and
scripts the tests start reach it through the standard AWS variables it sets."""

import contextlib
import logging
import os

# Any values: moto accepts every key unless told to check them (see refusing_credentials).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "titanlite-test-key-id",
    "AWS_SECRET_ACCESS_KEY": "titanlite-test-secret-value",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "titanlite-tests"


@contextlib.contextmanager
def s3_server(bucket: str = BUCKET):
    """Start the server, point this process's environment at it (restored afterwards; child
    processes inherit it), create ``bucket``, and yield the environment it set."""
    import boto3
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request whatever moto's verbose says: thousands in a test.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", **CREDENTIALS}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    _forget_s3_filesystems()
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _forget_s3_filesystems()


def _forget_s3_filesystems() -> None:
    """fsspec caches filesystem objects by their arguments, not by the AWS_* variables: one
    made for an earlier server (another module's, in the same pytest worker) would talk to
    that server's port."""
    from fsspec import get_filesystem_class

    get_filesystem_class("s3").clear_instance_cache()
