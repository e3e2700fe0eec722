"""A throwaway redis-server on a free loopback port, started and stopped (by its PID) by the peer benchmark."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process with persistence off (``--save '' --appendonly no``)."""

    def __init__(self, proc: subprocess.Popen, port: int, version: str) -> None:
        self.proc, self.port, self.version = proc, port, version
        self._client = redis.Redis(host="127.0.0.1", port=port)

    @classmethod
    def start(cls, workdir: Path) -> RedisServer | None:
        """A running server, or None when no ``redis-server`` binary is on PATH."""
        binary = shutil.which("redis-server")
        if binary is None:
            return None
        workdir.mkdir(parents=True, exist_ok=True)
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
        port = _free_port()
        with open(workdir / "redis.log", "wb") as log:  # closed here: the child holds its own descriptor
            proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", str(workdir)], stdout=log, stderr=subprocess.STDOUT)
        server = cls(proc, port, version)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                server._client.ping()
                return server
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    tail = (workdir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server did not start on port {port}:\n{tail}") from None
                time.sleep(0.05)

    def url(self, scheme: str) -> str:
        """``redis`` (kvtier, LMCache's redis-py connector) or ``resp`` (LMCache's C++ client)."""
        return f"{scheme}://127.0.0.1:{self.port}"

    def flush(self) -> None:
        self._client.flushall()

    def stop(self) -> None:
        """Stop this server, by its PID (SIGTERM, then SIGKILL if it lingers)."""
        self._client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
