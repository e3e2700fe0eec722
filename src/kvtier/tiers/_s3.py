"""The S3 tier: shards as objects in any S3-compatible store (AWS S3, MinIO, SeaweedFS, Ceph RGW, ...).

Object names: ``<prefix><namespace>/<chunk>/<heads>``. A PUT is atomic in S3, so a reader sees a whole object
or none. A lookup lists each chunk's prefix (in parallel, on a small thread pool). Credentials come from the
usual places (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, instance roles) unless the config
names a profile or gives keys. Retention is the bucket's own (lifecycle rules) or ``kvtier cache purge``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kvtier.errors import ConfigError, TierError
from kvtier.keys import HeadRange, ShardKey
from kvtier.tiers.base import TIERS, Buffer, StoredObject, Tier


@dataclasses.dataclass(frozen=True)
class S3Options:
    bucket: str
    prefix: str = "kvtier/"
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    connect_timeout: float = 2.0
    read_timeout: float = 30.0
    max_attempts: int = 2
    max_connections: int = 16
    create_bucket: bool = False

    def check(self, field: str) -> None:
        if not self.bucket:
            raise ConfigError(f"{field}.bucket: must name a bucket")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(f"{field}.access_key_id/secret_access_key: give both or neither")
        if self.prefix and not self.prefix.endswith("/"):
            raise ConfigError(f"{field}.prefix: must end with '/', got {self.prefix!r}")
        for name in ("connect_timeout", "read_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{field}.{name}: must be positive, got {getattr(self, name)}")
        if self.max_attempts < 1 or self.max_connections < 1:
            raise ConfigError(f"{field}.max_attempts/max_connections: must be at least 1")


@TIERS.register("s3")
class S3Tier(Tier):
    """Shards as objects in one bucket of an S3-compatible object store."""

    Options = S3Options
    persistent = True

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
        session = boto3.session.Session(profile_name=o.profile, aws_access_key_id=o.access_key_id,
                                        aws_secret_access_key=o.secret_access_key, region_name=o.region)
        config = botocore.config.Config(
            connect_timeout=o.connect_timeout, read_timeout=o.read_timeout,
            retries={"max_attempts": o.max_attempts, "mode": "standard"},
            max_pool_connections=o.max_connections, s3={"addressing_style": o.addressing_style},
            # Every object carries kvtier's own checksum, verified on read; a second one only costs time.
            request_checksum_calculation="when_required", response_checksum_validation="when_required")
        try:
            self._s3 = session.client("s3", endpoint_url=o.endpoint_url, config=config)
        except self._errors as exc:
            raise TierError(f"{name}: cannot create an S3 client: {exc}") from exc
        self._pool = ThreadPoolExecutor(max_workers=o.max_connections, thread_name_prefix=f"kvtier-{name}-list")
        if o.create_bucket:
            self._ensure_bucket()

    def _ensure_bucket(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.options.bucket)
            return
        except self._errors:
            pass
        try:
            self._s3.create_bucket(Bucket=self.options.bucket)
        except self._errors as exc:
            raise TierError(f"{self.name}: cannot create bucket {self.options.bucket!r}: {exc}") from exc

    def _object(self, key: ShardKey) -> str:
        return f"{self.options.prefix}{key.namespace}/{key.chunk}/{key.heads}"

    def _missing(self, exc: Exception) -> bool:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        return code in ("NoSuchKey", "404", "NotFound")

    def _fail(self, what: str, exc: Exception) -> TierError:
        return TierError(f"{self.name}: {what} failed: {exc}")

    # -- the tier interface ------------------------------------------------------------------------------------
    def put(self, key: ShardKey, parts: Sequence[Buffer]) -> None:
        body = b"".join(parts)
        try:
            self._s3.put_object(Bucket=self.options.bucket, Key=self._object(key), Body=body)
        except self._errors as exc:
            raise self._fail(f"put {key.name}", exc) from exc

    def get(self, key: ShardKey) -> Buffer | None:
        try:
            resp = self._s3.get_object(Bucket=self.options.bucket, Key=self._object(key))
            return resp["Body"].read()
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._fail(f"get {key.name}", exc) from exc

    def delete(self, key: ShardKey) -> bool:
        # S3 deletes answer 204 whether or not the object was there; ask first to report it.
        try:
            self._s3.head_object(Bucket=self.options.bucket, Key=self._object(key))
        except self._errors as exc:
            if self._missing(exc):
                return False
            raise self._fail(f"delete {key.name}", exc) from exc
        try:
            self._s3.delete_object(Bucket=self.options.bucket, Key=self._object(key))
        except self._errors as exc:
            raise self._fail(f"delete {key.name}", exc) from exc
        return True

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.options.bucket, Prefix=prefix)
        try:
            for page in pages:
                yield from page.get("Contents", [])
        except self._errors as exc:
            raise self._fail(f"listing {prefix!r}", exc) from exc

    def _chunk_heads(self, namespace: str, chunk: str) -> list[HeadRange]:
        heads = []
        for obj in self._list(f"{self.options.prefix}{namespace}/{chunk}/"):
            try:
                heads.append(HeadRange.parse(obj["Key"].rpartition("/")[2]))
            except ValueError:
                continue  # not one of ours
        return heads

    def heads(self, namespace: str, chunks: Sequence[str]) -> list[list[HeadRange]]:
        if len(chunks) <= 1:
            return [self._chunk_heads(namespace, c) for c in chunks]
        return list(self._pool.map(lambda c: self._chunk_heads(namespace, c), chunks))

    def list(self, namespace: str | None = None) -> Iterator[StoredObject]:
        prefix = self.options.prefix + (f"{namespace}/" if namespace else "")
        for obj in self._list(prefix):
            ns, _, rest = obj["Key"][len(self.options.prefix):].partition("/")
            chunk, _, heads = rest.partition("/")
            try:
                key = ShardKey(ns, chunk, HeadRange.parse(heads))
            except ValueError:
                continue
            # S3 keeps no last-access time; the write time stands for both.
            when = obj["LastModified"].timestamp()
            yield StoredObject(key, int(obj["Size"]), when, when)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._s3.close()
