"""Redis as the shared store: one hash per chunk.

Fields: d = object bytes, e = expiry deadline, a = last access, n = size. Expiry is checked on
read against the store's clock (so tests can move time) and is also set as a real Redis TTL,
so objects vanish even if no garbage collector ever runs. A write is one MULTI/EXEC
(HSET of all fields + PEXPIRE): readers see the old object or the new one, and concurrent
writers of one key leave exactly one whole object. The access refresh is a Lua script so it
cannot resurrect a key that a collector deleted in between.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from deepinfer.store.backend import ObjectInfo, ObjectParts, StoreUnavailable

_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'e', ARGV[1], 'a', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
"""
_SCAN_BATCH = 500


def _ttl_ms(expires_at: float, now: float) -> int:
    return max(1, int((expires_at - now) * 1000))


class RedisBackend:
    name = "redis"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        *,
        username: str | None = None,
        password: str | None = None,
        key_prefix: str = "deepinfer:kv:",
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
    ):
        self.key_prefix = key_prefix
        # One immediate retry covers a pooled connection that went stale when the server
        # restarted; anything longer would only delay the miss the engine is waiting for.
        self.client = redis.Redis(
            host=host,
            port=port,
            db=db,
            username=username,
            password=password,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._touch = self.client.register_script(_TOUCH)

    def _name(self, key: bytes) -> str:
        return self.key_prefix + key.hex()

    def put(self, key: bytes, parts: ObjectParts, expires_at: float, now: float) -> None:
        data = b"".join(parts)
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(
                self._name(key), mapping={"d": data, "e": repr(expires_at), "a": repr(now), "n": len(data)}
            )
            pipe.pexpire(self._name(key), _ttl_ms(expires_at, now))
            pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis write failed: {exc}") from exc

    def get(self, key: bytes, now: float) -> bytes | None:
        try:
            data, expires_at = self.client.hmget(self._name(key), ["d", "e"])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis read failed: {exc}") from exc
        if data is None or expires_at is None:
            return None
        try:
            return None if float(expires_at) <= now else data
        except ValueError as exc:
            raise StoreUnavailable(f"redis returned a garbage expiry for {key.hex()}") from exc

    def touch(self, key: bytes, expires_at: float, now: float) -> None:
        try:
            self._touch(keys=[self._name(key)], args=[repr(expires_at), repr(now), _ttl_ms(expires_at, now)])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis refresh failed: {exc}") from exc

    def count_present(self, keys: Sequence[bytes], now: float) -> int:
        if not keys:
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(self._name(key), "e")
            deadlines = pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis lookup failed: {exc}") from exc
        count = 0
        try:
            for deadline in deadlines:
                if deadline is None or float(deadline) <= now:
                    break
                count += 1
        except ValueError as exc:
            raise StoreUnavailable("redis returned a garbage expiry") from exc
        return count

    def delete(self, key: bytes) -> None:
        try:
            self.client.unlink(self._name(key))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis delete failed: {exc}") from exc

    def _infos(self, names: list[bytes]) -> list[ObjectInfo]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, ["n", "a", "e"])
        infos = []
        prefix_len = len(self.key_prefix)
        for name, (size, last_access, expires_at) in zip(names, pipe.execute()):
            if size is None or last_access is None or expires_at is None:
                continue
            try:
                key = bytes.fromhex(name[prefix_len:].decode("ascii"))
                infos.append(ObjectInfo(key, int(size), float(last_access), float(expires_at)))
            except ValueError:
                continue
        return infos

    def scan(self) -> Iterator[ObjectInfo]:
        try:
            batch: list[bytes] = []
            for name in self.client.scan_iter(match=self.key_prefix + "*", count=_SCAN_BATCH):
                batch.append(name)
                if len(batch) == _SCAN_BATCH:
                    yield from self._infos(batch)
                    batch = []
            if batch:
                yield from self._infos(batch)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis scan failed: {exc}") from exc

    def sweep_temporaries(self) -> int:
        return 0  # writes are single transactions: nothing is left half-done

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis is unavailable: {exc}") from exc

    def close(self) -> None:
        self.client.close()
