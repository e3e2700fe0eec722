"""Who a namespace's KV belongs to and where it may go: its names as the store keeps them (keyed with
encryption), its placement decision, the tenant share (quota) DRAM and the tiers count it against, and with
encryption its tenant key (a forgotten tenant's KV leaves DRAM too). Decides; moves no KV. Runs in the store's
process."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvtier import tracing
from kvtier.config import StoreConfig
from kvtier.errors import ConfigError
from kvtier.health import FirstOfKind
from kvtier.keys import Namespace
from kvtier.metrics import StoreMetrics
from kvtier.placement import Decision, Placement
from kvtier.recent import RecentMap
from kvtier.tiers.base import Tier

if TYPE_CHECKING:
    from kvtier.dram import DramPool
    from kvtier.sealing import Sealer, Tenant

log = logging.getLogger("kvtier.store")
_SHARED_KEPT = 16384  # below DRAM's and the tiers' own memory of shares: a namespace forgotten here is told again


class Tenancy:
    """A store's tenants. Built first, before any tier opens: a key source that fails refuses the store."""

    def __init__(self, config: StoreConfig, metrics: StoreMetrics, logged: FirstOfKind) -> None:
        self._metrics = metrics
        self._logged = logged
        if config.otlp_traces_endpoint is not None:  # first: a missing SDK refuses the store before a tier opens
            tracing.configure(config.otlp_traces_endpoint, "kvtier")
        self.sealer: Sealer | None = None
        if config.encryption is not None:
            try:
                from kvtier.sealing import Sealer  # the cryptography package, only where encryption is on
            except ImportError as exc:
                raise ConfigError(f"encryption: needs the cryptography package (pip install "
                                  f"'kvtier[encryption]'): {exc}") from exc

            self.sealer = Sealer(config.encryption, self._forgotten,
                                 on_unreadable=lambda exc: self._keyring_failed(exc, "read a secret of"))
        # With encryption, object names are keyed too (kvtier.keys): what a tier shows confirms no guessed prompt.
        self.name_key = b"" if self.sealer is None else self.sealer.keyring.naming_key()
        self.placement = Placement(config.placement)
        self._shared: RecentMap[str, str] = RecentMap(_SHARED_KEPT)  # namespace -> the share DRAM and tiers were told
        self._shared_lock = threading.Lock()
        self._dram: DramPool | None = None
        self._tiers: dict[str, Tier] = {}

    def bind(self, dram: DramPool, tiers: list[Tier]) -> None:
        """The DRAM pool and the tiers whose shares this store sets (once they are open)."""
        self._dram = dram
        self._tiers = {t.name: t for t in tiers}

    def named(self, ns: Namespace) -> Namespace:
        return ns.keyed(self.name_key)

    def decide(self, ns: Namespace) -> Decision:
        """Where ``ns``'s KV may go; DRAM and each tier with a quota are told its share first, so what follows
        (a put, a promotion) counts against it."""
        decision = self.placement.decide(ns)
        self.apply_share(ns, decision)
        return decision

    def apply_share(self, ns: Namespace, decision: Decision) -> None:
        """Tell DRAM and each tier with a quota for ``ns``'s tenant which share its KV counts against."""
        if decision.share is None or self._shared.get(ns.id) == decision.share:
            return  # (set once per namespace: setting takes the tier's lock, which its writers hold)
        with self._shared_lock:
            self._shared[ns.id] = decision.share
        assert self._dram is not None, "bound before use"
        for name, quota in decision.quota:
            if name == "dram":
                self._dram.set_share(ns.id, decision.share, quota)
            else:
                self._tiers[name].set_share(ns.id, decision.share, quota)

    @staticmethod
    def check_quotas(config: StoreConfig, tiers: list[Tier]) -> None:
        """A quota may name DRAM and the tiers that can keep one (:meth:`Tier.quota_refusal`)."""
        by_name = {t.name: (i, t) for i, t in enumerate(tiers)}
        dram = config.dram
        for i, rule in enumerate(config.placement):
            for name, quota in rule.quota:
                if name == "dram" and not dram.page_bytes <= quota <= dram.capacity_bytes:
                    raise ConfigError(f"placement[{i}].quota.dram: must be from dram.page_bytes ({dram.page_bytes}) "
                                      f"to dram.capacity_bytes ({dram.capacity_bytes}), got {quota}; every put goes "
                                      "through DRAM, so a tenant whose share holds no chunk stores nothing anywhere")
                found = by_name.get(name)
                refusal = None if found is None else found[1].quota_refusal(f"tiers[{found[0]}]")
                if refusal is not None:
                    raise ConfigError(f"placement[{i}].quota.{name}: {refusal}")

    # -- encryption ------------------------------------------------------------------------------------------
    def register(self, ns: Namespace, create: bool) -> Tenant | None:
        """With encryption: make ``ns``'s tenant key available (see :meth:`Sealer.register`). A keyring that cannot
        be read or written never fails the caller: counted and logged once, it costs the call its secondary tiers
        (its writes are dropped, its reads miss there), and DRAM too unless the tenant's secret was read (a
        namespace it failed to record: DRAM serves it under the tenant's key, which a forget ends)."""
        if self.sealer is None:
            return None
        try:
            return self.sealer.register(ns, create)
        except Exception as exc:  # noqa: BLE001 a keyring fault never fails the caller: counted and logged
            from kvtier.sealing import UnrecordedNamespace  # (imported with encryption on only: cryptography)

            if isinstance(exc, UnrecordedNamespace):
                self._keyring_failed(exc.__cause__ or exc, "record a namespace of")
                return exc.tenant
            self._keyring_failed(exc, "make or read" if create else "read")
            return None

    def current(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` was not found forgotten since its key was taken (always, without encryption)."""
        return self.sealer is None or self.sealer.current(tenant)

    def servable(self, tenant: Tenant | None) -> bool:
        """Whether what a read of ``tenant`` decrypted may be handed out: no encryption, or its tenant not found
        forgotten since the read began."""
        return self.sealer is None or (tenant is not None and self.sealer.current(tenant))

    def _keyring_failed(self, exc: BaseException, doing: str) -> None:
        self._metrics.keyring_errors.inc()
        assert self.sealer is not None, "only a sealer's keyring fails"
        if self._logged.first("keyring", doing, type(exc).__name__):
            log.warning("keyring %s: cannot %s a tenant (%s: %s); its secondary tiers are skipped, and its DRAM "
                        "entries while its secret cannot be read (further such failures are counted, not logged)",
                        self.sealer.keyring.path, doing, type(exc).__name__, exc)

    def _forgotten(self, owners: set[bytes]) -> None:
        """Tenants were forgotten (``kvtier tenant forget``; ``owners``: their key ids): their KV leaves DRAM too
        (an entry being read goes when its reader is done)."""
        if self._dram is None:  # (not open yet: nothing of theirs is held)
            return
        dropped = self._dram.discard_owned(owners)
        log.info("dropped %d DRAM entries of %d forgotten tenants", dropped, len(owners))

    def close(self) -> None:
        if self.sealer is not None:
            self.sealer.close()
