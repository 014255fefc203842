"""The replicas behind the router: what each one is (from its /v1/engine_info), whether it is up,
how loaded it is, its circuit breaker, and the KV events that keep the prefix index current.

A replica is in rotation while its health checks pass and its circuit is not open. Health: a GET
of /v1/engine_info every `health_interval` (its role, hash root, load); `unhealthy_after` failures
in a row take it out, and every stream still open on it is told to end (with an error event),
so nothing hangs on a replica that stopped answering. The breaker counts request failures
(refused connections, 502-504): `breaker_failures` in a row open it, and after
`breaker_cooldown` one request is let through as a probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from deepinfer.config.router import RouterConfig
from deepinfer.router.index import PrefixIndex
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.security.curve import client_keys, server_keys
from deepinfer.security.signing import PEER_HEADER, peer_token
from deepinfer.store.breaker import BreakerState, CircuitBreaker
from deepinfer.transport.kv_events import decode_batch

log = logging.getLogger(__name__)


class Replica:
    def __init__(self, url: str, role: str, config: RouterConfig) -> None:
        self.url = url
        self.name = url
        self.role = role  # what the router was told it is: both, prefill or decode
        self.info: dict[str, Any] | None = None
        self.healthy = False
        self.failed_checks = 0
        self.last_error: str | None = None
        self.breaker = CircuitBreaker(
            failure_threshold=config.breaker_failures,
            probe_interval_s=config.breaker_cooldown,
            name=f"replica {url}",
        )
        self.inflight = 0  # requests this router has open on it
        self.engine_running = 0
        self.engine_waiting = 0
        self.dead = asyncio.Event()  # set while it is out of rotation: open streams end
        self.dead.set()

    @property
    def load(self) -> int:
        """Requests running and waiting on it: the router's own count, or the engine's when more
        (another router, or requests sent directly) report more."""
        return max(self.inflight, self.engine_running + self.engine_waiting)

    @property
    def available(self) -> bool:
        return self.healthy and not self.breaker.refusing()

    @property
    def fingerprint(self) -> str | None:
        return self.info.get("fingerprint") if self.info else None

    @property
    def block_size(self) -> int:
        return int(self.info.get("block_size", 0)) if self.info else 0

    @property
    def store(self) -> str | None:
        return self.info.get("kv_store") if self.info else None

    @property
    def kv_transfer_address(self) -> str | None:
        return self.info.get("kv_transfer_address") if self.info else None

    @property
    def cache_salt_per_key(self) -> bool:
        return bool(self.info.get("cache_salt_per_key")) if self.info else False

    def events_endpoint(self) -> str | None:
        """Its KV events endpoint, with a wildcard bind address replaced by its URL's host."""
        endpoint = self.info.get("kv_events_endpoint") if self.info else None
        if not endpoint:
            return None
        host = urlsplit(self.url).hostname or "127.0.0.1"
        for wildcard in ("://0.0.0.0:", "://*:", "://[::]:"):
            endpoint = endpoint.replace(wildcard, f"://{host}:")
        return endpoint

    def request_failed(self, error: str) -> None:
        self.last_error = error
        self.breaker.record_failure(error)

    def request_succeeded(self) -> None:
        if self.breaker.state is not BreakerState.CLOSED:
            self.breaker.record_success()


class ReplicaSet:
    """Every replica, the health loop, and one KV-event subscription per replica."""

    def __init__(self, config: RouterConfig, index: PrefixIndex, client: httpx.AsyncClient) -> None:
        self.config = config
        self.index = index
        self.client = client
        roles = [("both", u) for u in config.replicas]
        roles += [("prefill", u) for u in config.prefill] + [("decode", u) for u in config.decode]
        self.replicas = [Replica(url, role, config) for role, url in roles]
        self._context = zmq.asyncio.Context()
        # Proves this router is a peer: engine_info polls (a token) and KV events (CURVE keys).
        self._cluster_key = cluster_key_of(config.cluster_key_file)
        self._subscriptions: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._health_task: asyncio.Task[None] | None = None
        self.events_lost = 0

    def pool(self, role: str) -> list[Replica]:
        return [r for r in self.replicas if r.role == role]

    async def start(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))
        self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        try:
            response = await self.client.get(
                replica.url + "/v1/engine_info",
                headers=self._info_headers(),
                timeout=self.config.health_timeout,
            )
            info = response.json()
            if response.status_code != 200 or not info.get("healthy", False):
                raise RuntimeError(f"unhealthy ({response.status_code}): {info.get('reason', info)}"[:300])
            if info.get("role", "both") != replica.role:
                raise RuntimeError(
                    f"its role is {info.get('role')}, but it was given as a {replica.role} replica"
                )
        except Exception as error:  # refused, timed out, not JSON, wrong role: all mean "not now"
            self._check_failed(replica, f"{type(error).__name__}: {error}")
            return
        previous = replica.info
        replica.info = info
        replica.failed_checks = 0
        load = info.get("load") or {}
        replica.engine_running = int(load.get("num_running", 0))
        replica.engine_waiting = int(load.get("num_waiting", 0))
        if previous is None or previous.get("kv_events_endpoint") != info.get("kv_events_endpoint"):
            self.index.forget(replica.name)  # a new engine: what the old one held is gone
        self.index.add_replica(replica.name, replica.store)
        if not replica.healthy:
            log.info("replica %s (%s) is in rotation", replica.url, replica.role)
        replica.healthy = True
        replica.dead.clear()
        self._subscribe(replica)

    def _info_headers(self) -> dict[str, str]:
        """A peer token (engines with a cluster key want one) and an API key, if this router has
        them (a keyless, loopback-only engine wants one of its API keys)."""
        headers = {}
        if self._cluster_key is not None:
            headers[PEER_HEADER] = peer_token(self._cluster_key, "GET", "/v1/engine_info")
        if self.config.api_keys:
            headers["authorization"] = f"Bearer {self.config.api_keys[0]}"
        return headers

    def _check_failed(self, replica: Replica, error: str) -> None:
        replica.failed_checks += 1
        replica.last_error = error
        if replica.healthy and replica.failed_checks >= self.config.unhealthy_after:
            log.warning("replica %s is out of rotation: %s", replica.url, error)
            replica.healthy = False
        if not replica.healthy:
            replica.dead.set()  # open streams on it end now, with an error event
            self.index.forget(replica.name)

    # -- KV events ------------------------------------------------------------------------------

    def _subscribe(self, replica: Replica) -> None:
        endpoint = replica.events_endpoint()
        current = self._subscriptions.get(replica.name)
        if current is not None and current[0] == endpoint:
            return
        if current is not None:
            current[1].cancel()
            del self._subscriptions[replica.name]
        if endpoint is None:
            return
        task = asyncio.ensure_future(self._listen(replica, endpoint))
        self._subscriptions[replica.name] = (endpoint, task)

    async def _listen(self, replica: Replica, endpoint: str) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        if self._cluster_key is not None:  # the engine's publisher is a CURVE server
            public, secret = client_keys(self._cluster_key)
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_serverkey = server_keys(self._cluster_key)[0]
        socket.connect(endpoint)
        last: int | None = None
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    continue
                sequence = int.from_bytes(frames[1], "big")
                if last is not None and sequence != last + 1:
                    # Lost events (no replay): what is known of this replica may be wrong.
                    self.events_lost += 1
                    self.index.forget(replica.name)
                last = sequence
                try:
                    batch = decode_batch(frames[2])
                except msgspec.DecodeError:
                    log.warning("undecodable KV events from %s", endpoint)
                    continue
                self.index.apply(replica.name, batch.events)
        finally:
            socket.close(linger=0)

    async def close(self) -> None:
        tasks = [task for _, task in self._subscriptions.values()]
        if self._health_task is not None:
            tasks.append(self._health_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._context.term()
