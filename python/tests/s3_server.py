"""A real S3-protocol HTTP server on loopback for the object-storage tests: moto's standalone server
(`python -m moto.server`, from `moto[server]`) run as a subprocess.

    with S3Server() as srv:
        srv.make_bucket("b")
        env = srv.env()                        # for a subprocess / the Rust client
        opts = srv.fsspec_storage_options()    # for s3fs / torch DCP FsspecReader/FsspecWriter

The server dies with its parent (atexit, and PR_SET_PDEATHSIG on Linux: call start() from a thread
that outlives the server, e.g. the main thread). State is in-memory in the server process: `stop()` (SIGKILL, to simulate an outage) loses every
bucket and object, and `start()` brings up an EMPTY server on the same port. Tests that restart must
recreate their bucket (and whatever objects they need) afterwards.

Conditional writes (`If-None-Match: *` on PutObject and CompleteMultipartUpload) need no
configuration in moto >= 5.1, but moto checks-then-writes without a lock, so it is not a race-free
arbiter between concurrent writers.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def _die_with_parent() -> None:  # preexec_fn: SIGKILL the server if the spawning thread dies
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_LIVE: "set[S3Server]" = set()


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        srv.stop()


# moto's server with S3Response.upload_part holding each request for an hour (moto serves each
# request in its own thread, so everything else keeps answering).
_STALLED_UPLOAD_PART = """
import sys, time
import moto.s3.responses as responses
from moto.server import main
original = responses.S3Response.upload_part
def stalled(self):
    time.sleep(3600)
    return original(self)
responses.S3Response.upload_part = stalled
main(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto standalone S3 server on 127.0.0.1:<port> (a free port unless given)."""

    def __init__(self, port: int | None = None, log_dir: str | os.PathLike | None = None,
                 start_timeout_s: float = 30.0, extra_env: dict[str, str] | None = None,
                 stall_upload_part: bool = False):
        """``stall_upload_part``: every UploadPart request is held without an answer (the server
        thread sleeps), as a store that accepts a multipart upload and then stalls."""
        self.host = "127.0.0.1"
        self.stall_upload_part = stall_upload_part
        self.port = port or _free_port()
        self.start_timeout_s = start_timeout_s
        self.extra_env = dict(extra_env or {})
        self._log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="moto-s3-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._log_dir / f"moto-{self.port}.log"
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._client = None

    # --- lifecycle -------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "S3Server":
        """Start (or restart, on the same port) the server and wait until it answers HTTP."""
        if self.running:
            return self
        env = dict(os.environ)
        env.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                    "AWS_DEFAULT_REGION": REGION, "PYTHONUNBUFFERED": "1"})
        env.update(self.extra_env)
        self._log = open(self.log_path, "ab")
        self._log.write(f"--- start {time.strftime('%H:%M:%S')} port {self.port}\n".encode())
        self._log.flush()
        launch = ["-c", _STALLED_UPLOAD_PART] if self.stall_upload_part else ["-m", "moto.server"]
        self._proc = subprocess.Popen(
            [sys.executable, *launch, "-H", self.host, "-p", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        _LIVE.add(self)
        deadline = time.monotonic() + self.start_timeout_s
        last_err: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode} before answering "
                                   f"on {self.endpoint}; log {self.log_path}:\n{self._tail()}")
            try:
                # Any HTTP answer (moto gives 200 on /moto-api/data.json) means it is serving.
                with urllib.request.urlopen(self.endpoint + "/moto-api/data.json", timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self
            except (urllib.error.URLError, ConnectionError, socket.timeout, OSError) as e:
                last_err = e
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.endpoint} within {self.start_timeout_s}s "
                           f"({last_err!r}); log {self.log_path}:\n{self._tail()}")

    def stop(self) -> None:
        """Kill the server (SIGKILL: an abrupt outage). All buckets and objects are lost."""
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._proc.wait(timeout=10)
            self._proc = None
        _LIVE.discard(self)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "<no log>"

    # --- client configuration --------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Env vars that point an AWS SDK / object_store client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def fsspec_storage_options(self) -> dict:
        """s3fs.S3FileSystem kwargs; also the **kwargs of torch DCP FsspecReader/FsspecWriter."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}

    def client(self):
        """A boto3 S3 client for this server (a new one after each restart is not needed: boto3
        reconnects)."""
        if self._client is None:
            import boto3
            from botocore.config import Config
            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY, region_name=REGION,
                config=Config(retries={"max_attempts": 1}))
        return self._client

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name


def load_dcp_s3(url: str, state_dict: dict, server: S3Server) -> dict:
    """Load the DCP checkpoint at `url` (s3://bucket/prefix) in place into `state_dict`, through
    torch's FsspecReader + s3fs, in this single process without a process group.

    FsspecReader(path, **kwargs) hands kwargs to fsspec.url_to_fs, i.e. to s3fs.S3FileSystem, so the
    endpoint and credentials go there. Do NOT also pass checkpoint_id= to dcp.load: reset(checkpoint_id)
    re-runs init_path WITHOUT the kwargs and the reader would fall back to env/default config.
    skip_instance_cache: s3fs caches filesystem instances by kwargs (and their listings); a fresh one
    avoids stale state across server restarts.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FsspecReader

    reader = FsspecReader(url, skip_instance_cache=True, **server.fsspec_storage_options())
    dcp.load(state_dict, storage_reader=reader, no_dist=True)
    return state_dict


def save_dcp_s3(url: str, state_dict: dict, server: S3Server) -> None:
    """Counterpart of load_dcp_s3: torch DCP save to s3 through FsspecWriter, no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FsspecWriter

    writer = FsspecWriter(url, skip_instance_cache=True, **server.fsspec_storage_options())
    dcp.save(state_dict, storage_writer=writer, no_dist=True)
