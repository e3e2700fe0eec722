"""The router's HTTP/1.1 client (kvtier.router.upstream) against engines written byte by byte on loopback: each
framing, connections kept and not kept, and the answers a broken or hostile engine sends."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.router import upstream as up
from kvtier.router.upstream import ConnectionLost, Upstreams, UpstreamError

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]


class Engine:
    """A loopback server: each request's head and body read, then ``script`` answers it (and says whether the
    connection takes another). Counts connections; keeps every request."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if not await self.script(reader, writer, head, body):
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()


def answer(raw: bytes, keep: bool = True) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(raw)
        await writer.drain()
        return keep
    return script


LOOP = ["asyncio"]


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def loop_kind(request: pytest.FixtureRequest) -> None:
    """Every test on asyncio's loop and on uvloop's (the router's, where it is installed)."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    LOOP[0] = request.param


def in_two(first: bytes, when: asyncio.Event, rest: bytes) -> Script:
    """An engine that sends ``first``, then ``rest`` once ``when`` is set (and takes another request)."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(first)
        await writer.drain()
        await when.wait()
        writer.write(rest)
        await writer.drain()
        return True
    return script


def run(coro: Awaitable[object]) -> object:
    if LOOP[0] == "uvloop":
        import uvloop
        return uvloop.run(coro)  # type: ignore[arg-type]
    return asyncio.run(coro)  # type: ignore[arg-type]


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def post(client: Upstreams, engine: Engine, body: bytes = b'{"prompt": "x"}',
               headers: dict[str, str] | None = None) -> tuple[int, bytes, up.Answer]:
    reply = await client.post(engine.url, "/v1/completions", body, headers or {}, 5)
    data = await reply.read()
    reply.release()
    return reply.status, data, reply


def test_a_kept_connection_carries_the_next_request_and_the_request_is_sent_as_given() -> None:
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            for _ in range(3):
                status, data, reply = await post(client, engine, headers={"X-Request-Id": "r1",
                                                                          "Content-Length": "999", "Host": "evil"})
                assert (status, data, reply.content_type) == (200, b"{}", "application/json")
            assert engine.connections == 1
            head, body = engine.requests[0]
            assert body == b'{"prompt": "x"}'
            lines = head.split(b"\r\n")
            assert lines[0] == b"POST /v1/completions HTTP/1.1"
            assert f"Host: {engine.url[7:]}".encode() in lines and b"X-Request-Id: r1" in lines
            assert [line for line in lines if line.lower().startswith((b"content-length", b"host"))] == [
                f"Host: {engine.url[7:]}".encode(), b"Content-Length: 15"]  # the caller's are not sent
            await client.close()
    run(go())


def test_chunked_answers_stream_chunk_by_chunk() -> None:
    """The first chunk reaches the reader before the engine sends the second (an SSE stream passes on as it
    comes); chunk extensions and trailers are read past; the connection is kept."""
    second = asyncio.Event()
    script = in_two(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
                    b"7;ext=1\r\ndata: 1\r\n", second, b"8\r\ndata: 22\r\n0\r\nX-Trailer: t\r\n\r\n")

    async def go() -> None:
        async with Engine(script) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/v1/completions", b"{}", {}, 5)
            assert reply.content_type == "text/event-stream"
            assert await asyncio.wait_for(reply.readany(), 5) == b"data: 1"
            second.set()
            assert await reply.read() == b"data: 22"
            reply.release()
            second.clear()
            second.set()
            assert (await post(client, engine))[1] == b"data: 1data: 22"
            assert engine.connections == 1
            await client.close()
    run(go())


@pytest.mark.parametrize("raw, body", [
    (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", b"until the end"),  # no length: the connection's end ends it
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nab", b"ab"),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nab", b"ab"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n", b"ab"),
])
def test_answers_after_which_the_connection_is_not_kept(raw: bytes, body: bytes) -> None:
    async def go() -> None:
        async with Engine(answer(raw, keep=raw.startswith(b"HTTP/1.1 200 OK\r\nC"))) as engine:
            client = Upstreams()
            assert (await post(client, engine))[1] == body
            assert (await post(client, engine))[1] == body
            assert engine.connections == 2
            await client.close()
    run(go())


def test_interim_answers_are_skipped() -> None:
    async def go() -> None:
        async with Engine(answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                                 + OK)) as engine:
            client = Upstreams()
            status, data, reply = await post(client, engine)
            assert (status, data) == (200, b"{}") and "Link" not in reply.headers
            await client.close()
    run(go())


def test_a_connection_not_read_to_its_end_or_with_bytes_after_the_answer_is_not_kept() -> None:
    async def go() -> None:
        async with Engine(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabcd")) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            reply.release()  # nothing read
            await post(client, engine)
            assert engine.connections == 2
            await client.close()
        async with Engine(answer(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nX")) as engine:
            client = Upstreams()
            assert (await post(client, engine))[1] == b"{}"
            await asyncio.sleep(0.05)  # the stray answer arrives
            assert (await post(client, engine))[1] == b"{}"  # not the stray one
            assert engine.connections == 2
            await client.close()
    run(go())


def test_an_idle_connection_is_not_reused_past_idle_s_nor_after_the_engine_closed_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            await post(client, engine)
            monkeypatch.setattr(up, "IDLE_S", 0.05)
            await asyncio.sleep(0.1)
            await post(client, engine)
            assert engine.connections == 2
            await client.close()
        async with Engine(answer(OK, keep=False)) as engine:  # the engine closes after each answer
            client = Upstreams()
            await post(client, engine)
            await asyncio.sleep(0.05)  # its close arrives
            assert (await post(client, engine))[1] == b"{}"
            assert engine.connections == 2
            await client.close()
    run(go())


@pytest.mark.parametrize("raw, message", [
    (b"HTTP/1.1 200 OK\r\nX: a\r\n folded\r\nContent-Length: 0\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nX: a\nInjected: b\r\nContent-Length: 0\r\n\r\n", "do not end in CRLF"),
    (b"HTTP/1.1 200 OK\r\nX: a\x00\r\nContent-Length: 0\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nX: \x1b[31mred\r\nContent-Length: 0\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", "do not end in CRLF"),
    (b"HTTP/1.1 200 OK\n\r\n", "do not end in CRLF"),
    (b"HTTP/1.1 200 OK\r\nX: a\n\r\n", "do not end in CRLF"),
    (b"HTTP/1.1 200 OK\r\nBad Name: a\r\nContent-Length: 0\r\n\r\n", "malformed header"),
    (b"HTTP/2 200\r\n\r\n", "status line"),
    (b"ICY 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 99 Low\r\n\r\n", "status line"),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "switched protocols"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab", "not one number"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\nab", "not one number"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0x2\r\n\r\nab", "not one number"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "transfer coding"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n", "transfer coding"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * (up.MAX_HEAD + 10) + b"\r\n\r\n", "head over"),
])
def test_answers_not_read_here_raise_naming_why(raw: bytes, message: str) -> None:
    async def go() -> None:
        async with Engine(answer(raw)) as engine:
            client = Upstreams()
            with pytest.raises(UpstreamError, match=message):
                await asyncio.wait_for(client.post(engine.url, "/", b"", {}, 5), 5)
            await client.close()
    run(go())


@pytest.mark.parametrize("raw, message", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "hexadecimal digits"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 16 + b"\r\n", "hexadecimal digits"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", "longer than its size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * (up.MAX_HEAD + 10), "over"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "ended 7 bytes before"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "ended 3 bytes before"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", "ended within a chunk's size"),
])
def test_a_body_broken_or_cut_raises_and_the_connection_is_dropped(raw: bytes, message: str) -> None:
    async def go() -> None:
        async with Engine(answer(raw, keep=False)) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            with pytest.raises(UpstreamError, match=message):
                await reply.read()
            reply.release()
            assert not client._idle.get(f"http://{engine.url[7:]}")
            await client.close()
    run(go())


def test_no_connection_or_one_closed_before_the_head_is_connection_lost() -> None:
    async def go() -> None:
        client = Upstreams()
        async with Engine(answer(b"HTTP/1.1 200", keep=False)) as engine:
            url = engine.url
            with pytest.raises(ConnectionLost, match="ended within the answer's head"):
                await client.post(url, "/", b"", {}, 5)
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionLost, match="cannot connect"):
            await client.post(url, "/", b"", {}, 5)  # nothing listens there now
        await client.close()
        with pytest.raises(UpstreamError, match="stopping") as stopping:
            await client.post(url, "/", b"", {}, 5)
        assert not isinstance(stopping.value, ConnectionLost)  # (not the engine's failure)
    run(go())


@pytest.mark.parametrize("path, headers", [
    ("/v1/completions HTTP/1.1\r\nX: y", {}),
    ("v1/completions", {}),
    ("/v1/com pletions", {}),
    ("/v1/completions", {"X-A": "b\r\nInjected: 1"}),
    ("/v1/completions", {"X-A": "b\nInjected: 1"}),
    ("/v1/completions", {"X A": "b"}),
    ("/v1/completions", {"X-A:": "b"}),
])
def test_a_request_that_would_inject_into_the_head_is_refused_unsent(path: str, headers: dict[str, str]) -> None:
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            with pytest.raises(ValueError):
                await client.post(engine.url, path, b"", headers, 5)
            assert engine.connections == 0
            await client.close()
    run(go())


def test_a_large_answer_arrives_whole_with_the_socket_paused_and_resumed() -> None:
    big = bytes(range(256)) * (12 * 4096)  # 12 MiB: past the buffer's high mark many times

    async def go() -> None:
        async with Engine(answer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"x" * 3_000_000, {}, 5)
            conn = reply._conn
            assert conn is not None
            parts, paused = [], False
            await asyncio.sleep(0.2)  # the engine writes on; the router's buffer fills to its mark and stops
            while part := await asyncio.wait_for(reply.readany(), 5):
                assert len(part) <= up._READ and len(conn.buffer) <= up._HIGH + 2**20
                paused = paused or conn._paused
                parts.append(part)
                await asyncio.sleep(0)
            assert paused
            assert b"".join(parts) == big
            assert engine.requests[0][1] == b"x" * 3_000_000
            reply.release()
            await client.close()
    run(go())


def test_closing_an_answer_mid_stream_closes_the_engines_connection() -> None:
    """(What aborts the request in vLLM when the client leaves.)"""
    closed = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # until the router closes
        closed.set()
        return False

    async def go() -> None:
        async with Engine(script) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            assert await reply.readany() == b"a"
            reply.close()
            await asyncio.wait_for(closed.wait(), 5)
            await client.close()
    run(go())


def test_https_verifies_the_engines_certificate(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose certificate no trusted authority signed is refused; trusted (SSL_CERT_FILE), it answers."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    async def go() -> None:
        engine = Engine(answer(OK))
        server = await asyncio.start_server(engine._serve, "127.0.0.1", 0, ssl=served)
        url = f"https://localhost:{server.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"):
                await Upstreams().post(url, "/", b"", {}, 5)
            monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))
            client = Upstreams()
            reply = await client.post(url, "/", b"", {}, 5)
            assert (reply.status, await reply.read()) == (200, b"{}")
            reply.release()
            await client.close()
        finally:
            server.close()
    run(go())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=3000), sizes=st.lists(st.integers(1, 700), min_size=1, max_size=8),
       cuts=st.lists(st.integers(1, 400), max_size=12), chunked=st.booleans())
def test_any_body_in_any_chunks_cut_anywhere_is_read_exactly(body: bytes, sizes: list[int], cuts: list[int],
                                                             chunked: bool) -> None:
    """However the engine frames the body (chunk sizes) and however the bytes arrive (writes cut anywhere, the
    head and chunk lines included), the body read is the body sent, and the connection is kept for the next."""
    if chunked:
        framed, at = b"", 0
        while at < len(body):
            part = body[at:at + sizes[at % len(sizes)]]
            framed += b"%x\r\n" % len(part) + part + b"\r\n"
            at += len(part)
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    else:
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, _: bytes) -> bool:
        at = 0
        for cut in cuts:
            writer.write(raw[at:at + cut])
            await writer.drain()
            await asyncio.sleep(0)
            at += cut
        writer.write(raw[at:])
        await writer.drain()
        return True

    async def go() -> None:
        async with Engine(script) as engine:
            client = Upstreams()
            assert (await asyncio.wait_for(post(client, engine), 5))[1] == body
            assert (await asyncio.wait_for(post(client, engine), 5))[1] == body
            assert engine.connections == 1
            await client.close()
    run(go())


def test_no_body_after_204_and_304_and_the_connection_is_kept() -> None:
    async def go() -> None:
        async with Engine(answer(b"HTTP/1.1 204 No Content\r\n\r\n")) as engine:
            client = Upstreams()
            for _ in range(2):
                assert (await asyncio.wait_for(post(client, engine), 5))[:2] == (204, b"")
            assert engine.connections == 1
            await client.close()
    run(go())


def test_an_answer_released_before_its_body_came_is_not_kept() -> None:
    body_now = asyncio.Event()

    async def go() -> None:
        async with Engine(in_two(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", body_now, b"stale")) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            reply.release()  # nothing read, and nothing of the body here yet
            body_now.set()
            await asyncio.sleep(0.05)
            _, data, _ = await asyncio.wait_for(post(client, engine), 5)
            assert data == b"stale" and engine.connections == 2  # its own answer, on a new connection
            await client.close()
    run(go())


def test_the_engine_urls_path_prefixes_the_target_and_a_query_is_refused() -> None:
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            reply = await client.post(engine.url + "/engine-a/", "/v1/completions?x=1", b"", {}, 5)
            await reply.read()
            reply.release()
            assert engine.requests[0][0].startswith(b"POST /engine-a/v1/completions?x=1 HTTP/1.1\r\n")
            with pytest.raises(ValueError, match="query"):
                await client.post(engine.url + "/?k=v", "/v1/completions", b"", {}, 5)
            await client.close()
    run(go())


def test_a_request_given_up_on_is_aborted_with_its_unsent_body() -> None:
    """An engine that stopped reading: the request is given up on (the caller's timeout), and the connection goes
    at once, the unsent part of a 32 MiB body with it (not written out should the engine read again)."""
    size = 32 * 2**20
    received: list[int] = []
    read_now = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_now.wait()
        n = 0
        try:
            while data := await reader.read(2**20):
                n += len(data)
        except ConnectionError:
            pass
        received.append(n)
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = Upstreams()
        try:
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.post(url, "/", b"x" * size, {}, 5), 0.3)
            read_now.set()
            for _ in range(100):
                if received:
                    break
                await asyncio.sleep(0.05)
            assert received and received[0] < size // 2
        finally:
            server.close()
            await client.close()
    run(go())


def test_idle_connections_past_idle_s_are_closed_as_others_are_kept_and_an_engines_when_it_leaves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            replies = [await client.post(engine.url, "/", b"", {}, 5) for _ in range(4)]  # four connections
            for reply in replies:
                await reply.read()
            conns = [reply._conn for reply in replies]
            for reply in replies[:3]:
                reply.release()
            monkeypatch.setattr(up, "IDLE_S", 0.05)
            await asyncio.sleep(0.1)
            fresh = conns[3]
            replies[3].release()  # keeping it closes the three
            assert all(conn is not None and conn.ended for conn in conns[:3])
            assert fresh is not None and not fresh.ended
            client.forget(engine.url + "/v1")
            assert fresh.ended
            assert engine.connections == 4
            await client.close()
    run(go())


def test_a_request_given_up_on_before_the_head_closes_the_connection() -> None:
    gone = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, _: bytes) -> bool:
        await reader.read()  # no answer; until the router leaves
        gone.set()
        return False

    async def go() -> None:
        async with Engine(script) as engine:
            client = Upstreams()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.post(engine.url, "/", b"", {}, 5), 0.2)
            await asyncio.wait_for(gone.wait(), 5)
            assert not client._idle.get(f"http://{engine.url[7:]}")
            await client.close()
    run(go())


def test_a_chunk_is_returned_before_its_closing_crlf_comes_and_lfs_in_bodies_are_data() -> None:
    """A chunk's data is passed on as soon as it is whole, its CRLF checked with the next chunk; an SSE body's
    blank lines arriving with the head are body, not a head's bare LFs."""
    rest = asyncio.Event()

    async def go() -> None:
        async with Engine(in_two(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n", rest,
                                 b"\r\n0\r\n\r\n")) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            assert await asyncio.wait_for(reply.readany(), 2) == b"data: 1\n\n"
            rest.set()
            assert await asyncio.wait_for(reply.readany(), 2) == b""
            reply.release()
            await client.close()
        async with Engine(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\ndata: 1\n\n")) as engine:
            client = Upstreams()
            assert (await asyncio.wait_for(post(client, engine), 5))[1] == b"data: 1\n\n"
            await client.close()
    run(go())


def test_an_answer_to_the_connections_end_cut_by_a_reset_raises() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, _: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # an RST, not a FIN
        return False

    async def go() -> None:
        async with Engine(script) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            with pytest.raises(UpstreamError, match="broke"):
                await asyncio.wait_for(reply.read(), 5)
            reply.close()
            await client.close()
    run(go())


def test_connections_kept_past_idle_s_are_pruned_with_no_request_and_a_kept_one_ending_is_not_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """prune() closes what no request will reuse (an engine nothing goes to any more); a kept connection the engine
    closes as it is reused raises UpstreamError, not ConnectionLost (which would mark a working engine down)."""
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            await post(client, engine)
            conn = client._idle[f"http://{engine.url[7:]}"][0]
            client.prune()
            assert not conn.ended
            monkeypatch.setattr(up, "IDLE_S", 0.05)
            await asyncio.sleep(0.1)
            client.prune()
            assert conn.ended and not client._idle
            await client.close()

        async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                          _: bytes) -> bool:
            if len(engine.requests) > 1:
                return False  # closes as the next request on the connection arrives, unanswered
            writer.write(OK)
            await writer.drain()
            return True

        monkeypatch.setattr(up, "IDLE_S", 60.0)
        async with Engine(closing) as engine:
            client = Upstreams()
            await post(client, engine)
            with pytest.raises(UpstreamError, match="kept connection ended") as ended:
                await asyncio.wait_for(client.post(engine.url, "/", b"", {}, 5), 5)
            assert not isinstance(ended.value, ConnectionLost)
            await client.close()
    run(go())


def test_an_answer_in_flight_when_its_engine_left_is_not_kept_after_it() -> None:
    async def go() -> None:
        async with Engine(answer(OK)) as engine:
            client = Upstreams()
            reply = await client.post(engine.url, "/", b"", {}, 5)
            client.forget(engine.url)  # the engine left while its answer came
            assert await reply.read() == b"{}"
            conn = reply._conn
            reply.release()
            assert conn is not None and conn.ended and not client._idle.get(f"http://{engine.url[7:]}")
            await post(client, engine)  # a connection opened after is kept
            assert client._idle[f"http://{engine.url[7:]}"]
            await client.close()
    run(go())
