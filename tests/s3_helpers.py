"""A real S3-compatible server for tests: moto's server mode on 127.0.0.1, in this process, with
IAM authentication switched on once the buckets exist (so a wrong key is refused, as on AWS).

    with moto_s3(tmp_path, buckets=["runs"]) as s3:
        s3.options        # storage options for fsspec/s3fs: endpoint_url + "${ENV}" credential refs
        s3.client         # a boto3 client signed with the valid key

The valid key and secret are in the environment variables KEY_VAR / SECRET_VAR (and AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, for processes that use botocore's default chain, e.g. torchrun workers)
while the block runs; nothing from this machine's AWS files is read and nothing leaves loopback."""
from __future__ import annotations

import json
import logging
import os
import re
import urllib.request
from contextlib import contextmanager
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

KEY_VAR, SECRET_VAR = "CRUCIBLE_TEST_S3_KEY", "CRUCIBLE_TEST_S3_SECRET"
_AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
             "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
             "AWS_EC2_METADATA_DISABLED", "AWS_DEFAULT_REGION", KEY_VAR, SECRET_VAR)


@dataclass
class S3Server:
    endpoint: str
    key: str
    secret: str
    client: object

    @property
    def options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": "${%s}" % KEY_VAR, "secret": "${%s}" % SECRET_VAR}

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under `prefix` in `bucket`."""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()


@contextmanager
def moto_s3(tmp_dir: Path, buckets: list[str]) -> Iterator[S3Server]:
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    saved = {v: os.environ.get(v) for v in _AWS_VARS}
    for v in _AWS_VARS:
        os.environ.pop(v, None)
    empty = Path(tmp_dir) / "aws"
    empty.mkdir(parents=True, exist_ok=True)
    os.environ.update(AWS_SHARED_CREDENTIALS_FILE=str(empty / "credentials"), AWS_CONFIG_FILE=str(empty / "config"),
                      AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        # moto keeps its backends and its authentication switch per process: start from neither
        _post(f"{endpoint}/moto-api/reset-auth", b"inf")
        _post(f"{endpoint}/moto-api/reset", b"")
        boot = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                    aws_secret_access_key="setup")
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="crucible")
        iam.put_user_policy(UserName="crucible", PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        access = iam.create_access_key(UserName="crucible")["AccessKey"]
        for b in buckets:
            boto3.client("s3", **boot).create_bucket(Bucket=b)
        _post(f"{endpoint}/moto-api/reset-auth", b"0")  # from now on every request must be signed by a known key
        key, secret = access["AccessKeyId"], access["SecretAccessKey"]
        os.environ.update({KEY_VAR: key, SECRET_VAR: secret, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret})
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=key, aws_secret_access_key=secret)
        yield S3Server(endpoint, key, secret, client)
    finally:
        try:
            _post(f"{endpoint}/moto-api/reset-auth", b"inf")
        finally:
            server.stop()
            for v, val in saved.items():
                if val is None:
                    os.environ.pop(v, None)
                else:
                    os.environ[v] = val


@contextmanager
def object_requests(method: str = "GET", bucket: str = "runs") -> Iterator[Counter]:
    """The keys of the objects in `bucket` read (GET; or written: "PUT") on the moto server while
    the body runs, with their count: its request log (the requests of other processes and of a Ray
    cluster's nodes reach this process's server too)."""
    got: Counter = Counter()

    class Requests(logging.Handler):
        def emit(self, record):
            m = re.search(r'"(?:\x1b\[[0-9;]*m)*' + method + r' /' + bucket + r'/([^ ?]+)', record.getMessage())
            if m:  # (colours: a 206)
                got[m.group(1)] += 1

    logger, handler = logging.getLogger("werkzeug"), Requests()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
