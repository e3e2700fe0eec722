"""A Redis Cluster's commands sent by kvtier to the node that holds each key, on that node's own client.

redis-py's cluster client answers a command that timed out by asking every node it knows for the slots again,
and a pipeline's timed-out commands are then retried one by one: with every node of three paused, one lookup
waited 7 to 8 x ``socket_timeout`` (the count varies with the order the client tries the nodes in). Every
command kvtier sends names one key, so kvtier needs only the slot map from the cluster client: a command goes to
its key's node, a pipeline splits into one plain pipeline per node, and a stalled node fails the call after one
``socket_timeout`` (the calls stop at the first node that fails; the slot map stands, and the other nodes' keys
are served meanwhile).

A node that answers with a redirection (``MOVED``, ``ASK``, ``TRYAGAIN``: the cluster is being resharded) is
alive, so the call is sent again through the cluster client, which follows redirections and learns the new
slots. Every command kvtier pipelines may run twice (a redirected pipeline runs again whole): they set what was
set, or only read.

A node that fails (its connection refused or reset, a timeout) is an outage of that node alone
(:class:`NodeHealth`): its keys are :class:`~kvtier.errors.PartUnavailable` (misses, dropped writes) while it rests
and the other nodes' keys are served; the slot map is asked for again on a thread of its own, so once the cluster
promoted a replica its slots are served by it. Only when every primary is failing is the tier itself failing
(a :class:`~kvtier.errors.TierError`: the store rests the whole tier).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

from kvtier.errors import PartUnavailable, TierError
from kvtier.health import Outage

# Commands whose first argument is their one key, and the pipelined ones; a command outside these sets is an
# AttributeError, so a new command in the tier cannot bypass the routing unnoticed.
_KEYED = frozenset({"delete", "get", "hdel", "hget", "hkeys", "hscan_iter", "set", "unlink"})
_PIPELINED = frozenset({"hget", "hkeys", "hset", "hstrlen", "object", "pexpire"})


def _key_of(command: str, args: tuple[Any, ...]) -> Any:
    if command == "object":  # OBJECT <subcommand> <key>
        return args[1]
    if command == "eval":  # EVAL <script> <numkeys> <key> ...: kvtier's scripts keep their keys in one slot
        return args[2]
    return args[0]


_SENDERS = 16  # threads sending a pipeline's parts to their nodes at once
_NODE_RETRY_S = 1.0  # a failed node's first rest (then doubled at each failed retry, as a tier's outage is)
_REFRESH_EVERY_S = 0.5  # the slot map is asked for at most this often after node failures


class NodeHealth:
    """Each node's outage (keyed by its ``host:port``), and the slot map asked for again while a node fails.

    A call passes the time it began (:meth:`check` returns it) to :meth:`failed` and :meth:`succeeded`: the calls
    in flight when a node dies fail together, and only the first of them rests it (the others started before
    that failure: they neither double its rest nor, answering late, end it)."""

    def __init__(self, tier: str, cluster: Any) -> None:
        import redis.exceptions as errors

        self.tier = tier
        self.cluster = cluster
        self.failures = (errors.ConnectionError, errors.TimeoutError)
        self._outages: dict[str, Outage] = {}
        self._failed_at: dict[str, float] = {}  # when each node's last counted failure was
        self._lock = threading.Lock()
        self._refresh = threading.Event()  # a refresh is wanted (or closing)
        self._closed = False
        self._refresher: threading.Thread | None = None
        self._failed_node: str | None = None
        self.refreshes = 0  # slot maps asked for after a failure (the tier's counters)
        self.part_failures = 0  # calls failed or skipped for a failing node

    def _outage(self, node: Any) -> Outage:
        with self._lock:
            outage = self._outages.get(node.name)
            if outage is None:
                outage = self._outages[node.name] = Outage(self.tier, f"node {node.name}", _NODE_RETRY_S)
            return outage

    def check(self, node: Any) -> float:
        """When a call to ``node`` begins; raises :class:`PartUnavailable` while it rests after a failure (a
        :class:`TierError` while every primary does)."""
        if self._outage(node).resting():
            with self._lock:
                self.part_failures += 1
            if self._every_primary_failing():
                raise TierError(f"{self.tier}: every primary is failing")
            raise PartUnavailable(f"{self.tier}: node {node.name} is failing (its slots are misses meanwhile)")
        return time.monotonic()

    def succeeded(self, node: Any, began: float) -> None:
        # (begun before its failure: says nothing now; one dict read, no lock on this path of every call)
        if began >= self._failed_at.get(node.name, 0.0):
            self._outage(node).succeeded()

    def failed(self, node: Any, exc: BaseException, began: float) -> NoReturn:
        """Rest ``node`` (unless the call began before its last failure), keep asking for the slot map while it
        fails (its slots may move to a replica), and raise: a :class:`PartUnavailable`, or a :class:`TierError`
        when every primary is failing."""
        outage = self._outage(node)
        with self._lock:
            self.part_failures += 1
            counted = began >= self._failed_at.get(node.name, 0.0)
            if counted:
                self._failed_at[node.name] = time.monotonic()
                self._failed_node = node.name
        if counted:
            outage.failed(exc)
            self._wake()
        if self._every_primary_failing():
            raise TierError(f"{self.tier}: every primary is failing, the last {node.name}: {exc}") from exc
        raise PartUnavailable(f"{self.tier}: node {node.name} failed (its slots are misses while it rests): "
                              f"{exc}") from exc

    def _every_primary_failing(self) -> bool:
        try:
            primaries = [n.name for n in self.cluster.get_primaries()]
        except Exception:  # noqa: BLE001 (a slot map being rebuilt): not known to be all failing
            return False
        with self._lock:
            return bool(primaries) and all(n in self._outages and self._outages[n].failing for n in primaries)

    def _failing(self) -> bool:
        with self._lock:
            return any(o.failing for o in self._outages.values())

    def _wake(self) -> None:
        self._refresh.set()
        with self._lock:
            if not self._closed and (self._refresher is None or not self._refresher.is_alive()):
                self._refresher = threading.Thread(target=self._refreshing, name=f"kvtier-{self.tier}-slots",
                                                   daemon=True)
                self._refresher.start()

    def _refreshing(self) -> None:
        """Ask any node that answers for the slot map every :data:`_REFRESH_EVERY_S` while a node fails (whatever
        its rest: a promoted replica is found without waiting for it) or a refresh is wanted; the thread ends
        when neither holds, or the client closes."""
        while not self._closed:
            self._refresh.clear()
            try:
                self.cluster.nodes_manager.initialize(last_failed_node_name=self._failed_node)
                with self._lock:
                    self.refreshes += 1
            except Exception:  # noqa: BLE001 no node answered: asked again next time
                pass
            if not self._refresh.wait(timeout=_REFRESH_EVERY_S) and not self._failing():
                with self._lock:
                    if not self._refresh.is_set():
                        self._refresher = None
                        return

    def close(self) -> None:
        self._closed = True
        self._refresh.set()


class Routed:
    """A cluster client whose commands kvtier routes itself (see the module docstring)."""

    def __init__(self, cluster: Any, tier: str = "redis") -> None:
        import redis.exceptions as errors

        self.cluster = cluster
        self.redirections = (errors.MovedError, errors.AskError, errors.TryAgainError)
        self.health = NodeHealth(tier, cluster)
        # a pipeline's nodes are sent to at once: a call takes its slowest node's time, not their sum (and a
        # stalled node's socket_timeout once, however many nodes stall)
        self.senders = ThreadPoolExecutor(max_workers=_SENDERS, thread_name_prefix=f"kvtier-{tier}-nodes")

    def close(self) -> None:
        self.health.close()
        self.senders.shutdown(wait=False)
        self.cluster.close()

    def node_client(self, key: Any) -> Any:
        """The plain client of the node that holds ``key``'s slot."""
        return self.cluster.get_redis_connection(self.cluster.get_node_from_key(key))

    def pipeline(self, transaction: bool = False) -> NodePipelines:
        return NodePipelines(self, transaction)

    def eval(self, *args: Any) -> Any:
        return self._send("eval", args)

    def scan_iter(self, match: str, count: int) -> Iterator[bytes]:
        for node in self.cluster.get_primaries():
            yield from self.cluster.get_redis_connection(node).scan_iter(match=match, count=count)

    def __getattr__(self, command: str) -> Any:
        if command not in _KEYED:
            raise AttributeError(f"{command}: not a command kvtier routes to a cluster node")
        return lambda *args, **kwargs: self._send(command, args, kwargs)

    def _send(self, command: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        node = self.cluster.get_node_from_key(_key_of(command, args))
        began = self.health.check(node)
        try:
            reply = getattr(self.cluster.get_redis_connection(node), command)(*args, **kwargs)
        except self.redirections:
            return getattr(self.cluster, command)(*args, **kwargs)
        except self.health.failures as exc:
            self.health.failed(node, exc, began)
        self.health.succeeded(node, began)
        return reply


class NodePipelines:
    """A pipeline over a cluster: one plain pipeline per node, run one node after another, the replies put back
    in the order of the commands. ``transaction`` makes each node's part atomic (kvtier's transactions touch
    one key)."""

    def __init__(self, routed: Routed, transaction: bool) -> None:
        self._routed = routed
        self._transaction = transaction
        self._queued: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, command: str) -> Any:
        if command not in _PIPELINED:
            raise AttributeError(f"{command}: not a command kvtier pipelines to a cluster node")

        def queue(*args: Any, **kwargs: Any) -> NodePipelines:
            self._queued.append((command, args, kwargs))
            return self

        return queue

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        cluster = self._routed.cluster
        nodes: dict[str, tuple[Any, list[int]]] = {}
        for i, (command, args, _) in enumerate(self._queued):
            node = cluster.get_node_from_key(_key_of(command, args))
            nodes.setdefault(node.name, (node, []))[1].append(i)
        replies: list[Any] = [None] * len(self._queued)
        groups = list(nodes.values())
        try:
            if len(groups) == 1:
                answers = [self._send(*groups[0])]
            else:
                futures: list[Future[list[Any]] | None] = []
                for group in groups:
                    try:
                        futures.append(self._routed.senders.submit(self._send, *group))
                    except RuntimeError:  # the client was closed meanwhile (rebuilt): the rest sent from here
                        futures.append(None)
                answers = [self._send(*group) if future is None else future.result()
                           for future, group in zip(futures, groups)]
        except self._routed.redirections:  # a transaction raises its queued command's redirection
            return self._through_cluster(raise_on_error)
        for (_, positions), answered in zip(groups, answers):
            for i, reply in zip(positions, answered):
                replies[i] = reply
        if any(isinstance(r, self._routed.redirections) for r in replies):
            return self._through_cluster(raise_on_error)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def _send(self, node: Any, positions: list[int]) -> list[Any]:
        """The replies of ``node`` to its commands; each a :class:`PartUnavailable` when the node fails or rests
        (the other nodes' are sent all the same)."""
        health = self._routed.health
        try:
            began = health.check(node)
            try:
                pipe = self._routed.cluster.get_redis_connection(node).pipeline(transaction=self._transaction)
                for i in positions:
                    command, args, kwargs = self._queued[i]
                    getattr(pipe, command)(*args, **kwargs)
                answered: list[Any] = pipe.execute(raise_on_error=False)
            except health.failures as exc:
                health.failed(node, exc, began)
        except PartUnavailable as exc:
            return [exc] * len(positions)
        health.succeeded(node, began)
        return answered

    def _through_cluster(self, raise_on_error: bool) -> list[Any]:
        pipe = self._routed.cluster.pipeline(transaction=self._transaction)
        for command, args, kwargs in self._queued:
            getattr(pipe, command)(*args, **kwargs)
        replies: list[Any] = pipe.execute(raise_on_error=raise_on_error)
        return replies
