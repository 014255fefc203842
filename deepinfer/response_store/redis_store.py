"""Response records in Redis, for several replicas behind one router.

A record is a hash (`PREFIX r:TENANT:ID`: the response JSON, input items, ancestors, status,
traffic class, TTL, deadlines, size) and its stream events a list (`PREFIX e:TENANT:ID`, index =
sequence number). Every write is one Lua script, so replicas see whole records, a cancel never
loses to a concurrent status change, and the shared accounting stays exact: a sorted set by
last access (LRU eviction past the size cap), one by expiry, the size of each record and the
total. Expiry is checked against the store's clock on every read (tests move time) and is
also a real Redis TTL, so records vanish even if no replica ever writes again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import redis

from deepinfer.response_store.records import EventsPage, StoredResponse, with_status
from deepinfer.store.clock import SYSTEM_CLOCK, Clock
from deepinfer.store.retention import RetentionPolicy

# Shared by the scripts that remove records: one record out of every index and the total.
_DROP = """
local function drop(prefix, member)
  local size = tonumber(redis.call('HGET', prefix .. 'sizes', member) or '0')
  redis.call('UNLINK', prefix .. 'r:' .. member, prefix .. 'e:' .. member)
  redis.call('ZREM', prefix .. 'access', member)
  redis.call('ZREM', prefix .. 'expiry', member)
  redis.call('HDEL', prefix .. 'sizes', member)
  redis.call('DECRBY', prefix .. 'bytes', size)
end
local function refresh(prefix, member, now, ttl)
  local ms = math.max(1, math.floor(ttl * 1000))
  redis.call('HSET', prefix .. 'r:' .. member, 'access', now, 'expires', now + ttl)
  redis.call('PEXPIRE', prefix .. 'r:' .. member, ms)
  redis.call('PEXPIRE', prefix .. 'e:' .. member, ms)
  redis.call('ZADD', prefix .. 'access', now, member)
  redis.call('ZADD', prefix .. 'expiry', now + ttl, member)
end
local function grow(prefix, member, delta)
  redis.call('HINCRBY', prefix .. 'r:' .. member, 'size', delta)
  redis.call('HINCRBY', prefix .. 'sizes', member, delta)
  redis.call('INCRBY', prefix .. 'bytes', delta)
end
"""

# ARGV: prefix, member, now, ttl, cap, number of field values, fields (name, value)..., frames...
_PUT = (
    _DROP
    + """
local prefix, member = ARGV[1], ARGV[2]
local now, ttl, cap, nfields = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
drop(prefix, member)
local record, events = prefix .. 'r:' .. member, prefix .. 'e:' .. member
local size = 0
for i = 7, 6 + nfields, 2 do
  redis.call('HSET', record, ARGV[i], ARGV[i + 1])
  size = size + #ARGV[i + 1]
end
local frames = 0
for i = 7 + nfields, #ARGV do
  redis.call('RPUSH', events, ARGV[i])
  size = size + #ARGV[i]
  frames = frames + 1
end
redis.call('HSET', record, 'ttl', ttl, 'events', frames, 'size', 0)
refresh(prefix, member, now, ttl)
redis.call('HSET', prefix .. 'sizes', member, 0)
grow(prefix, member, size)
for _, old in ipairs(redis.call('ZRANGEBYSCORE', prefix .. 'expiry', '-inf', now, 'LIMIT', 0, 256)) do
  drop(prefix, old)
end
while tonumber(redis.call('GET', prefix .. 'bytes') or '0') > cap do
  local oldest = redis.call('ZRANGE', prefix .. 'access', 0, 0)
  if #oldest == 0 then break end
  drop(prefix, oldest[1])
end
return size
"""
)

# ARGV: prefix, member, now. Returns the record's fields, refreshed, or nil.
_GET = (
    _DROP
    + """
local prefix, member, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local v = redis.call('HMGET', prefix .. 'r:' .. member,
  'expires', 'ttl', 'response', 'input', 'ancestors', 'class', 'background', 'done')
if not v[1] or tonumber(v[1]) <= now then return false end
refresh(prefix, member, now, tonumber(v[2]))
return {v[3], v[4], v[5], v[6], v[7], v[8]}
"""
)

# ARGV: prefix, member, now. 1 when a live record was removed.
_DELETE = (
    _DROP
    + """
local prefix, member, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local expires = redis.call('HGET', prefix .. 'r:' .. member, 'expires')
if not expires then return 0 end
drop(prefix, member)
if tonumber(expires) <= now then return 0 end
return 1
"""
)

# ARGV: prefix, member, now, done, has response, response, its cancelled form, its status, frames...
_ADVANCE = (
    _DROP
    + """
local prefix, member, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local record, events = prefix .. 'r:' .. member, prefix .. 'e:' .. member
local v = redis.call('HMGET', record, 'expires', 'ttl', 'status', 'events', 'response')
if not v[1] or tonumber(v[1]) <= now then return false end
local status, grown, frames = v[3], 0, 0
for i = 9, #ARGV do
  redis.call('RPUSH', events, ARGV[i])
  grown = grown + #ARGV[i]
  frames = frames + 1
end
if ARGV[5] == '1' then
  local new, new_status = ARGV[6], ARGV[8]
  if status == 'cancelled' then new, new_status = ARGV[7], 'cancelled' end
  grown = grown + #new - #v[5]
  redis.call('HSET', record, 'response', new, 'status', new_status)
  status = new_status
end
if ARGV[4] == '1' then redis.call('HSET', record, 'done', '1') end
redis.call('HSET', record, 'events', tonumber(v[4]) + frames)
refresh(prefix, member, now, tonumber(v[2]))
grow(prefix, member, grown)
return status
"""
)

# ARGV: prefix, member, now, the cancelled response. 1 when the record exists.
_CANCEL = (
    _DROP
    + """
local prefix, member, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local record = prefix .. 'r:' .. member
local v = redis.call('HMGET', record, 'expires', 'status', 'response')
if not v[1] or tonumber(v[1]) <= now then return 0 end
if v[2] == 'queued' or v[2] == 'in_progress' then
  redis.call('HSET', record, 'response', ARGV[4], 'status', 'cancelled')
  grow(prefix, member, #ARGV[4] - #v[3])
end
return 1
"""
)


class RedisResponseStore:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        *,
        retention: RetentionPolicy,
        max_bytes: int,
        username: str | None = None,
        password: str | None = None,
        key_prefix: str = "deepinfer:responses:v1:",
        clock: Clock = SYSTEM_CLOCK,
        socket_timeout_s: float = 5.0,
    ) -> None:
        self.retention = retention
        self.max_bytes = max_bytes
        self.clock = clock
        self.prefix = key_prefix
        self.client = redis.Redis(
            host=host,
            port=port,
            db=db,
            username=username,
            password=password,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
        )
        self._put = self.client.register_script(_PUT)
        self._get = self.client.register_script(_GET)
        self._delete = self.client.register_script(_DELETE)
        self._advance = self.client.register_script(_ADVANCE)
        self._cancel = self.client.register_script(_CANCEL)

    @staticmethod
    def _member(tenant: str, response_id: str) -> str:
        return f"{tenant}:{response_id}"

    def put(self, record: StoredResponse, frames: Sequence[str] = ()) -> None:
        ttl = self.retention.ttl(record.traffic_class)
        fields = {
            "response": msgspec.json.encode(record.response),
            "input": msgspec.json.encode(record.input_items),
            "ancestors": msgspec.json.encode(record.ancestors),
            "status": record.status.encode(),
            "class": record.traffic_class.encode(),
            "background": b"1" if record.background else b"0",
            "done": b"1" if record.done else b"0",
        }
        flat: list[Any] = [part for item in fields.items() for part in item]
        member = self._member(record.tenant, record.response_id)
        args = [self.prefix, member, repr(self.clock.now()), repr(ttl), self.max_bytes, len(flat)]
        self._put(args=[*args, *flat, *frames])

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self.get_many(tenant, [response_id])[0]

    def get_many(self, tenant: str, response_ids: Sequence[str]) -> list[StoredResponse | None]:
        now = repr(self.clock.now())
        pipe = self.client.pipeline(transaction=False)
        for response_id in response_ids:
            self._get(args=[self.prefix, self._member(tenant, response_id), now], client=pipe)
        return [
            None if values is None else _record(tenant, response_id, values)
            for response_id, values in zip(response_ids, pipe.execute())
        ]

    def delete(self, tenant: str, response_id: str) -> bool:
        now = repr(self.clock.now())
        return bool(self._delete(args=[self.prefix, self._member(tenant, response_id), now]))

    def advance(
        self,
        tenant: str,
        response_id: str,
        frames: Sequence[str],
        response: dict[str, Any] | None = None,
        *,
        done: bool = False,
    ) -> str | None:
        has_response = response is not None
        body = msgspec.json.encode(response) if response is not None else b""
        cancelled = msgspec.json.encode(with_status(response, "cancelled")) if response is not None else b""
        status = str(response["status"]) if response is not None else ""
        args = [
            self.prefix,
            self._member(tenant, response_id),
            repr(self.clock.now()),
            "1" if done else "0",
            "1" if has_response else "0",
            body,
            cancelled,
            status,
        ]
        stored = self._advance(args=[*args, *frames])
        return None if stored is None else stored.decode()

    def events_after(self, tenant: str, response_id: str, after: int) -> EventsPage | None:
        member = self._member(tenant, response_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hmget(self.prefix + "r:" + member, ["expires", "status", "done"])
        pipe.lrange(self.prefix + "e:" + member, after + 1, -1)
        (expires, status, done), frames = pipe.execute()
        if expires is None or float(expires) <= self.clock.now():
            return None
        return EventsPage([f.decode() for f in frames], status=status.decode(), done=done == b"1")

    def cancel(self, tenant: str, response_id: str, response: dict[str, Any]) -> StoredResponse | None:
        cancelled = msgspec.json.encode(with_status(response, "cancelled"))
        member = self._member(tenant, response_id)
        if not self._cancel(args=[self.prefix, member, repr(self.clock.now()), cancelled]):
            return None
        return self.get(tenant, response_id)

    def total_bytes(self) -> int:
        return int(self.client.get(self.prefix + "bytes") or 0)

    def close(self) -> None:
        self.client.close()


def _record(tenant: str, response_id: str, values: list[bytes]) -> StoredResponse:
    response, items, ancestors, traffic_class, background, done = values
    return StoredResponse(
        response_id=response_id,
        tenant=tenant,
        response=msgspec.json.decode(response),
        input_items=msgspec.json.decode(items),
        ancestors=msgspec.json.decode(ancestors),
        traffic_class=traffic_class.decode(),
        background=background == b"1",
        done=done == b"1",
    )
