"""A real S3-compatible server for the tests: moto's server, in this process, on a port the
kernel picks (no port race), serving the S3 API over HTTP as a bucket would. The ranks and
scripts the tests start reach it through the standard AWS variables it sets."""

import contextlib
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
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", **CREDENTIALS}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
