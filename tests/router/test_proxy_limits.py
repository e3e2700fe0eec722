"""What a client can make the router do or hold (``limits``): prompt work off the event loop on a bounded pool,
the inflated body's cap, the engines' max_model_len, header and body deadlines, the connection cap. Against the
scripted engines of test_proxy.py, with real sockets where the attack is on the connection itself."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time

import aiohttp
import pytest

from kvtier.router.proxy import BUSY_PARSE_BYTES
from kvtier.router.reading import INLINE_BYTES
from tests.router.test_proxy import ScriptedEngine, WordTokenizer, post, run


# A prompt long enough to be read on a worker thread (a shorter completion is read on the event loop)
PAST_INLINE = " " + "x" * INLINE_BYTES


class GatedTokenizer(WordTokenizer):
    """Holds each prompt read on a worker until the test opens the gate (5 s at most): a prompt being tokenized, on
    demand. A short one passes (it is read on the event loop, which the gate would hold)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.done = threading.Event()
        self.calls = 0

    def completion(self, body):
        self.calls += 1
        if len(str(body.get("prompt"))) < INLINE_BYTES:
            return super().completion(body)
        self.started.set()
        self.gate.wait(5)
        try:
            return super().completion(body)
        finally:
            self.done.set()


class CountingTokenizer(WordTokenizer):
    def __init__(self) -> None:
        self.calls = 0

    def completion(self, body):
        self.calls += 1
        return super().completion(body)


async def until(condition, what: str, bound_s: float = 5.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        await asyncio.sleep(0.01)


def test_health_answers_while_a_huge_prompt_is_tokenized():
    """An 8 MiB prompt is tokenized on a worker: the loop answers /health in the meantime (on the loop, the
    tokenizer would hold it until the gate's 5 s ran out, and /health would answer after the prompt was done)."""
    tokenizer = GatedTokenizer()

    async def main(url, engines, app):
        prompt = asyncio.create_task(post(url, "ok " + "x" * 8 * 2**20))
        await until(tokenizer.started.is_set, "the prompt reached the tokenizer")
        async with aiohttp.ClientSession() as session, session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as reply:
            assert reply.status == 200
        assert not tokenizer.done.is_set()  # answered while the prompt was being tokenized
        tokenizer.gate.set()
        status, _, _ = await prompt
        assert status == 200 and len(engines[0].requests[0]["prompt"]) > 8 * 2**20
    run(main, tokenizer=tokenizer, limits={"max_prompt_tokens": 2**20})  # tokenized, not refused by its size


def test_a_full_pool_routes_small_bodies_without_a_prediction_and_refuses_large_ones():
    """Prediction is an optimisation, availability is not: with every worker busy (a prompt held in the
    tokenizer) a small request is routed at once without a prediction, untokenized, the report mode still dropped;
    one too large to parse on the event loop gets 429. A short completion is read on the event loop: it keeps
    its prediction."""
    tokenizer = GatedTokenizer()

    async def main(url, engines, app):
        first = asyncio.create_task(post(url, "ok a" + PAST_INLINE))
        await until(lambda: app.pool.pending == 1, "the first request on the worker")
        async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json={
                "model": "m", "prompt": "ok b" + PAST_INLINE, "stream": True,
                "vllm_xargs": {"kv_cache_report_mode": "full", "other": 1}}) as reply:
            assert reply.status == 200 and reply.headers["X-KVTier-Route-Reason"] == "unindexed"
            assert (await reply.read()).endswith(b"data: [DONE]\n\n")  # read as a stream
        assert tokenizer.calls == 1 and not tokenizer.done.is_set()  # routed while the first is still held
        assert [r["vllm_xargs"] for e in engines for r in e.requests] == [{"other": 1}]
        assert app.metrics.unpredicted.labels("busy")._value.get() == 1
        assert app.metrics.refused.labels("busy")._value.get() == 0
        # a body too large to parse on the event loop is refused instead, with Retry-After
        status, headers, body = await post(url, "ok " + "x" * (BUSY_PARSE_BYTES + 1))
        assert status == 429 and headers["Retry-After"] == "1" and json.loads(body)["error"]["type"] == "busy"
        assert app.metrics.refused.labels("busy")._value.get() == 1
        status, headers, _ = await post(url, "ok c")
        assert status == 200 and headers["X-KVTier-Route-Reason"] == "no_prefix" and tokenizer.calls == 2
        assert app.metrics.unpredicted.labels("busy")._value.get() == 1 and not tokenizer.done.is_set()
        tokenizer.gate.set()
        assert (await first)[0] == 200
        assert sum(len(e.requests) for e in engines) == 3
    run(main, tokenizer=tokenizer, policy="cache_aware", block_size=16, limits={"workers": 1, "queue": 0})


async def held_gzip(port: int, inflated: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sends a gzip body inflating to about ``inflated`` bytes, all but its last bytes, and
    holds: the router has inflated (and holds) nearly all of it, and waits for the rest."""
    bomb = gzip.compress(json.dumps({"model": "m", "prompt": "ok " + "x" * inflated}).encode())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb) + bomb[:-16])
    await writer.drain()
    return reader, writer


def test_bodies_being_read_share_one_budget_across_connections():
    """A few hundred bytes of gzip each make the router hold 700 KiB: the second such body is refused (503,
    Retry-After) once the router-wide budget (1 MiB here) is spent, while a small honest body still fits; what a
    connection held is given back when it goes."""
    async def main(url, engines, app):
        first = await held_gzip(app.port(), 700 * 1024)
        await until(lambda: app.bodies.held > 600 * 1024, "the first body inflated and held")
        reader, writer = await held_gzip(app.port(), 700 * 1024)
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
        assert b"limits.max_inflight_body_bytes" in answer
        writer.close()
        status, _, _ = await post(url, "ok x")  # its first 64 KiB are free of the budget
        assert status == 200
        assert app.metrics.refused.labels("body_budget")._value.get() == 1
        first[1].close()
        await until(lambda: app.bodies.held == 0, "the held body given back when its connection went")
        assert not any(e.requests[1:] for e in engines) and sum(len(e.requests) for e in engines) == 1
    run(main, limits={"max_body_bytes": 2**20, "max_inflight_body_bytes": 2**20})


def test_a_body_stays_charged_until_its_answer_is_sent():
    """A 700 KiB body whose answer streams: the router keeps the body for a retry and, before, gave its charge
    back once keyed, so bodies of answers in flight were held uncounted (one per connection); now the charge goes
    when the answer ends (here: when its client leaves)."""
    async def main(url, engines, app):
        request = asyncio.create_task(post(url, "stall " + "x" * 700 * 1024, stream=True))
        await until(lambda: sum(len(e.requests) for e in engines) == 1, "the engine answering")
        assert app.bodies.held > 600 * 1024
        reader, writer = await held_gzip(app.port(), 700 * 1024)
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 503 ")  # the budget holds the body being answered
        writer.close()
        request.cancel()
        await until(lambda: app.bodies.held == 0, "the charge given back when the client went")
    run(main, limits={"max_body_bytes": 2**20, "max_inflight_body_bytes": 2**20})


def test_a_gzip_bomb_is_refused_with_413_before_it_is_all_sent():
    """32 MiB of JSON in 32 KiB of gzip: refused once 16 MiB (limits.max_body_bytes' default) are inflated, while
    a quarter of it is still unsent, and the connection is closed (its rest is not read, not inflated)."""
    bomb = gzip.compress(json.dumps({"model": "m", "prompt": "ok " + "x" * 32 * 2**20}).encode(), compresslevel=6)

    async def main(url, engines, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port())
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb))
        writer.write(bomb[:len(bomb) * 3 // 4])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # the answer, then the end of the connection
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"limits.max_body_bytes" in answer
        writer.close()
        assert not engines[0].requests and not engines[1].requests
        assert app.metrics.refused.labels("body_too_large")._value.get() == 1
    run(main)


def test_a_body_over_the_cap_by_its_length_is_refused_unread():
    async def main(url, engines, app):
        status, headers, _ = await post(url, "ok " + "x" * 4096)
        assert status == 413 and headers.get("Connection") == "close"
        status, _, _ = await post(url, "ok small")
        assert status == 200
    run(main, limits={"max_body_bytes": 2048})


class LongModelEngine(ScriptedEngine):
    async def models(self, request):
        from aiohttp import web
        return web.json_response({"data": [{"id": "m", "max_model_len": 16}]})


def test_prompts_over_max_prompt_tokens_go_without_a_prediction_until_engines_say_more():
    """Before (or without) a max_model_len from the engines, limits.max_prompt_tokens bounds what is keyed."""
    tokenizer = CountingTokenizer()

    async def main(url, engines, app):
        assert app.engines.max_model_len is None
        _, headers, _ = await post(url, "ok " + "w " * 8)
        assert headers["X-KVTier-Route-Reason"] == "no_prefix"
        _, headers, _ = await post(url, "ok " + "w " * 20)
        assert headers["X-KVTier-Route-Reason"] == "unindexed" and tokenizer.calls == 2
    run(main, tokenizer=tokenizer, policy="cache_aware", limits={"max_prompt_tokens": 16})


def test_prompts_longer_than_max_model_len_go_without_a_prediction():
    """max_model_len from the engines' /v1/models: a prompt of more tokens is routed unindexed (the engine answers
    it as it sees fit), and a body over 16 bytes a token of it is not even tokenized."""
    tokenizer = CountingTokenizer()

    async def main(url, engines, app):
        assert app.engines.max_model_len == 16
        _, headers, _ = await post(url, "ok " + "w " * 8)
        assert headers["X-KVTier-Route-Reason"] == "no_prefix" and tokenizer.calls == 1
        status, headers, _ = await post(url, "ok " + "w " * 20)  # 21 tokens
        assert status == 200 and headers["X-KVTier-Route-Reason"] == "unindexed" and tokenizer.calls == 2
        status, headers, _ = await post(url, "ok " + "w" * 300)  # 2 tokens, but over 16 x 16 bytes: not tokenized
        assert status == 200 and headers["X-KVTier-Route-Reason"] == "unindexed" and tokenizer.calls == 2
        assert app.metrics.unpredicted.labels("too_long")._value.get() == 2
        assert len(engines[0].requests) + len(engines[1].requests) == 3
    run(main, engine_class=LongModelEngine, tokenizer=tokenizer, policy="cache_aware")


async def closed(reader: asyncio.StreamReader, bound_s: float) -> bytes:
    """What the router sent before closing the connection (fails if still open after ``bound_s``)."""
    try:
        return await asyncio.wait_for(reader.read(), bound_s)
    except ConnectionResetError:
        return b""


def test_half_sent_requests_are_closed_at_their_deadline_and_honest_ones_pass():
    """Slowloris: 20 connections with headers half sent and 20 with bodies half sent are closed after
    limits.header_s and limits.body_s (0.5 s here; generous bound 5 s), while a whole request is served."""
    async def main(url, engines, app):
        slow = []
        for i in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", app.port())
            if i % 2:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
            else:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            slow.append((reader, writer))
        status, _, _ = await post(url, "ok x")
        assert status == 200
        answers = await asyncio.gather(*(closed(reader, 5) for reader, _ in slow))
        assert all(a == b"" for a in answers[1::2])  # headers never complete: closed without a word
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers[0::2])
        for _, writer in slow:
            writer.close()
        assert app.metrics.refused.labels("body_timeout")._value.get() == 20
    run(main, limits={"header_s": 0.5, "body_s": 0.5})


@pytest.mark.parametrize("on_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_at_the_cap_the_oldest_idle_connection_makes_room(on_uvloop: bool):
    """max_connections (4) half-sent requests (headers never finished, well within header_s) do not lock anyone
    out: a new connection closes the oldest idle one, and an honest request is served."""
    async def main(url, engines, app):
        held = []
        for _ in range(4):
            reader, writer = await asyncio.open_connection("127.0.0.1", app.port())
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            held.append((reader, writer))
        await until(lambda: app._sites["client"].open == 4, "4 connections counted")
        status, _, _ = await post(url, "ok x")
        assert status == 200
        assert await closed(held[0][0], 2) == b""  # the oldest went, without a word
        assert app.metrics.evicted_connections.labels("client")._value.get() == 1
        assert app.metrics.refused_connections.labels("client")._value.get() == 0
        assert not any(reader.at_eof() for reader, _ in held[1:])
        for _, w in held:
            w.close()
    run(main, on_uvloop=on_uvloop, limits={"max_connections": 4, "header_s": 30})


@pytest.mark.parametrize("on_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_at_the_cap_with_every_connection_busy_a_new_one_is_closed_at_once(on_uvloop: bool):
    """4 connections with requests in flight (held in the tokenizer): a 5th is closed as it is accepted, none of
    the 4 is touched, and all 4 are answered."""
    tokenizer = GatedTokenizer()

    async def main(url, engines, app):
        busy = [asyncio.create_task(post(url, f"ok {i}" + PAST_INLINE)) for i in range(4)]
        await until(lambda: app.pool.pending == 4, "4 requests in flight")
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port())
        assert await closed(reader, 2) == b""  # well before the 30 s header deadline
        writer.close()
        assert app.metrics.refused_connections.labels("client")._value.get() == 1
        assert app.metrics.evicted_connections.labels("client")._value.get() == 0
        tokenizer.gate.set()
        assert [(await b)[0] for b in busy] == [200] * 4
    run(main, tokenizer=tokenizer, on_uvloop=on_uvloop,
        limits={"max_connections": 4, "header_s": 30, "workers": 4, "queue": 0})


class FloodingEngine(ScriptedEngine):
    """Streams 64 MiB of events as fast as it may; records being aborted."""

    async def completions(self, request):
        from aiohttp import web
        await request.read()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        event = b"data: " + b"x" * 65530 + b"\n\n"
        try:
            for _ in range(1024):
                await reply.write(event)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        return reply


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted():
    """Slow read: a client that takes nothing for timeouts.idle_s (1 s here) is treated as gone; the engine's
    request is aborted rather than held for the whole generation (bound 10 s)."""
    async def main(url, engines, app):
        body = json.dumps({"model": "m", "prompt": "ok x", "stream": True}).encode()
        _reader, writer = await asyncio.open_connection("127.0.0.1", app.port())
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)  # and never read the answer
        await until(lambda: engines[0].aborted == 1, "the engine's request aborted", 10)
        assert app.metrics.client_aborts.labels("e0")._value.get() == 1
        writer.close()
    run(main, n=1, engine_class=FloodingEngine)
