"""The router's HTTP side: one entry point for every route of the replicas.

A request is read once (body size limit), its prompt features computed (router/prompt.py),
and it is sent to the replica the policy picks; the answer is relayed as it comes. With
--prefill/--decode, a generating request is first prefilled on a prefill replica (POST
/v1/pd/prefill with the router's token ids and a fresh transfer id), then sent, with the
handoff in the x-deepinfer-kv-transfer header, to a decode replica that pulls the KV (or reads
it from the store) and generates. A prefill that fails is reported in that header: the decode
replica recomputes or fails per its --kv-transfer-failure.

Retries happen before the first byte only: a refused connection, a replica that dies before
answering, or a 429/502/503/504/529 sends the request to another replica (at most `retries`
more); once bytes reached the client, a failure ends the stream with an error event.
Errors of the router's own (no replica available, body too large) are in the API's shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deepinfer.config.router import RouterConfig
from deepinfer.router.branches import ConversationTree
from deepinfer.router.index import PrefixIndex
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.policy import Candidate, Decision, Policy
from deepinfer.router.prompt import GENERATING_PATHS, PromptFeatures, PromptRenderer
from deepinfer.router.proxy import (
    UpstreamFailed,
    answer_headers,
    forwarded_headers,
    relay_stream,
    until_dead,
)
from deepinfer.router.replica import Replica, ReplicaSet
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.security.signing import PEER_HEADER, peer_token, sign_handoff
from deepinfer.server.auth import check_admin_key, check_api_key, is_admin
from deepinfer.server.errors import ApiError, error_response, flavor_of
from deepinfer.transport.kv_event_log import DEVICE

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# On answers, which replica served it: its URL is internal, so only where is_admin (a keyless
# router; a tenant's key never is one).
REPLICA_HEADER = "x-deepinfer-replica"
KV_TRANSFER_HEADER = "x-deepinfer-kv-transfer"  # read by the decode replica (server/engine_requests.py)
RETRY_STATUSES = frozenset({429, 502, 503, 504, 529})
FAILURE_STATUSES = frozenset({502, 503, 504})  # count against the replica's circuit
AUTH_HEADERS = ("authorization", "x-api-key")


def _api_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class Router:
    def __init__(
        self,
        config: RouterConfig,
        replicas: ReplicaSet,
        index: PrefixIndex,
        renderer: PromptRenderer | None,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.index = index
        self.renderer = renderer
        self.client = client
        self.metrics = metrics
        self.policies = {role: Policy(config) for role in ("both", "prefill", "decode")}
        self.conversations = ConversationTree()  # where routed prompts branch off each other
        # Signs handoffs and the calls to /v1/pd/prefill: decode engines act on nothing else.
        self.cluster_key = cluster_key_of(config.cluster_key_file)
        self.draining = False

    # -- choosing -------------------------------------------------------------------------------

    def _candidates(
        self, role: str, features: PromptFeatures | None, api_key: str | None, exclude: set[str]
    ) -> tuple[list[Candidate], dict[str, list[bytes]]]:
        """The available replicas with what they hold of the prompt, and the prompt's block
        hashes for each (per its fingerprint, block size and salt)."""
        candidates, chains = [], {}
        for replica in self.replicas.pool(role):
            if not replica.available or replica.name in exclude:
                continue
            match, total, sent = None, 0, 0
            if features is not None and replica.fingerprint and replica.block_size:
                salt = features.salt_for(api_key, replica.cache_salt_per_key)
                hashes = features.block_hashes(replica.fingerprint, replica.block_size, salt)
                total = len(hashes)
                shared = self.conversations.shared_blocks(hashes)
                match = self.index.match(replica.name, hashes, shared)
                previous = self.conversations.previous_turn(hashes, role)
                if previous is not None and previous[1] == replica.name and previous[0] > shared:
                    sent = previous[0]  # this conversation's previous turn went there
                chains[replica.name] = hashes
            cached = self.index.size(replica.name).get(DEVICE, 0)
            candidates.append(Candidate(replica, match, total, cached, sent))
        return candidates, chains

    def _pick(
        self, role: str, features: PromptFeatures | None, api_key: str | None, exclude: set[str]
    ) -> Replica | None:
        candidates, chains = self._candidates(role, features, api_key, exclude)
        if not candidates:
            return None
        decision: Decision = self.policies[role].choose(
            candidates, features.session_key if features else None
        )
        replica = decision.replica
        assert isinstance(replica, Replica)
        if replica.name in chains:
            self.conversations.record(chains[replica.name], replica.name, role)
        replica.breaker.allow()  # an open circuit past its cooldown lets this one through as the probe
        self.metrics.routed(role, replica.name, decision.reason, decision.total_blocks, decision.credit)
        return replica

    # -- prefill/decode handoff -----------------------------------------------------------------

    async def _prefill(
        self, features: PromptFeatures, request: Request, request_id: str, api_key: str | None
    ) -> str:
        """Run the prompt on a prefill replica; the decode replica's x-deepinfer-kv-transfer."""
        tried: set[str] = set()
        error = "no prefill replica is available"
        for _ in range(2):  # a refused connection is retried once on another prefill replica
            replica = self._pick("prefill", features, api_key, tried)
            if replica is None:
                break
            tried.add(replica.name)
            transfer_id = f"pd-{uuid.uuid4().hex}"
            body = {
                "transfer_id": transfer_id,
                "prompt_token_ids": features.token_ids,
                "cache_salt": features.cache_salt,
                "traffic_class": features.traffic_class or request.headers.get("x-traffic-class"),
            }
            headers = {k: v for k, v in request.headers.items() if k in AUTH_HEADERS}
            headers[REQUEST_ID_HEADER] = request_id
            if self.cluster_key is not None:
                headers[PEER_HEADER] = peer_token(self.cluster_key, "POST", "/v1/pd/prefill")
            replica.inflight += 1
            try:
                answer = await until_dead(
                    self.client.post(
                        replica.url + "/v1/pd/prefill",
                        json=body,
                        headers=headers,
                        timeout=self.config.request_timeout,
                    ),
                    replica.dead,
                )
            except httpx.ConnectError as failure:
                replica.request_failed(str(failure))
                self.metrics.upstream_failures.labels(replica.name).inc()
                error = f"the prefill replica is unreachable: {type(failure).__name__}"
                log.warning("prefill replica %s is unreachable: %s", replica.url, failure)
                continue
            except (httpx.HTTPError, UpstreamFailed) as failure:
                replica.request_failed(str(failure))
                self.metrics.upstream_failures.labels(replica.name).inc()
                error = f"the prefill replica failed: {type(failure).__name__}"
                log.warning("prefill replica %s failed: %s", replica.url, failure)
                break
            finally:
                replica.inflight -= 1
            if answer.status_code != 200:
                if answer.status_code in FAILURE_STATUSES:
                    replica.request_failed(f"HTTP {answer.status_code}")
                # The engine's own error (no addresses in it): a decode replica with
                # --kv-transfer-failure fail shows this text to the client.
                error = f"the prefill replica answered {answer.status_code}: {answer.text[:300]}"
                log.warning("prefill replica %s: %s", replica.url, error)
                break
            replica.request_succeeded()
            self.metrics.handoffs.labels("ok").inc()
            handoff = {"transfer_id": transfer_id}
            if replica.kv_transfer_address is not None:
                handoff["address"] = replica.kv_transfer_address
            else:
                handoff = {}  # through the shared store: the decode replica reads it there
            return self._signed(handoff)
        self.metrics.handoffs.labels("failed").inc()
        log.warning("prefill failed (%s); the decode replica decides by its policy", error)
        return self._signed({"error": error})

    def _signed(self, handoff: dict[str, str]) -> str:
        """The header's JSON, with the signature a decode replica requires (server/peers.py)."""
        if self.cluster_key is not None:
            handoff["signature"] = sign_handoff(
                self.cluster_key, handoff.get("transfer_id"), handoff.get("address"), handoff.get("error")
            )
        return msgspec.json.encode(handoff).decode()

    # -- the request ----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        flavor = flavor_of(path)
        if self.draining:
            return error_response(ApiError(503, "the router is shutting down", code="draining"), flavor)
        try:
            # The key before the body: a keyless client costs its headers only, not a read
            # and a tokenization of whatever it sends.
            check_api_key(self.config.api_keys, request.headers)
            body = await self._read_body(request)
        except ApiError as error:
            return error_response(error, flavor)
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
        features = await self._features(request, path, body)
        api_key = _api_key(request)
        generating = request.method == "POST" and path in GENERATING_PATHS
        role = "both"
        if self.config.disaggregated:
            role = "decode"  # decode replicas serve everything but the prefill half
        tried: set[str] = set()
        last_error = "no replica is available"
        for attempt in range(self.config.retries + 1):
            replica = self._pick(role, features if generating else None, api_key, tried)
            if replica is None:
                break
            tried.add(replica.name)
            extra = {REQUEST_ID_HEADER: request_id}
            if self.config.disaggregated and generating and features is not None:
                extra[KV_TRANSFER_HEADER] = await self._prefill(features, request, request_id, api_key)
            final = attempt == self.config.retries
            try:
                response = await self._forward(replica, request, body, extra, final)
            except UpstreamFailed as failure:
                last_error = str(failure)
                if not final:
                    self.metrics.retries.inc()
                continue
            if response is not None:
                self.metrics.requests.labels("ok").inc()
                response.headers[REQUEST_ID_HEADER] = request_id
                if self._is_admin(request):
                    response.headers[REPLICA_HEADER] = replica.url
                return response
            if not final:
                self.metrics.retries.inc()
            last_error = f"the replica {replica.url} was busy or failing"
        self.metrics.requests.labels("no_replica").inc()
        # Replicas' addresses are internal: the log names them, the client's error does not.
        log.warning("no replica could serve %s: %s", request_id, last_error)
        error = ApiError(
            503,
            "no replica could serve the request; retry later",
            code="no_replica_available",
            headers={"retry-after": "1"},
        )
        answer = error_response(error, flavor)
        answer.headers[REQUEST_ID_HEADER] = request_id
        return answer

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _features(self, request: Request, path: str, body: bytes) -> PromptFeatures | None:
        if self.renderer is None or request.method != "POST" or path not in GENERATING_PATHS:
            return None
        # Decoding, rendering and tokenizing a long prompt take up to seconds: off the event
        # loop (the tokenizer releases the GIL).
        return await asyncio.to_thread(self._features_of, path, body, request.headers)

    def _features_of(self, path: str, body: bytes, headers: Any) -> PromptFeatures | None:
        assert self.renderer is not None
        try:
            parsed: Any = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return None  # the replica answers the 400
        try:
            return self.renderer.features(path, parsed, headers)
        except RecursionError:
            return None  # nested too deeply to render: the replica answers the 400

    async def _forward(
        self, replica: Replica, request: Request, body: bytes, extra: dict[str, str], final: bool
    ) -> Response | None:
        """The replica's answer, ready to relay; None for a retryable status when a retry is
        left; UpstreamFailed when it did not answer."""
        upstream_request = self.client.build_request(
            request.method,
            replica.url + request.url.path,
            params=request.query_params,
            headers=forwarded_headers(request.headers.items(), extra),
            content=body,
            timeout=httpx.Timeout(self.config.request_timeout, connect=self.config.health_timeout),
        )
        replica.inflight += 1
        released = False

        def release(error: str | None = None) -> None:
            nonlocal released
            if not released:
                released = True
                replica.inflight -= 1
                if error is not None:
                    self.metrics.requests.labels("stream_error").inc()
                    log.warning("stream on %s ended with an error: %s", replica.url, error)

        try:
            upstream = await until_dead(self.client.send(upstream_request, stream=True), replica.dead)
        except (httpx.HTTPError, UpstreamFailed) as failure:
            release()
            self._failed(replica, failure)
            raise UpstreamFailed(f"{replica.url}: {type(failure).__name__}: {failure}") from None
        status = upstream.status_code
        if status in FAILURE_STATUSES:
            replica.request_failed(f"HTTP {status}")
            self.metrics.upstream_failures.labels(replica.name).inc()
        else:
            replica.request_succeeded()
        if status in RETRY_STATUSES and not final:
            await upstream.aclose()
            release()
            return None
        headers = answer_headers(upstream)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                relay_stream(upstream, request.url.path, replica.dead, release),
                status_code=status,
                headers=headers,
            )
        try:
            content = await until_dead(upstream.aread(), replica.dead)
        except (httpx.HTTPError, UpstreamFailed) as failure:
            self._failed(replica, failure)
            raise UpstreamFailed(f"{replica.url} failed before answering: {failure}") from None
        finally:
            await upstream.aclose()
            release()
        return Response(content, status_code=status, headers=headers)

    def _failed(self, replica: Replica, failure: Exception) -> None:
        replica.request_failed(f"{type(failure).__name__}: {failure}")
        self.metrics.upstream_failures.labels(replica.name).inc()

    # -- the router's own routes ----------------------------------------------------------------

    def _is_admin(self, request: Request) -> bool:
        return is_admin(self.config.api_keys, self.config.admin_keys, request.headers)

    def _authorize_admin(self, request: Request, what: str, alternative: str = "") -> None:
        check_admin_key(self.config.api_keys, self.config.admin_keys, request.headers, what, alternative)

    async def health(self, request: Request) -> JSONResponse:
        """Keyless for load balancers, and then only the status: the replicas' addresses, state
        and errors are internal (an admin key, or a router without keys, sees them)."""
        roles = ("prefill", "decode") if self.config.disaggregated else ("both",)
        ready = all(any(r.available for r in self.replicas.pool(role)) for role in roles)
        status = "draining" if self.draining else ("ok" if ready else "unavailable")
        body: dict[str, Any] = {"status": status}
        if self._is_admin(request):
            body["policy"] = self.config.policy
            body["replicas"] = [
                {
                    "url": r.url,
                    "role": r.role,
                    "healthy": r.healthy,
                    "breaker": r.breaker.state.name.lower(),
                    "load": r.load,
                    "inflight": r.inflight,
                    "last_error": r.last_error,
                }
                for r in self.replicas.replicas
            ]
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics_route(self, request: Request) -> Response:
        """Behind the admin key once keys are set, as on `deepinfer serve`: its labels are the
        replicas' URLs and its counters every tenant's traffic."""
        from prometheus_client import CONTENT_TYPE_LATEST

        if not self.config.public_metrics:
            try:
                self._authorize_admin(request, "/metrics", " (or --public-metrics to serve it without a key)")
            except ApiError as error:
                return error_response(error, "openai")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        """Every replica's prefix cache, reset (409 if any refused: requests hold blocks). Admin
        only, here before any replica is asked: the answer names the replicas. The request's key
        goes on to the replicas, which check it too."""
        try:
            self._authorize_admin(request, "/reset_prefix_cache")
        except ApiError as error:
            return error_response(error, "openai")
        headers = {k: v for k, v in request.headers.items() if k in AUTH_HEADERS}
        targets = [r for r in self.replicas.replicas if r.available]

        async def one(replica: Replica) -> tuple[str, int]:
            try:
                answer = await self.client.post(replica.url + "/reset_prefix_cache", headers=headers)
            except httpx.HTTPError:
                return replica.url, 503
            return replica.url, answer.status_code

        results = dict(await asyncio.gather(*(one(r) for r in targets)))
        if targets and all(code == 200 for code in results.values()):
            for replica in targets:
                self.index.forget(replica.name)
            return JSONResponse({"reset": True, "replicas": results})
        error = ApiError(409, f"not every replica reset its prefix cache: {results}")
        return error_response(error, "openai")


def build_app(router: Router) -> Starlette:
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    routes = [
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics_route, methods=["GET"]),
        Route("/reset_prefix_cache", router.reset_prefix_cache, methods=["POST"]),
        Route("/{path:path}", router.handle, methods=methods),
    ]
    app = Starlette(routes=routes)
    app.state.router = router
    app.state.started = time.time()
    return app
