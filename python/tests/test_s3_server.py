"""Smoke test of the S3 test infrastructure: moto server, conditional put, DCP round trip via fsspec."""

from __future__ import annotations

import pytest
import torch
from botocore.exceptions import ClientError

from s3_server import load_dcp_s3, save_dcp_s3


def test_conditional_put(s3_server, s3_bucket):
    c = s3_server.client()
    c.put_object(Bucket=s3_bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as ei:
        c.put_object(Bucket=s3_bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert ei.value.response["Error"]["Code"] == "PreconditionFailed"
    assert c.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"first"


def test_dcp_roundtrip_fsspec(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/ck"
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
          "b": torch.full((5,), 0.5, dtype=torch.bfloat16), "step": 7}
    save_dcp_s3(url, sd, s3_server)
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="ck/")["Contents"]}
    assert "ck/.metadata" in keys
    got = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    load_dcp_s3(url, got, s3_server)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"]) and got["step"] == 7


def test_restart_same_port(s3_server, s3_bucket):
    port = s3_server.port
    s3_server.stop()
    assert not s3_server.running
    s3_server.start()
    assert s3_server.port == port
    # in-memory state is gone: the bucket must be recreated
    c = s3_server.client()
    assert s3_bucket not in {b["Name"] for b in c.list_buckets()["Buckets"]}
    s3_server.make_bucket(s3_bucket)
    c.put_object(Bucket=s3_bucket, Key="x", Body=b"1")
