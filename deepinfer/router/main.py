"""`deepinfer router`: start the replica checks and KV-event subscriptions, serve HTTP until a
signal, then drain: SIGTERM (or SIGINT) stops accepting connections, /health answers
"draining", and requests in flight get `drain_timeout` seconds to finish."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import httpx
import uvicorn

from deepinfer.config.router import RouterConfig
from deepinfer.router.app import Router, build_app
from deepinfer.router.index import PrefixIndex, TierCredits
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.prompt import PromptRenderer
from deepinfer.router.replica import ReplicaSet

log = logging.getLogger(__name__)


class _RouterServer(uvicorn.Server):
    """Announces where it listens once it accepts connections; marks the router draining on a
    signal before uvicorn's own graceful shutdown begins."""

    def __init__(self, config: uvicorn.Config, router: Router, announce: Callable[[], None]) -> None:
        super().__init__(config)
        self._router = router
        self._announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self._announce()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._router.draining:
            log.info(
                "draining: no new requests; in-flight ones may take %.0f s", self._router.config.drain_timeout
            )
        self._router.draining = True
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def _load_renderer(config: RouterConfig) -> PromptRenderer | None:
    try:
        return PromptRenderer.load(config.model, config.recipe_family)
    except Exception as error:  # the router still balances; it just cannot read prompts
        log.warning("no prompt renderer (%s): routing without prefix matches or handoff", error)
        return None


async def serve_router(config: RouterConfig) -> None:
    sock = _bind(config.host, config.port)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256),
        timeout=config.request_timeout,
    )
    index = PrefixIndex(TierCredits(1.0, config.host_credit, config.store_credit))
    replicas = ReplicaSet(config, index, client)
    try:
        renderer = await asyncio.to_thread(_load_renderer, config)
        await replicas.start()
        metrics = RouterMetrics()
        metrics.watch(replicas.replicas, index, lambda: replicas.events_lost)
        router = Router(config, replicas, index, renderer, client, metrics)
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

        def announce() -> None:
            pools = ", ".join(f"{r.role} {r.url}{'' if r.healthy else ' (down)'}" for r in replicas.replicas)
            print(f"DeepInfer router at {url} (policy {config.policy}; replicas: {pools})", flush=True)

        uvicorn_config = uvicorn.Config(
            build_app(router),
            log_level=config.log_level,
            timeout_graceful_shutdown=int(config.drain_timeout),
            lifespan="off",
        )
        server = _RouterServer(uvicorn_config, router, announce)
        # As `deepinfer serve` does: what the router holds from here on (modules, tokenizer,
        # recipe) is out of the cyclic collector's reach, so no full collection walks it while
        # requests wait.
        gc.collect()
        gc.freeze()
        # uvicorn re-raises the signal that stopped it once done; a no-op handler lets the
        # cleanup below run instead of the default action killing the process mid-way.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        await server.serve(sockets=[sock])
    finally:
        await replicas.close()
        await client.aclose()
        sock.close()
        log.info("router stopped")


def run_router(config: RouterConfig) -> None:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_router(config))
