"""A real S3-compatible server for the tests: SeaweedFS (`weed server -s3`),
the binary `make install` builds into bin/weed, on loopback ports, with one
identity whose keys the tests hold."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

WEED = Path(__file__).resolve().parent.parent / "bin" / "weed"
ACCESS_KEY, SECRET_KEY = "compilecast-test", "compilecast-test-secret"


def _port() -> int:
    """A free port under 45000: weed serves gRPC on each port + 10000."""
    while True:
        port = random.randint(20000, 45000)
        with socket.socket() as s, socket.socket() as g:
            try:
                s.bind(("127.0.0.1", port))
                g.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class S3Server:
    def __init__(self, root: Path) -> None:
        if not WEED.exists():
            raise RuntimeError(f"{WEED} is missing: `make install` builds it (SeaweedFS)")
        self.root = root
        self.port = _port()
        config = root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        (root / "data").mkdir()
        args = [str(WEED), "server", f"-dir={root / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3", f"-s3.port={self.port}", f"-s3.config={config}",
                f"-master.port={_port()}", f"-volume.port={_port()}",
                f"-filer.port={_port()}", "-master.volumeSizeLimitMB=64",
                "-volume.max=0"]
        self.log = open(root / "weed.log", "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=root)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready(60.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        """Until a bucket can be listed (its S3 port answers before its filer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: {self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                self.client().list_buckets()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed's S3 did not answer: {self.tail()}") from None
                time.sleep(0.2)

    def tail(self) -> str:
        self.log.flush()
        return (self.root / "weed.log").read_text(errors="replace")[-2000:]

    def client(self, access: str = ACCESS_KEY, secret: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=access,
                            aws_secret_access_key=secret, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"max_attempts": 1}))

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        """The credentials, as a coordinator process takes them."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root / "data", ignore_errors=True)


def use_credentials(server: S3Server) -> dict[str, str | None]:
    """Put the server's credentials in this process's environment; returns
    what was there before (for `restore`)."""
    before = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    return before


def restore(before: dict[str, str | None]) -> None:
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
