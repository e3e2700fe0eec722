"""A scripted vLLM engine that caches prompts and publishes its KV events as vLLM does, for the router's tests and
benchmarks of its decisions (replicas agreeing, a late replica catching up, a burst split over replicas).

:class:`CachingEngine` serves ``/health``, ``/v1/models`` and ``/v1/completions`` for prompts given as token ids.
It holds every full block it computed (an unbounded prefix cache), answers with ``cached_tokens`` as vLLM's usage
does, waits ``seconds_per_token`` for each token it computes, and publishes a ``BlockStored`` event per request on
a ZMQ PUB socket (vLLM's frames: topic, 8-byte sequence number, msgpack ``[ts, events]``), with a replay socket
(ROUTER) that sends the batches from a sequence number on, then the end marker, as vLLM's replay buffer does.
:class:`TokenIds` stands in for the router's tokenizer: a prompt is its token ids.

It models what the router reads, not an engine's speed: decisions measured against it are the router's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from kvtier.testing.servers import free_port

END_SEQ = -1  # vLLM's replay end marker


class TokenIds:
    """The router's tokenizer for prompts given as token ids."""

    def completion(self, body: Mapping[str, object]) -> list[int]:
        prompt = body.get("prompt")
        assert isinstance(prompt, list), "scripted engines take prompts as token ids"
        return [int(t) for t in prompt]

    def chat(self, body: Mapping[str, object]) -> list[int]:
        raise AssertionError("scripted engines take completions only")


class CachingEngine:
    """One scripted engine on ``host`` (its API, events and replay ports chosen free), from :meth:`start` to
    :meth:`stop`."""

    def __init__(self, name: str, block_size: int, seconds_per_token: float = 0.0, host: str = "127.0.0.1") -> None:
        self.name = name
        self.block_size = block_size
        self.seconds_per_token = seconds_per_token
        self.host = host
        self.blocks: dict[tuple[int, ...], int] = {}  # a prefix of full blocks: its block's hash
        self.served: list[tuple[int, int]] = []  # (prompt tokens, cached tokens) of each request
        self.history: list[tuple[int, bytes]] = []  # (seq, payload) published
        self.events_port = free_port()
        self.replay_port = free_port()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: asyncio.Task[None] | None = None

    def router_entry(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "kv_events": f"tcp://{self.host}:{self.events_port}",
                "kv_events_replay": f"tcp://{self.host}:{self.replay_port}"}

    async def start(self) -> CachingEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # aiohttp's own server
        self.url = f"http://{self.host}:{port}"
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(f"tcp://{self.host}:{self.events_port}")
        replay = self._ctx.socket(zmq.ROUTER)
        replay.bind(f"tcp://{self.host}:{self.replay_port}")
        self._replay = asyncio.get_running_loop().create_task(self._serve_replay(replay))
        return self

    async def stop(self) -> None:
        if self._replay is not None:
            self._replay.cancel()
            await asyncio.gather(self._replay, return_exceptions=True)
        if self._pub is not None:
            self._pub.close(0)
        if self._ctx is not None:
            self._ctx.destroy(0)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                ident, _, start = await sock.recv_multipart()
                first = int.from_bytes(start, "big", signed=True)
                for seq, payload in self.history:
                    if seq >= first:
                        await sock.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big", signed=True), payload])
                await sock.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])
        finally:
            sock.close(0)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 1 << 20}]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = [int(t) for t in body["prompt"]]
        cached = self._cached(tokens)
        await asyncio.sleep((len(tokens) - cached) * self.seconds_per_token)
        await self._store(tokens, cached)
        self.served.append((len(tokens), cached))
        return web.json_response({"choices": [{"text": "ok"}],
                                  "usage": {"prompt_tokens": len(tokens),
                                            "prompt_tokens_details": {"cached_tokens": cached}}})

    def _cached(self, tokens: Sequence[int]) -> int:
        """The prompt's cached prefix in whole blocks, short of its last token (which vLLM always computes)."""
        bs, n = self.block_size, 0
        while (n + 1) * bs <= len(tokens) - 1 and tuple(tokens[:(n + 1) * bs]) in self.blocks:
            n += 1
        return n * bs

    async def _store(self, tokens: Sequence[int], cached: int) -> None:
        bs = self.block_size
        full = len(tokens) // bs * bs
        if full <= cached:
            return
        parent = self.blocks.get(tuple(tokens[:cached])) if cached else None
        hashes = []
        for end in range(cached + bs, full + 1, bs):
            h = hash((self.name, tuple(tokens[:end]))) & (2**63 - 1)
            self.blocks[tuple(tokens[:end])] = h
            hashes.append(h)
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                 "token_ids": list(tokens[cached:full]), "block_size": bs}
        seq = len(self.history)
        payload = msgpack.packb([time.time(), [event]])
        self.history.append((seq, payload))
        assert self._pub is not None
        await self._pub.send_multipart([b"kv", seq.to_bytes(8, "big", signed=True), payload])
