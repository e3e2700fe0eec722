"""The relay the fault tests put between kvtier and a server: it carries bytes both ways (half-closes too), holds
them while black-holed, carries or cuts what it held when healed, spreads connections over several ports, and
stops for good when closed."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.testing.network import Relay


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:  # echo until the client half-closes, then answer with this server's port
        got = b""
        while data := self.request.recv(1 << 16):
            got += data
        self.request.sendall(got + b"@" + str(self.server.server_address[1]).encode())


@pytest.fixture
def echoes() -> Iterator[list[int]]:
    servers = [socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) for _ in range(2)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [server.server_address[1] for server in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def ask(port: int, body: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(body)
        s.shutdown(socket.SHUT_WR)  # the echo answers once this end is carried through
        out = b""
        while data := s.recv(1 << 16):
            out += data
        return out


def test_it_carries_both_ways_with_a_half_close_and_spreads_connections(echoes: list[int]) -> None:
    with Relay(*echoes) as relay:
        answers = [ask(relay.port, b"x" * 200_000) for _ in range(4)]
    assert all(a.startswith(b"x" * 200_000 + b"@") for a in answers)
    assert {a.rsplit(b"@", 1)[1] for a in answers} == {str(p).encode() for p in echoes}


def test_black_holed_it_holds_everything_then_carries_it_when_healed(echoes: list[int]) -> None:
    with Relay(echoes[0]) as relay:
        relay.black_hole()
        with pytest.raises(TimeoutError):
            ask(relay.port, b"held", timeout=0.5)  # connected, never answered
        got: list[bytes] = []
        late = threading.Thread(target=lambda: got.append(ask(relay.port, b"late", timeout=10)))
        late.start()
        threading.Event().wait(0.3)
        assert not got
        relay.heal()
        late.join()
        assert got == [b"late@" + str(echoes[0]).encode()]


def test_healed_with_reset_it_cuts_what_it_held(echoes: list[int]) -> None:
    with Relay(echoes[0]) as relay:
        relay.black_hole()
        outcome: list[object] = []

        def held() -> None:
            try:
                outcome.append(ask(relay.port, b"cut", timeout=10))
            except OSError as exc:
                outcome.append(exc)

        waiting = threading.Thread(target=held)
        waiting.start()
        threading.Event().wait(0.3)
        relay.heal(reset=True)
        waiting.join()
        assert outcome[0] == b"" or isinstance(outcome[0], OSError), outcome  # no answer: cut
        assert ask(relay.port, b"next") == b"next@" + str(echoes[0]).encode()  # new connections are carried


def test_closed_it_takes_no_connection_and_leaves_no_thread(echoes: list[int]) -> None:
    relay = Relay(echoes[0])
    assert ask(relay.port, b"a").startswith(b"a@")
    relay.close()
    with pytest.raises(OSError):
        ask(relay.port, b"b", timeout=1)
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name in ("relay-accept", "relay-pump")]:
        assert time.monotonic() < deadline, "the relay's threads outlived its close"
        time.sleep(0.01)
