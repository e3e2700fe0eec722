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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


class Routed:
    """A cluster client whose commands kvtier routes itself (see the module docstring)."""

    def __init__(self, cluster: Any) -> None:
        import redis.exceptions as errors

        self.cluster = cluster
        self.redirections = (errors.MovedError, errors.AskError, errors.TryAgainError)

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
        try:
            return getattr(self.node_client(_key_of(command, args)), command)(*args, **kwargs)
        except self.redirections:
            return getattr(self.cluster, command)(*args, **kwargs)


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
        try:
            for node, positions in nodes.values():
                pipe = cluster.get_redis_connection(node).pipeline(transaction=self._transaction)
                for i in positions:
                    command, args, kwargs = self._queued[i]
                    getattr(pipe, command)(*args, **kwargs)
                for i, reply in zip(positions, pipe.execute(raise_on_error=False)):
                    replies[i] = reply
        except self._routed.redirections:  # a transaction raises its queued command's redirection
            return self._through_cluster(raise_on_error)
        if any(isinstance(r, self._routed.redirections) for r in replies):
            return self._through_cluster(raise_on_error)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def _through_cluster(self, raise_on_error: bool) -> list[Any]:
        pipe = self._routed.cluster.pipeline(transaction=self._transaction)
        for command, args, kwargs in self._queued:
            getattr(pipe, command)(*args, **kwargs)
        replies: list[Any] = pipe.execute(raise_on_error=raise_on_error)
        return replies
