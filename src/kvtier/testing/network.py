"""The network's faults, on loopback, for tests and benchmarks: a port that takes connections and never answers
(:class:`BlackHole`), and a relay in front of a server that can be black-holed and healed, or spread connections
over several servers (:class:`Relay`)."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time

__all__ = ["BlackHole", "Relay"]


class BlackHole:
    """A TCP port on loopback that takes connections and never answers: a server stalled for good.

    The kernel completes each handshake into the listen backlog and nobody ever accepts or reads, so a client
    connects at once and then waits on its read timeout.
    """

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Relay:
    """A TCP relay on loopback to ``port`` that can be black-holed and healed: a network path to a server that
    stops carrying packets, then carries them again (the server itself never notices). Given several ports, it
    hands each connection to the next in turn, as a Kubernetes Service spreads connections over its pods.

    While black-holed, connections are still accepted (as a path that drops packets still lets the kernel's
    handshake through a load balancer) and nothing is carried either way, the end of a connection included:
    bytes sent wait, unanswered, until the path heals or the client gives up. Healed, what waited is carried on,
    as TCP would retransmit it after a partition (a request its client gave up on reaches the server late), or
    with ``heal(reset=True)`` the connections that held bytes are cut, as a middlebox that lost their state does.
    """

    def __init__(self, port: int, *more: int) -> None:
        self._targets = itertools.cycle((port, *more))
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._lock = threading.Lock()
        Pair = tuple[socket.socket, socket.socket]
        self._pumps: dict[Pair, int] = {}  # each connection (client, server): its pumps running
        self._holding: set[Pair] = set()  # connections that held bytes while black-holed
        self._cut: set[Pair] = set()  # connections a heal with reset cuts
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._acceptor.start()

    def black_hole(self) -> None:
        self._open.clear()

    def heal(self, reset: bool = False) -> None:
        with self._lock:
            if reset:
                self._cut |= self._holding
            self._holding.clear()
        self._open.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # (out of descriptors, an aborted handshake): the relay goes on
                continue
            try:
                server = socket.create_connection(("127.0.0.1", next(self._targets)), timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            pair = (client, server)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._pumps[pair] = 2
            for src, dst in (pair, pair[::-1]):
                try:
                    threading.Thread(target=self._pump, args=(pair, src, dst), name="relay-pump",
                                     daemon=True).start()
                except RuntimeError:  # no thread: the connection goes (the pump started, if any, ends with it)
                    self._ended(pair, cut=True)

    def _pump(self, pair: tuple[socket.socket, socket.socket], src: socket.socket, dst: socket.socket) -> None:
        clean = False
        try:
            while True:
                data = src.recv(1 << 16)
                if not self._carry(pair):
                    return
                if not data:  # the end of its direction, carried as its bytes are (a half-close stays one)
                    dst.shutdown(socket.SHUT_WR)
                    clean = True
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._ended(pair, cut=not clean)

    def _carry(self, pair: tuple[socket.socket, socket.socket]) -> bool:
        """Wait while black-holed; whether to carry on (not when closed, nor cut by a heal with reset)."""
        if not self._open.is_set():
            with self._lock:
                self._holding.add(pair)
            while not self._open.wait(0.05):
                if self._closed:
                    return False
        with self._lock:
            return pair not in self._cut and not self._closed

    def _ended(self, pair: tuple[socket.socket, socket.socket], cut: bool) -> None:
        """One pump of ``pair`` ended; ``cut``: by an error, a reset or a close, which ends the whole connection
        (the other pump's recv returns). The last one closes both sockets."""
        with self._lock:
            if cut:
                for sock in pair:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            left = self._pumps.pop(pair, 1) - 1
            if left:
                self._pumps[pair] = left
                return
            self._holding.discard(pair)
            self._cut.discard(pair)
            for sock in pair:
                sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for pair in self._pumps:  # their pumps end and close them
                for sock in pair:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # (a close alone does not wake accept on Linux)
        self._sock.close()
        self._acceptor.join(5)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
