"""Choosing an engine: predicted time to first token per engine, or round-robin, or session affinity.

Cache-aware routing predicts, for every healthy engine,

    TTFT = wait + prefill_s_per_token x tokens it would compute + load_s_per_token[place] x tokens kvtier loads

where ``wait`` is the router's own account of the engine (the prefill left of requests it sent there and has not
seen start answering, plus a cost per request decoding there), and takes the smallest; engines near it are told
apart by what the request adds to each (:meth:`Router._order_near`), and a hot prefix's holder gives requests to
the least busy engine (:meth:`Router._balanced`). Accounting happens at
decision time, before any event arrives: the request's blocks are reserved on its engine and its prefill
counts in that engine's wait at once. Prefill cost per token is calibrated per engine, online, from the
engines' own prefill counters and from the first bytes the router sees: each update steps toward the median of
the engine's last samples (its first calibration waits for a few), so one odd sample moves nothing far. A prompt
the engine reads nothing of from its cache (:attr:`Prompt.uncached`) is predicted to compute every token.

With engines of role ``prefill`` (disaggregated prefill and decode, docs/pd.md), :meth:`Router.plan` picks the
engine that answers first, among those of role ``decode`` or ``both``: by its wait and the cost of loading the
prompt, what it holds from where it sits and the rest from the shared tier once a prefill engine stored it. A
prompt that engine would compute fewer than ``pd.local_tokens`` tokens of is served there whole (a follow-up
turn stays local); a longer one is first prefilled on a prefill engine, picked by the same predicted time as
any request, its blocks reserved there at once (so a burst sharing a new prefix goes to the same one).

Nothing here does I/O: the proxy calls :meth:`Router.plan`, then :meth:`Router.started` /
:meth:`Router.first_byte` / :meth:`Router.finished` as the request goes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import statistics
import time
from collections import deque
from collections.abc import Sequence

from kvtier.router.config import Costs, EngineConfig, Role, RouterConfig
from kvtier.router.index import LOCAL_PLACES, Match, PrefixIndex, request_keys
from kvtier.router.prompts import Prompt

_EWMA = 0.3  # weight of a new calibration sample
_BAND = 2.0  # a sample moves a calibrated value by at most this factor: one odd request cannot swing routing
_WINDOW = 5  # prefill samples kept per engine: a calibration steps toward their median
_FIRST = 3  # prefill samples before an engine's own calibration replaces the configured cost (their median)
_BALANCE_BOUND = 4.0  # balance and near equals by queue: only engines predicted at most this many times the best
_NEAR_TIE = 0.25  # predicted times within 25% of the best plus one block's prefill are a near tie


def _step(current: float, sample: float, floor: float = 1e-6) -> float:
    """``current`` moved toward ``sample`` (kept within a factor of :data:`_BAND` of ``current``)."""
    ref = max(current, floor)
    return current + _EWMA * (min(max(sample, ref / _BAND), ref * _BAND) - current)


@dataclasses.dataclass
class Flight:
    """One request the router sent to an engine and has not seen finish."""

    prefill_s: float
    load_s: float
    queued_s: float  # prefill and loads of requests ahead of it, at decision time
    decoding: int  # requests answering on the engine at decision time
    uncached: int
    keys: Sequence[bytes] = ()  # its prompt's block keys (which prefix it shares with another request)
    reserved: Sequence[bytes] = ()  # blocks credited to the engine before its events
    started: float = dataclasses.field(default_factory=time.monotonic)
    answering: bool = False


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    """One engine the policy would send a request to, with why and what it predicts there (named apart from
    :class:`kvtier.placement.Decision`, which says where a namespace's KV may be stored)."""

    engine: str
    reason: str  # prefix | load | no_prefix | round_robin | session | unindexed
    match: Match
    predicted_cached: int  # tokens the engine should find cached (what vLLM reports as cached_tokens)
    predicted_s: float
    uncached: int
    load_s: float
    wait_s: float  # queued_s plus what the requests decoding there add
    queued_s: float
    decoding: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where a request goes: ``serve``, the engines that may answer it, in the order to try them; ``prefill``,
    the prefill engines to compute its prompt first, in order (empty: served whole)."""

    serve: list[RouteDecision]
    prefill: list[RouteDecision] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Signals:
    """An engine's load as the router accounts it: what an autoscaler scales on (:meth:`Router.signals`)."""

    queued: int  # requests sent there whose prefill (or load) the router predicts is not done
    queued_tokens: int  # the tokens those compute
    in_flight: int  # requests sent there and not finished
    in_flight_tokens: int  # the tokens those computed or compute
    ttft_s: float  # a new one-block request's predicted time to first token there, now


class EngineState:
    def __init__(self, name: str, costs: Costs, weight: float, role: Role = "both") -> None:
        self.name = name
        self.role = role
        self.weight = weight
        self.healthy = False
        self.prefill_s_per_token = 1 / costs.prefill_tokens_per_s / weight
        self.calibrated = False  # until then the fleet's calibrated engines speak for it
        self._prefill_samples: deque[float] = deque(maxlen=_WINDOW)
        # What each request decoding on the engine adds to a new one's wait (its steps share the engine):
        # calibrated from TTFTs observed with others decoding.
        self.decode_s = costs.decode_s_per_request
        self.base_s = 0.0  # what a request costs beyond prefill and loads (scheduling, one decode step, HTTP)
        self.flights: dict[int, Flight] = {}
        self.placed = 0.0  # requests sent here with a prompt no engine held any of, over the engine's weight

    def waiting(self, now: float) -> tuple[list[Flight], float]:
        """The requests not yet answering whose predicted prefill (or load) is not done, and when the last is. The
        engine prefills them one after another in the order sent: each ends after those before it, not after its
        own time alone, so k queued requests take k prefills to drain. A request whose answer the router does not
        stream to see (not streamed) counts as answering once its turn's predicted prefill has passed."""
        waiting, done = [], 0.0
        for f in sorted((f for f in self.flights.values() if not f.answering), key=lambda f: f.started):
            done = max(done, f.started) + f.prefill_s + f.load_s
            if done > now:
                waiting.append(f)
        return waiting, done

    def load(self, now: float) -> tuple[float, int]:
        """(prefill and load time left of the requests waiting, requests answering: :meth:`waiting`)."""
        waiting, done = self.waiting(now)
        return max(0.0, done - now), len(self.flights) - len(waiting)

    def calibrate_prefill(self, seconds_per_token: float) -> None:
        """One sample of the prefill cost. The median of the last few is what counts: a sample far off (a whole
        answer timed as a first byte, a request stuck behind another) is outvoted by its neighbours, the first
        included, and the median moves a calibrated value by a bounded step."""
        if not 0 < seconds_per_token < 1:
            return
        self._prefill_samples.append(seconds_per_token)
        if len(self._prefill_samples) < _FIRST:
            return
        median = statistics.median(self._prefill_samples)
        if self.calibrated:
            self.prefill_s_per_token = _step(self.prefill_s_per_token, median)
        else:
            self.prefill_s_per_token, self.calibrated = median, True


class Router:
    """The fleet as the policy sees it: engine states, the prefix index, the configured costs."""

    def __init__(self, config: RouterConfig, index: PrefixIndex) -> None:
        self.config = config
        self.index = index
        self.engines = {e.name: EngineState(e.name, config.costs, e.weight, e.role) for e in config.engines}
        self.disaggregated = any(e.role == "prefill" for e in config.engines)
        self._next = itertools.count()
        self._ids = itertools.count()

    def add(self, engine: EngineConfig) -> None:
        """An engine joins the fleet: not routed to until it is healthy (and its events replayed). It counts as
        having been sent as many new prompts as the engine sent the fewest: new prompts spread over the fleet, not
        all to it until it has caught up."""
        floor = min((e.placed for e in self.engines.values()), default=0.0)
        self.engines[engine.name] = EngineState(engine.name, self.config.costs, engine.weight, engine.role)
        self.engines[engine.name].placed = floor
        self.disaggregated = any(e.role == "prefill" for e in self.engines.values())

    def remove(self, name: str) -> None:
        """An engine left the fleet: nothing more is routed there (its index entries are the caller's to clear:
        :meth:`PrefixIndex.leaving`, in slices). Its requests in flight run to their end; their accounting ends
        with them."""
        self.engines.pop(name, None)
        self.disaggregated = any(e.role == "prefill" for e in self.engines.values())

    def reconfigure(self, engine: EngineConfig) -> None:
        """An engine's weight or role changed (its address and events did not): its state, calibration and
        requests in flight are kept."""
        state = self.engines[engine.name]
        if not state.calibrated:
            state.prefill_s_per_token = state.prefill_s_per_token * state.weight / engine.weight
        state.weight, state.role = engine.weight, engine.role
        self.disaggregated = any(e.role == "prefill" for e in self.engines.values())

    def healthy(self) -> list[str]:
        return [name for name, e in self.engines.items() if e.healthy]

    def answering(self) -> list[str]:
        """The healthy engines that answer clients (every role but prefill)."""
        return [name for name, e in self.engines.items() if e.healthy and e.role != "prefill"]

    def plan(self, prompt: Prompt | None, session: str | None = None, keys: Sequence[bytes] | None = None) -> Plan:
        """Where a request goes (:class:`Plan`); ``serve`` is empty when no engine that answers is healthy."""
        serve = self.decide(prompt, session, keys, self.answering())
        prefills = [n for n in self.healthy() if self.engines[n].role == "prefill"]
        # A prompt the engine reads nothing of from a cache (prompt_logprobs, echo with logprobs) would be computed
        # twice: served whole
        if not serve or not prefills or prompt is None or prompt.uncached is not None:
            return Plan(serve)
        local = self._local(serve)
        if local is not None:
            return Plan([local, *(dataclasses.replace(d, reason="retry") for d in serve if d.engine != local.engine)])
        if keys is None:
            keys = self.keys(prompt)
        n_tokens = len(prompt.tokens)
        cap = max(0, (n_tokens - 1) // self.config.block_size * self.config.block_size)
        rate = self.config.costs.shared_tokens_per_s
        handed: list[RouteDecision] = []
        for d in serve:  # each engine's cost with the prompt computed elsewhere, loaded from the shared tier
            load_s = d.load_s + max(0, cap - d.predicted_cached) / rate
            engine = self.engines[d.engine]
            seconds = d.wait_s + engine.base_s + (n_tokens - cap) * self.prefill_rate(engine) + load_s
            handed.append(dataclasses.replace(d, reason="pd", predicted_cached=max(cap, d.predicted_cached),
                                              predicted_s=seconds, uncached=n_tokens - max(cap, d.predicted_cached),
                                              load_s=load_s))
        handed.sort(key=lambda d: (round(d.predicted_s, 4), self._busy(d.engine)))
        handed = [dataclasses.replace(d, reason="pd" if i == 0 else "retry") for i, d in enumerate(handed)]
        return Plan(handed, self._prefill_order(self.decide(prompt, None, keys, prefills)))

    def _local(self, serve: list[RouteDecision]) -> RouteDecision | None:
        """The engine to serve a request whole, with no prefill hop: of those that would compute fewer than
        ``pd.local_tokens`` uncached tokens, and are the policy's first or predicted within a near tie of the best,
        the one computing the fewest (a follow-up turn stays where its prefix is), the first in ``serve``'s order
        among equals (the policy's: shorter queues first). Its reason is the policy's when it is the policy's
        first, else ``prefix`` when it holds the most of the prompt, ``load`` when another holds more."""
        best = min(serve, key=lambda d: d.predicted_s)
        bound = self._tie(best.predicted_s, best.engine)
        near = [d for d in serve
                if d.uncached < self.config.pd.local_tokens and (d is serve[0] or d.predicted_s <= bound)]
        local = min(near, key=lambda d: d.uncached, default=None)
        if local is None or local is serve[0]:
            return local
        most = max(d.match.blocks for d in serve)
        return dataclasses.replace(local, reason="prefix" if local.match.blocks == most else "load")

    def _tie(self, best_s: float, engine: str) -> float:
        """The latest predicted time that is a near tie of the best, ``best_s`` (of ``engine``): the best, a share
        of it, and one block's prefill (what a near tie can hide on fast engines too)."""
        return best_s + best_s * _NEAR_TIE + self.config.block_size * self.prefill_rate(self.engines[engine])

    def _prefill_order(self, order: list[RouteDecision]) -> list[RouteDecision]:
        """Prefill engines by predicted time, except that one holding (or computing: its reservations) at least
        ``pd.local_tokens`` of the prompt goes first unless it is later than the best by more than computing that
        prefix again: a burst sharing a new prefix is then prefilled once (the proxy's hop waits for the first)."""
        bs = self.config.block_size
        holder = max(order, key=lambda d: d.match.blocks)
        if holder is order[0] or holder.match.blocks * bs < self.config.pd.local_tokens:
            return order
        again = holder.match.blocks * bs * self.prefill_rate(self.engines[order[0].engine])
        if holder.predicted_s > order[0].predicted_s + again:
            return order
        return [holder, *(d for d in order if d is not holder)]

    def keys(self, prompt: Prompt) -> list[bytes]:
        """The prompt's block keys: none when its tokens are not the engine's (it cannot be keyed)."""
        if prompt.uncached is not None and not prompt.uncached.stored:
            return []
        return request_keys(prompt.tokens, self.config.block_size, lora_name=prompt.lora_name,
                            cache_salt=prompt.cache_salt)

    def decide(self, prompt: Prompt | None, session: str | None = None,
               keys: Sequence[bytes] | None = None, names: list[str] | None = None) -> list[RouteDecision]:
        """Healthy engines (of ``names``, default all) in the order to try them; empty when none is healthy.
        ``keys``: the prompt's block keys, when the caller has them already."""
        names = self.healthy() if names is None else names
        if not names:
            return []
        if keys is None:
            keys = self.keys(prompt) if prompt is not None else []
        # An uncached prompt's keys (the engine still stores its blocks) are for reserving, not matching
        reads = prompt is None or prompt.uncached is None
        matches = self.index.match(keys, names) if keys and reads else {n: Match() for n in names}
        n_tokens = len(prompt.tokens) if prompt is not None else 0
        now = time.monotonic()
        costed = {n: self._cost(n, matches[n], n_tokens, now) for n in names}
        policy = self.config.policy
        if policy == "round_robin" or (policy == "session" and not session):
            start = next(self._next) % len(names)
            order = names[start:] + names[:start]
            reason = "round_robin"
        elif policy == "session":
            assert session is not None
            # Rendezvous hashing: a session keeps its engine while that engine is healthy, and only the
            # sessions of an engine that leaves move.
            order = sorted(names, key=lambda n: hashlib.blake2b(f"{session}\0{n}".encode(), digest_size=8).digest(),
                           reverse=True)
            reason = "session"
        else:
            tie = next(self._next)
            # Among equals, engines take turns: each decision starts the fleet's list one place further
            turn = {n: (i - tie) % len(names) for i, n in enumerate(names)}
            order = sorted(names, key=lambda n: (round(costed[n].predicted_s, 4), self._busy(n), turn[n]))
            near = self._near(order, costed)
            best_blocks = max(m.blocks for m in matches.values())
            self._order_near(near, costed, matches if best_blocks else None, n_tokens, turn)
            close = set(near)
            order = near + [n for n in order if n not in close]
            balanced = self._balanced(order, costed, turn, keys)
            first = matches[order[0]].blocks
            reason = ("balance" if balanced else "unindexed" if prompt is None else "no_prefix" if best_blocks == 0
                      else "prefix" if first == best_blocks else "load")
        return [dataclasses.replace(costed[n], reason=reason if i == 0 else "retry") for i, n in enumerate(order)]

    def _order_near(self, near: list[str], costed: dict[str, RouteDecision], matches: dict[str, Match] | None,
                    n_tokens: int, turn: dict[str, int]) -> None:
        """Sort the near equals (in place) by what the request adds to each, not by their predictions: the
        calibrated costs are estimates, and between near equals their noise decides nothing well. ``matches``
        None: no engine holds any of the prompt.

        - Fewest tokens to compute from what each holds (announced blocks or kvtier's; blocks reserved by a request
          still computing them aside: another engine computing those is no slower than waiting for them, and
          under one hot prefix both then hold it from the start). A holder behind a queue is no slower than an
          engine computing the prompt again, and the fleet computes it once (under prefix_repetition a document's
          requests went to the other engine, and its second copy pushed another document out). Only engines
          predicted within a near tie of the best count what they hold: one admitted with its decoding set aside,
          up to 4x the best, earns nothing over a queue for holding more than those.
        - Then fewest requests waiting for their first token (requests prefilled together finish together, and
          their client's next ones, by requests in flight alone, went together to the engine they had left and
          were prefilled in one step again); then fewest in flight; then turns.
        - A prompt no engine holds: fewest requests waiting for their first token, then the fewest new prompts
          sent there (over weights), then turns: what is new spreads evenly over the engines' caches (by queue
          alone a run's twelve new documents went eight to one engine and four to the other, and the eight pushed
          one another out of its DRAM).
        """
        if matches is None:
            near.sort(key=lambda n: (self._unanswered(n, costed[n]), self.engines[n].placed, turn[n]))
            return
        bs = self.config.block_size
        cap = max(0, (n_tokens - 1) // bs * bs)
        computes = {n: n_tokens - min(max(matches[n].announced, matches[n].kvtier) * bs, cap) for n in near}
        bound = self._tie(costed[near[0]].predicted_s, near[0])  # near[0]: the best prediction (_near keeps order)
        plain = {n for n in near if costed[n].predicted_s <= bound}
        floor = min(computes[n] for n in plain)
        for n in near:
            if n not in plain:
                computes[n] = max(computes[n], floor)
        near.sort(key=lambda n: (computes[n], self._unanswered(n, costed[n]), self._busy(n), turn[n]))

    def _near(self, order: list[str], costed: dict[str, RouteDecision]) -> list[str]:
        """The engines (of ``order``, by predicted time) near enough to the best to be told apart by their queues
        alone: those predicted within a near tie of it, and, of those predicted at most :data:`_BALANCE_BOUND` times
        the best, those whose prediction without what their decoding requests add (queued prefills and loads, base
        cost, their own prefill and loads) is within a near tie of the lowest such. What decoding requests add is a
        prediction's least certain part: calibrated from TTFTs that absorb whatever else slows a loaded machine,
        while vLLM fits a queued prefill into the step the decoding requests run in. (Under one hot prefix, a burst
        of four went whole to the engine with fewer requests decoding, three of them answered in 630 ms, while
        the other was predicted 760 ms away by its decoding requests alone.)"""
        first = costed[order[0]]

        def undecoded(n: str) -> float:
            d = costed[n]
            return d.predicted_s - (d.wait_s - d.queued_s)

        bounded = {n for n in order if costed[n].predicted_s <= _BALANCE_BOUND * first.predicted_s}
        low = min((n for n in order if n in bounded), key=undecoded)  # its own tie: the best's decoding widens none
        tie = self._tie(first.predicted_s, order[0])
        tie_undecoded = self._tie(undecoded(low), low)
        return [n for n in order if costed[n].predicted_s <= tie or (n in bounded and undecoded(n) <= tie_undecoded)]

    def _busy(self, name: str) -> float:
        """Requests in flight on an engine, over its weight."""
        return len(self.engines[name].flights) / self.engines[name].weight

    def _unanswered(self, name: str, decision: RouteDecision) -> float:
        """Requests on an engine not yet answering (their prefill or load predicted not done at ``decision``),
        over its weight."""
        engine = self.engines[name]
        return (len(engine.flights) - decision.decoding) / engine.weight

    def _balanced(self, order: list[str], costed: dict[str, RouteDecision], turn: dict[str, int],
                  keys: Sequence[bytes]) -> bool:
        """Put the least busy engine first (in place) when the first has more than ``balance_requests`` more
        requests in flight than it (each count over the engine's weight), counting on the first only those sharing
        the prefix it holds of this prompt (all when it holds none), and the least busy is predicted at most
        :data:`_BALANCE_BOUND` times the best prediction (not the first's: a near equal put first may be slower
        itself): a hot prefix's holder would otherwise take every request while its queue looked short, and the
        other engine, once it computed the prefix, holds it too. A holder busy with other prompts keeps what it
        holds (its queue is in its prediction): moved away, a request computes its prefix again and its second copy
        pushes another out (under prefix_repetition, a few times a run, a document's request went to the other
        engine, twice as slow predicted). Never for a request that would cost far more elsewhere (a long prompt
        cached on the busy engine, a long queue on the idle one). Among equally busy engines, the first in
        ``turn``. Whether it did."""
        balance = self.config.balance_requests
        if balance is None or len(order) < 2:
            return False

        idle = min(order, key=lambda n: (self._busy(n), turn[n]))
        first = order[0]
        best = min(costed[n].predicted_s for n in order)
        if self._sharing(first, keys, costed[first].match.blocks) <= self._busy(idle) + balance or \
                costed[idle].predicted_s > _BALANCE_BOUND * best:
            return False
        order.remove(idle)
        order.insert(0, idle)
        return True

    def _sharing(self, name: str, keys: Sequence[bytes], blocks: int) -> float:
        """Requests in flight on an engine whose prompts start with the first ``blocks`` of ``keys`` (all of them
        when ``blocks`` is 0), over its weight; ``blocks``: at most the keys' (a match counts along them). A block's
        key names every token before it too: one key compared."""
        engine = self.engines[name]
        if blocks == 0:
            return self._busy(name)
        last = keys[blocks - 1]
        return sum(1 for f in engine.flights.values()
                   if len(f.keys) >= blocks and f.keys[blocks - 1] == last) / engine.weight

    def _cost(self, name: str, match: Match, n_tokens: int, now: float) -> RouteDecision:
        """The engine's predicted TTFT for a prompt of ``n_tokens`` of which ``match`` is cached (reason unset)."""
        engine = self.engines[name]
        bs = self.config.block_size
        costs = self.config.costs
        # vLLM never takes the prompt's last token from a cache: it computes at least one token.
        cap = max(0, (n_tokens - 1) // bs * bs)
        own = min(match.engine * bs, cap)
        # kvtier serves the blocks it holds of the prompt from the first, up to where vLLM's hit may go: whole
        # chunks, then a tail (the blocks it announces past whole chunks are always a stored tail's)
        kvtier_end = min(match.kvtier * bs, cap)
        cached = max(own, kvtier_end)
        left = cached - own  # loaded by kvtier, from its places in order past the engine's hit
        load_s = 0.0
        for blocks, rate in ((match.host, costs.host_tokens_per_s), (match.disk, costs.disk_tokens_per_s),
                             (match.shared, costs.shared_tokens_per_s)):
            tokens = min(blocks * bs, left)
            load_s += tokens / rate
            left -= tokens
        uncached = n_tokens - cached
        queued, decoding = engine.load(now)
        wait = queued + decoding * engine.decode_s
        seconds = wait + engine.base_s + uncached * self.prefill_rate(engine) + load_s
        return RouteDecision(engine=name, reason="", match=match, predicted_cached=cached, predicted_s=seconds,
                        uncached=uncached, load_s=load_s, wait_s=wait, queued_s=queued, decoding=decoding)

    def signals(self, name: str) -> Signals:
        """Engine ``name``'s load now (a one-block request's predicted TTFT: its wait, base cost and one block's
        prefill, as :meth:`decide` predicts it)."""
        engine = self.engines[name]
        now = time.monotonic()
        waiting, done = engine.waiting(now)
        decoding = len(engine.flights) - len(waiting)
        ttft = max(0.0, done - now) + decoding * engine.decode_s + engine.base_s + \
            self.config.block_size * self.prefill_rate(engine)
        return Signals(queued=len(waiting), queued_tokens=sum(f.uncached for f in waiting),
                       in_flight=len(engine.flights), in_flight_tokens=sum(f.uncached for f in engine.flights.values()),
                       ttft_s=ttft)

    def prefill_rate(self, engine: EngineState) -> float:
        """Seconds per computed token: the engine's own calibration, else the mean of the engines calibrated
        (so an engine the router has not yet seen work is not judged slower or faster than its peers)."""
        if engine.calibrated:
            return engine.prefill_s_per_token
        known = [e.prefill_s_per_token * e.weight for e in self.engines.values() if e.calibrated]
        return sum(known) / len(known) / engine.weight if known else engine.prefill_s_per_token

    # --- the request's life ---------------------------------------------------------------------------------
    def started(self, decision: RouteDecision, keys: Sequence[bytes]) -> int:
        """Account the request on its engine at once; returns its flight id."""
        engine = self.engines[decision.engine]
        flight_id = next(self._ids)
        # From where the engine's own announcements end: blocks another request reserved are this one's to
        # compute too, should that one fail
        reserved = keys[self.index.announced_run(decision.engine, keys):]
        engine.flights[flight_id] = Flight(
            prefill_s=decision.uncached * self.prefill_rate(engine),
            load_s=decision.load_s, queued_s=decision.queued_s, decoding=decision.decoding, uncached=decision.uncached,
            keys=keys, reserved=reserved)
        if reserved:
            self.index.reserve(decision.engine, reserved, self.config.reserve_s, flight_id)
        if decision.reason == "no_prefix" and keys:  # (a prompt under one block stores nothing)
            engine.placed += 1 / engine.weight
        return flight_id

    def first_byte(self, engine: str, flight_id: int, ttft_s: float) -> None:
        """The engine started answering a streamed request (with a 2xx) after ``ttft_s``: it left the queue, and
        its TTFT calibrates the engine. Alone there: the base cost (little to compute) or the prefill cost per token.
        Beside requests decoding and nothing queued: what each decoding request adds to the wait."""
        state = self.engines.get(engine)
        flight = None if state is None else state.flights.get(flight_id)
        if state is None or flight is None:
            return  # (its engine left the fleet meanwhile)
        flight.answering = True
        spent = ttft_s
        if flight.load_s:
            # Waiting on a kvtier load (whose real cost, an extra engine step for a load from a shared tier among
            # them, the configured speeds do not hold): would make an engine that loads look slow at computing.
            return
        if flight.decoding:
            # Others answering beside it: what is left after its own prefill and the prefills predicted ahead
            # of it is what they cost it, per request (under load this is the sample that matters most).
            own = state.base_s + flight.uncached * self.prefill_rate(state) + flight.queued_s
            state.decode_s = _step(state.decode_s, (spent - own) / flight.decoding, floor=1e-3)
        elif flight.queued_s > 0.1 * ttft_s:
            return  # queued behind other prefills alone: says little about any one cost
        elif flight.uncached <= self.config.block_size:
            # (a prefix hit computes its last block: with vLLM's large CPU blocks that is all it computes, and
            # counting its fixed cost as per-token prefill would make every miss look several times slower)
            state.base_s = _step(state.base_s, spent, floor=1e-3)
        else:
            state.calibrate_prefill((spent - state.base_s) / flight.uncached)

    def finished(self, engine: str, flight_id: int, computed: bool = True) -> None:
        """The request ended; ``computed`` False: it failed or was refused, so its blocks will not appear."""
        state = self.engines.get(engine)  # (None: its engine left the fleet meanwhile)
        flight = None if state is None else state.flights.pop(flight_id, None)
        if flight is not None and not computed and flight.reserved:
            self.index.unreserve(engine, flight.reserved, flight_id)

    def lost(self, engine: str) -> None:
        """The engine stopped answering: route around it and forget what it held in its own memory and on its
        host (a restarted engine starts empty); what it wrote to a shared tier is still there for the others."""
        state = self.engines.get(engine)
        if state is None:
            return
        state.healthy = False
        self.index.clear(engine, LOCAL_PLACES)
