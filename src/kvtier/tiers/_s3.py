"""The S3 tier: shards as objects in any S3-compatible store (AWS S3, MinIO, SeaweedFS, Ceph RGW, ...).

Object names: ``<prefix><namespace>/<chunk>/<heads>``. A PUT is atomic in S3, so a reader sees a whole object
or none. A lookup lists each chunk's prefix (in parallel, on a small thread pool). Credentials come from the
usual places (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, instance roles) unless the config
names a profile or gives keys. Retention is the bucket's own (lifecycle rules) or ``kvtier cache purge``.
Per-tenant quotas are kept from listings of the bucket (:mod:`kvtier.quotas.listed`), with one empty object
per namespace a share counts under ``<prefix>shares/``.

On start the tier asks for the bucket once (HEAD): a server that answers "access denied", "no such bucket" or
finds no credentials is a :class:`TierError` then, naming the bucket and the S3 error code; one that does not
answer is only logged (the store's outage back-off takes over). No message shows the secret key. A call to a
stalled server fails after at most ``max_attempts`` x ``read_timeout`` (plus sub-second back-off between
attempts). Only objects named exactly ``<prefix><32 hex>/<32 hex>/<heads>`` are listed or counted as shards.
"""

from __future__ import annotations

import dataclasses
import email.utils
import logging
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kvtier import threads
from kvtier.config import check_ttl, check_url_port
from kvtier.errors import ConfigError, TierError, WrongSize
from kvtier.keys import HeadRange, ShardKey
from kvtier.quotas.listed import ListedShares
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier

log = logging.getLogger(__name__)
_MAX_CONNECTIONS = 1024  # one listing thread each: more is a typo
_MAX_ATTEMPTS = 10  # each one waits up to read_timeout on a stalled server
_HEADS = r"[0-9]+-[0-9]+of[0-9]+"
_HEX32 = re.compile(r"[0-9a-f]{32}")
# What HEAD bucket answers (a status, no body) when the credentials or the bucket are wrong.
_DENIED = {"403": "access denied", "AccessDenied": "access denied", "InvalidAccessKeyId":
           "unknown access key id", "SignatureDoesNotMatch": "wrong secret key (signature does not match)"}


@dataclasses.dataclass(frozen=True)
class S3Options:
    """The keys of a ``type: s3`` tier: any S3-compatible store (AWS S3, MinIO, Ceph RGW, SeaweedFS, ...)."""

    bucket: str = dataclasses.field(metadata={"help": "the bucket that holds the tier's objects"})
    prefix: str = dataclasses.field(default="kvtier/", metadata={
        "help": "objects are <prefix><namespace id>/<chunk key>/<heads> (ends with '/')"})
    endpoint_url: str | None = dataclasses.field(default=None, metadata={
        "help": "http(s)://host[:port] of the store, e.g. http://minio:9000; null: AWS"})
    region: str | None = dataclasses.field(default=None, metadata={"help": "the bucket's region; null: boto3's"})
    profile: str | None = dataclasses.field(default=None, metadata={
        "help": "an AWS profile for the credentials; null: the usual chain (env, ~/.aws, instance role)"})
    access_key_id: str | None = dataclasses.field(default=None, metadata={
        "help": "credentials given here (with secret_access_key: both or neither)"})
    secret_access_key: str | None = dataclasses.field(default=None, metadata={
        "help": "the secret of access_key_id"})
    addressing_style: Literal["auto", "path", "virtual"] = dataclasses.field(default="auto", metadata={
        "help": "how the bucket appears in URLs: in the path or in the host name"})
    connect_timeout: float = dataclasses.field(default=2.0, metadata={"help": "seconds to open a connection"})
    read_timeout: float = dataclasses.field(default=30.0, metadata={"help": "seconds to wait for an answer"})
    max_attempts: int = dataclasses.field(default=2, metadata={
        "help": "attempts per call, the first included (1-10)"})
    max_connections: int = dataclasses.field(default=16, metadata={
        "help": "the connection pool, also the parallelism of a lookup's listings"})
    create_bucket: bool = dataclasses.field(default=False, metadata={
        "help": "create the bucket if it is missing (else a missing bucket is an error at start)"})
    # Served no longer than this after it was written (the store checks each object's age as it reads it);
    # removed by `kvtier cache retain`. None: kept until evicted or purged.
    ttl_seconds: float | None = dataclasses.field(default=None, metadata={
        "help": "never served older than this; removed by `kvtier cache retain` (run it from cron); null: no limit"})
    # With per-tenant quotas: how old this engine's view of a share may get before a put lists it again (other
    # engines' writes are seen at the next listing; 0: every put lists first). See kvtier.quotas.listed.
    share_refresh_seconds: float = dataclasses.field(default=10.0, metadata={
        "help": "with tenant quotas: list a share again when this engine's view of it is older than this"})

    def check(self, field: str) -> None:
        check_ttl(self.ttl_seconds, field)
        if not (self.share_refresh_seconds >= 0 and math.isfinite(self.share_refresh_seconds)):
            raise ConfigError(f"{field}.share_refresh_seconds: must be a number of seconds >= 0, got "
                              f"{self.share_refresh_seconds}")
        if not self.bucket:
            raise ConfigError(f"{field}.bucket: must name a bucket")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(f"{field}.access_key_id/secret_access_key: give both or neither")
        if self.prefix and not self.prefix.endswith("/"):
            raise ConfigError(f"{field}.prefix: must end with '/', got {self.prefix!r}")
        if self.endpoint_url is not None:
            _check_endpoint(self.endpoint_url, f"{field}.endpoint_url")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{field}.{name}: must be a positive number of seconds, got {value}")
        if not 1 <= self.max_attempts <= _MAX_ATTEMPTS:
            raise ConfigError(f"{field}.max_attempts: must be in [1, {_MAX_ATTEMPTS}], got {self.max_attempts}")
        if not 1 <= self.max_connections <= _MAX_CONNECTIONS:
            raise ConfigError(f"{field}.max_connections: must be in [1, {_MAX_CONNECTIONS}], "
                              f"got {self.max_connections}")


def _check_endpoint(url: str, field: str) -> None:
    # The URL is not echoed: user info in it would be a secret.
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{field}: expected http(s)://host[:port]")
    if "@" in parts.netloc:  # botocore would quote it in every connection error: credentials go elsewhere
        raise ConfigError(f"{field}: must not hold user info (user:password@); give access_key_id and "
                          "secret_access_key, a profile, or the environment")
    check_url_port(url, field)


def _code(exc: Exception) -> str | None:
    """The S3 error code of a failed call. A ClientError has a response; a BotoCoreError such as
    ReadTimeoutError has none, or ``response=None``."""
    code = (getattr(exc, "response", None) or {}).get("Error", {}).get("Code")
    return code if isinstance(code, str) else None


def _clock_offset(page: dict[str, Any]) -> float | None:
    """The server's clock minus this engine's, from an answer's ``Date`` (to the second) and the time now."""
    date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date).timestamp() - time.time()
    except (TypeError, ValueError):
        return None


# Bytes per read from a response body: each read makes a bytes object of its size (so does urllib3's readinto).
_READ_PIECE = 1 << 20


@TIERS.register("s3")
class S3Tier(Tier):
    """Shards as objects in one bucket of an S3-compatible object store."""

    Options = S3Options
    persistent = True
    heads_in_one_call = False  # a listing per chunk
    read_ahead = True  # GETs wait on the store's latency: 16 chunks of 5.9 MB read in 0.15 s instead of 0.17 s
    shares = True  # from listings of the bucket, per engine (kvtier.quotas.listed)

    def __init__(self, name: str, options: S3Options) -> None:
        super().__init__(name, options)
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError as exc:
            raise ConfigError(f"{name}: the s3 tier needs boto3 (pip install 'kvtier[s3]')") from exc
        self._errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        o = options
        try:
            session = boto3.session.Session(profile_name=o.profile, aws_access_key_id=o.access_key_id,
                                            aws_secret_access_key=o.secret_access_key, region_name=o.region)
        except botocore.exceptions.ProfileNotFound as exc:
            raise ConfigError(f"{name}: profile {o.profile!r} is in neither the AWS config nor the credentials "
                              "file") from exc
        config = botocore.config.Config(
            connect_timeout=o.connect_timeout, read_timeout=o.read_timeout,
            # total_max_attempts counts the first attempt; botocore's "max_attempts" would count only retries.
            retries={"total_max_attempts": o.max_attempts, "mode": "standard"},
            max_pool_connections=o.max_connections, s3={"addressing_style": o.addressing_style},
            # Every object carries kvtier's own checksum, verified on read; a second one only costs time.
            request_checksum_calculation="when_required", response_checksum_validation="when_required")
        try:
            self._s3 = session.client("s3", endpoint_url=o.endpoint_url, config=config)
        except self._errors as exc:
            raise TierError(f"{name}: cannot create an S3 client: {exc}") from exc
        self._credentials = session.get_credentials
        self._pool = ThreadPoolExecutor(max_workers=o.max_connections, thread_name_prefix=f"kvtier-{name}-list",
                                        initializer=threads.entered, initargs=(f"kvtier-{name}-list",))
        # Share listings on threads of their own: lookups never wait behind them.
        self._share_pool = ThreadPoolExecutor(max_workers=min(4, o.max_connections),
                                              thread_name_prefix=f"kvtier-{name}-shares",
                                              initializer=threads.entered, initargs=(f"kvtier-{name}-shares",))
        self._shares = ListedShares(self._share_members, self.list, self._record_member, o.share_refresh_seconds,
                                    map_=self._share_pool.map)
        try:
            self._probe(botocore.exceptions)
        except BaseException:
            self.close()
            raise

    def _probe(self, errors: Any) -> None:
        """Ask for the bucket once: wrong credentials or a missing bucket fail now, clearly, rather than as an
        outage on every call. A server that does not answer is only logged: it may come up later."""
        bucket = self.options.bucket
        try:
            self._s3.head_bucket(Bucket=bucket)
            return
        except (errors.NoCredentialsError, errors.PartialCredentialsError, errors.CredentialRetrievalError) as exc:
            raise TierError(f"{self.name}: no usable credentials for bucket {bucket!r} ({type(exc).__name__}): give "
                            "access_key_id and secret_access_key, a profile, or AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY") from exc
        except errors.ClientError as exc:
            code = str(_code(exc))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status >= 500:  # the server's own trouble: an outage, which the store handles as one
                log.warning("tier %s: bucket %r: S3 error %s at start; retrying on use", self.name, bucket, code)
                return
            if status == 403 or code in _DENIED:
                source = getattr(self._credentials(), "method", None) or "unknown"
                # HEAD bucket needs s3:ListBucket, which every lookup (a listing) needs too.
                raise TierError(f"{self.name}: bucket {bucket!r}: {_DENIED.get(code, 'access denied')} (S3 error "
                                f"{code}) with the credentials from {source}") from exc
            if status != 404:
                raise TierError(f"{self.name}: bucket {bucket!r}: S3 error {code} at start: {exc}") from exc
        except self._errors as exc:  # no connection, timed out: the server may come up later
            log.warning("tier %s: bucket %r: no answer at start (%s); retrying on use", self.name, bucket, exc)
            return
        if not self.options.create_bucket:
            raise TierError(f"{self.name}: bucket {bucket!r} does not exist (set create_bucket: true to create "
                            "it)")
        self._create_bucket()

    def _create_bucket(self) -> None:
        try:
            self._s3.create_bucket(Bucket=self.options.bucket)
        except self._errors as exc:
            if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # another writer was first
                raise TierError(f"{self.name}: cannot create bucket {self.options.bucket!r}: {exc}") from exc

    def _object(self, key: ShardKey) -> str:
        return f"{self.options.prefix}{key.namespace}/{key.chunk}/{key.heads}"

    def _share_prefix(self, sid: str) -> str:
        return f"{self.options.prefix}shares/{sid}/"

    def _missing(self, exc: Exception) -> bool:
        return _code(exc) in ("NoSuchKey", "404", "NotFound")

    def _fail(self, what: str, exc: Exception) -> TierError:
        return TierError(f"{self.name}: {what} failed: {exc}")

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        body = b"".join(parts)
        self._shares.write(self.name, key, len(body), lambda: self._put(key, body), self._evict)

    def _evict(self, victim: ShardKey) -> bool:
        """Delete an object its share chose to evict; whether that succeeded (else it is counted again)."""
        try:
            self._s3.delete_object(Bucket=self.options.bucket, Key=self._object(victim))
            return True
        except self._errors as exc:
            log.debug("tier %s: evicting %s from its share failed: %s", self.name, victim.name, exc)
            return False

    def _put(self, key: ShardKey, body: bytes) -> None:
        for attempt in (1, 2):
            try:
                self._s3.put_object(Bucket=self.options.bucket, Key=self._object(key), Body=body)
                return
            except self._errors as exc:
                if attempt == 1 and _code(exc) == "NoSuchBucket" and self.options.create_bucket:
                    self._create_bucket()  # the server did not answer at start, or the bucket was removed since
                    continue
                raise self._fail(f"put {key.name}", exc) from exc

    def get(self, key: ShardKey) -> Buffer | None:
        try:
            resp = self._s3.get_object(Bucket=self.options.bucket, Key=self._object(key))
            data: bytes = resp["Body"].read()
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._fail(f"get {key.name}", exc) from exc
        self._shares.used(key)
        return data

    def head(self, key: ShardKey, nbytes: int) -> bytes | None:
        """A ranged GET of the object's first ``nbytes`` bytes."""
        try:
            resp = self._s3.get_object(Bucket=self.options.bucket, Key=self._object(key), Range=f"bytes=0-{nbytes - 1}")
            data: bytes = resp["Body"].read()
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._fail(f"get {key.name}", exc) from exc
        return data[:nbytes]

    def get_into(self, key: ShardKey, header_len: int, payload: Sequence[memoryview]) -> bytes | None:
        """The body copied from the response stream into ``payload`` (e.g. DRAM pages) a MiB at a time: no bytes
        object of the object's size (each reading thread would keep such buffers' memory). A response without a
        length (a proxy's chunked reply) is read whole."""
        try:
            resp = self._s3.get_object(Bucket=self.options.bucket, Key=self._object(key))
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._fail(f"get {key.name}", exc) from exc
        body = resp["Body"]
        try:
            size = resp.get("ContentLength")
            if size is None:
                return self._split(key, body.read(), header_len, payload)
            want = header_len + sum(part.nbytes for part in payload)
            if size != want:
                raise WrongSize(f"{self.name}: {key.name} is {size} bytes, expected {want}", size)
            header = bytearray(header_len)
            for part in (memoryview(header), *payload):
                done = 0
                while done < part.nbytes:
                    piece = body.read(min(_READ_PIECE, part.nbytes - done))
                    if not piece:  # (botocore raises first when the body ends before its length)
                        raise TierError(f"{self.name}: get {key.name}: the body ended early")
                    part[done:done + len(piece)] = piece
                    done += len(piece)
        except self._errors as exc:
            raise self._fail(f"get {key.name}", exc) from exc
        finally:
            body.close()
        self._shares.used(key)
        return bytes(header)

    def delete(self, key: ShardKey) -> bool:
        # S3 deletes answer 204 whether or not the object was there; ask first to report it.
        try:
            self._s3.head_object(Bucket=self.options.bucket, Key=self._object(key))
        except self._errors as exc:
            if self._missing(exc):
                return False
            raise self._fail(f"delete {key.name}", exc) from exc
        self._shares.removed(key)
        try:
            self._s3.delete_object(Bucket=self.options.bucket, Key=self._object(key))
        except self._errors as exc:
            raise self._fail(f"delete {key.name}", exc) from exc
        return True

    # -- tenant shares -----------------------------------------------------------------------------------------
    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        """Count ``namespace``'s objects against the tenant share ``share`` of ``quota_bytes`` (None: none), in
        this engine's view of the bucket (:mod:`kvtier.quotas.listed`): a put that takes the share past its
        quota deletes the share's least recently used objects, whichever engine wrote them."""
        self._shares.set(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self._shares.bytes(share)

    def remove_records(self, namespaces: Collection[str]) -> int:
        """Each namespace's records in the tenant shares (``<prefix>shares/<id>/<namespace>``)."""
        wanted = set(namespaces)
        shape = re.compile(re.escape(f"{self.options.prefix}shares/") + r"[0-9a-f]{32}/([0-9a-f]{32})")
        records = [obj["Key"] for obj in self._list(f"{self.options.prefix}shares/")
                   if (match := shape.fullmatch(obj["Key"])) is not None and match[1] in wanted]
        for record in records:
            try:
                self._s3.delete_object(Bucket=self.options.bucket, Key=record)
            except self._errors as exc:
                raise self._fail(f"removing {record!r}", exc) from exc
        return len(records)

    def _share_members(self, sid: str) -> tuple[list[str], float | None]:
        """The namespaces recorded for share ``sid``, and the server's clock minus this engine's, from the first
        answer's ``Date`` (None without a readable one)."""
        prefix = self._share_prefix(sid)
        names: list[str] = []
        offset = None
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.options.bucket, Prefix=prefix,
                                                                   Delimiter="/")
        try:
            for i, page in enumerate(pages):
                if i == 0:
                    offset = _clock_offset(page)
                names += [obj["Key"][len(prefix):] for obj in page.get("Contents", [])]
        except self._errors as exc:
            raise self._fail(f"listing {prefix!r}", exc) from exc
        return names, offset

    def _record_member(self, sid: str, namespace: str) -> None:
        try:
            self._s3.put_object(Bucket=self.options.bucket, Key=self._share_prefix(sid) + namespace, Body=b"")
        except self._errors as exc:
            raise self._fail(f"recording namespace {namespace} in its share", exc) from exc

    def counters(self) -> dict[str, float]:
        return {"share_evictions": float(self._shares.evictions),
                "share_refused_writes": float(self._shares.refused),
                "share_view_failures": float(self._shares.view_failures)}

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.options.bucket, Prefix=prefix)
        try:
            for page in pages:
                yield from page.get("Contents", [])
        except self._errors as exc:
            raise self._fail(f"listing {prefix!r}", exc) from exc

    def _chunk_heads(self, namespace: str, chunk: str) -> list[HeadRange]:
        prefix = f"{self.options.prefix}{namespace}/{chunk}/"
        heads = []
        for obj in self._list(prefix):
            rest = obj["Key"][len(prefix):]
            if re.fullmatch(_HEADS, rest):  # not e.g. <chunk>/old/<heads>: get would never find that
                try:
                    heads.append(HeadRange.parse(rest))
                except ValueError:
                    continue  # start >= stop or the like: not one of ours
        return heads

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        if len(chunks) <= 1:
            return [self._chunk_heads(namespace, c) for c in chunks]
        # After one listing fails, those not yet started never start: against a stalled server each would wait
        # out its timeouts, and a lookup of more chunks than max_connections would take several rounds (also
        # delaying the next lookup, queued behind them).
        failed = threading.Event()

        def one(chunk: str) -> list[HeadRange]:
            if failed.is_set():
                return []  # never used: the lookup has failed
            try:
                return self._chunk_heads(namespace, chunk)
            except BaseException:
                failed.set()  # before this thread takes the next listing
                raise

        futures = [self._pool.submit(one, c) for c in chunks]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        if namespace is not None and not _HEX32.fullmatch(namespace):
            return  # no namespace id looks like that
        # Exactly <prefix><32 hex>/<32 hex>/<heads>: with prefix ``kvtier/``, objects of a deployment under
        # ``kvtier/staging/`` or anything else in the bucket are never listed (so never purged).
        own = re.compile(re.escape(self.options.prefix) + r"([0-9a-f]{32})/([0-9a-f]{32})/(" + _HEADS + ")")
        for obj in self._list(self.options.prefix + (f"{namespace}/" if namespace else "")):
            match = own.fullmatch(obj["Key"])
            if match is None:
                continue
            try:
                key = ShardKey(match[1], match[2], HeadRange.parse(match[3]))
            except ValueError:
                continue
            # S3 keeps no last-access time; the write time stands for both.
            when = obj["LastModified"].timestamp()
            yield StoredObject(key, int(obj["Size"]), when, when)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._share_pool.shutdown(wait=True)
        self._s3.close()
