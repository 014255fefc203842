"""`deepinfer serve`: start the engine, load what the API side needs, serve HTTP until a signal.

The listening socket is bound first (a taken port fails at once, not after loading the model).
The API process loads only the tokenizer and the recipe (model metadata), never the weights.

A graceful stop (SIGINT / SIGTERM) has one deadline, `--shutdown-timeout` from the signal: new
requests get 503 (with Retry-After) while those in flight finish; any still running at the
deadline end with an error event; then the engine flushes its queued KV-store writes with the
time left (at least a second) and stops. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn

from deepinfer.config import ConfigError, EngineConfig, ServerConfig
from deepinfer.engine.ipc.protocol import EngineInfo
from deepinfer.engine.ipc.transport import EngineTransport, ProcessTransport, ThreadTransport
from deepinfer.frontend.client import EngineClient
from deepinfer.model.loader.source import DEFAULT_MODEL_NAME, converted_gguf_dir, resolve_model_path
from deepinfer.recipe import ModelInfo, Recipe, RecipeError
from deepinfer.recipe.api.responses_reasoning import ReasoningSealer
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.server.app import build_app
from deepinfer.server.constraints import GrammarValidator
from deepinfer.server.encoders import EncoderClient
from deepinfer.server.header_timeout import header_timeout_protocol
from deepinfer.server.images import image_pool
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.state import ServerState
from deepinfer.server.stored_responses import StoredResponses, open_response_store
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_model_info(path: Path, family: str | None) -> ModelInfo:
    if _is_gguf(path):
        return ModelInfo.from_gguf(path, family=family)
    return ModelInfo.from_hf_dir(path, family=family)


def load_tokenizer(path: Path) -> Tokenizer:
    # For a GGUF the engine has converted it (tokenizer included) by the time it is ready.
    return Tokenizer.from_dir(converted_gguf_dir(path) if _is_gguf(path) else path)


def default_served_name(model: str | None, engine_model_name: str) -> str:
    return DEFAULT_MODEL_NAME if model is None else engine_model_name


async def start_state(engine_config: EngineConfig, server_config: ServerConfig) -> ServerState:
    """Start the engine (process or thread) and build everything the routes need."""
    path = resolve_model_path(engine_config.model)
    transport: EngineTransport = (
        ThreadTransport(engine_config)
        if server_config.engine_mode == "thread"
        else ProcessTransport(engine_config, server_config.log_level)
    )
    info_task = asyncio.ensure_future(asyncio.to_thread(load_model_info, path, server_config.recipe_family))
    try:
        engine_info = await transport.start()
        tokenizer = await asyncio.to_thread(load_tokenizer, path)
        recipe: Recipe | None = None
        recipe_error: str | None = None
        try:
            recipe = Recipe.for_model(await info_task)
        except RecipeError as error:
            if server_config.recipe_family is not None:
                raise  # an encoding asked for by name that cannot be used: refuse to start
            recipe_error = str(error)
            log.warning("chat endpoints disabled: %s", error)
        if recipe is not None:
            await asyncio.to_thread(recipe.warm, tokenizer.backend)
    except BaseException:
        info_task.cancel()
        await transport.close()
        raise
    try:
        grammars = await asyncio.to_thread(
            GrammarValidator.build, tokenizer, engine_info.vocab_size, engine_config.grammar_compile_timeout
        )
    except BaseException:
        await transport.close()
        raise
    try:
        response_store = await asyncio.to_thread(open_response_store, engine_config, server_config)
    except BaseException:
        await transport.close()
        raise
    pd = engine_config.disaggregation
    if pd.encoders and not engine_info.accepts_images:
        await transport.close()
        raise ConfigError("encoders", f"{engine_info.model_name} takes no images (no vision tower)")
    metrics = ServerMetrics()
    client = EngineClient(transport, tokenizer, on_request_done=metrics.request_done)
    metrics.attach_engine(lambda: (client.stats, client.healthy, client.num_waiting))
    names = server_config.served_model_names or [
        default_served_name(engine_config.model, engine_info.model_name)
    ]
    return ServerState(
        reasoning_sealer=reasoning_sealer(server_config),
        config=server_config,
        client=client,
        tokenizer=tokenizer,
        recipe=recipe,
        recipe_error=recipe_error,
        served_names=names,
        metrics=metrics,
        created=int(time.time()),
        grammars=grammars,
        responses=StoredResponses(response_store),
        image_pool=image_pool(server_config.image_workers) if engine_info.accepts_images else None,
        encoders=EncoderClient(list(pd.encoders), pd.encoder_timeout) if pd.encoders else None,
        cluster_key=cluster_key_of(pd.cluster_key_file),
    )


def reasoning_sealer(config: ServerConfig) -> ReasoningSealer:
    """The key for encrypted Responses reasoning: the configured one, or a new one for this run."""
    if config.reasoning_key:
        return ReasoningSealer.from_hex(config.reasoning_key)
    log.info(
        "encrypted reasoning: using a key generated at start (reasoning blobs will not decrypt after a "
        "restart; set --reasoning-key to keep them valid)"
    )
    return ReasoningSealer.generate()


def _role_note(info: EngineInfo) -> str:
    parts = []
    if info.role != "both":
        parts.append(f"role {info.role}, KV transfer {info.kv_transfer}")
    if info.kv_transfer_address:
        parts.append(f"KV transfer listener {info.kv_transfer_address}")
    if info.kv_events_endpoint:
        parts.append(f"KV events {info.kv_events_endpoint}")
    return f" [{'; '.join(parts)}]" if parts else ""


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


MIN_FLUSH_S = 1.0


class _DrainingServer(uvicorn.Server):
    """Prints where it listens once it accepts connections; a first signal drains (see the
    module docstring) instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, announce: Callable[[], None]) -> None:
        super().__init__(config)
        self._state = state
        self._announce = announce
        self._loop = asyncio.get_running_loop()
        self._drain: asyncio.Task[None] | None = None
        self.deadline: float | None = None  # loop time by which the whole stop should be done

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self._announce()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.deadline is None:  # first signal: drain
            self._captured_signals.append(sig)
            self._loop.call_soon_threadsafe(self._begin_drain)
        else:
            super().handle_exit(sig, frame)
            self.force_exit = True

    def _begin_drain(self) -> None:
        self.deadline = self._loop.time() + self._state.config.shutdown_timeout
        self._drain = self._loop.create_task(self._drain_requests())

    async def _drain_requests(self) -> None:
        state, client = self._state, self._state.client
        state.draining = True
        log.info(
            "stopping: %d requests in flight, %.0f s to finish",
            client.num_in_flight,
            state.config.shutdown_timeout,
        )
        assert self.deadline is not None
        while client.num_in_flight and self._loop.time() < self.deadline:
            await asyncio.sleep(0.05)
        if client.num_in_flight:
            log.warning(
                "%d requests still running at the shutdown deadline; ending them", client.num_in_flight
            )
            client.abort_all("the server is shutting down")
        self.should_exit = True

    def flush_time_left(self) -> float:
        """Seconds the engine may spend flushing KV writes (the rest of the deadline)."""
        if self.deadline is None:
            return self._state.config.shutdown_timeout
        return max(self.deadline - self._loop.time(), MIN_FLUSH_S)


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    sock = bind_socket(server_config.host, server_config.port)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    # While the model loads, SIGTERM cancels the start (which stops the engine process).
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        state = await start_state(engine_config, server_config)
    except BaseException as error:
        sock.close()
        if isinstance(error, asyncio.CancelledError):  # SIGINT / SIGTERM while loading
            log.info("stopped while loading the model")
            return
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    url = base_url(sock)

    def announce() -> None:
        names = ", ".join(state.served_names)
        print(
            f"DeepInfer is serving {names} at {url}  (OpenAI: {url}/v1, Anthropic: {url}/v1/messages, "
            f"health: {url}/health, metrics: {url}/metrics; engine pid {state.client.transport.engine_pid})"
            + _role_note(state.client.info),
            flush=True,
        )

    config = uvicorn.Config(
        build_app(state),
        http=header_timeout_protocol(server_config.header_timeout),
        log_level=server_config.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="off",
    )
    server = _DrainingServer(config, state, announce)
    # What the server holds from here on (modules, tokenizer, recipe: 100k objects and more) is
    # put out of the cyclic collector's reach: a full collection would otherwise walk all of it on
    # whichever thread allocates, holding the GIL (and /health) for 15-150 ms each time.
    gc.collect()
    gc.freeze()
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers that
    # is a no-op, so the engine is stopped below instead of the process dying mid-cleanup.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve(sockets=[sock])
    finally:
        # Background responses were drained with the other requests; any still running end
        # as failed and are recorded, then the engine stops (streams still open end with it).
        await state.responses.close(server.flush_time_left())
        await state.client.close(server.flush_time_left())
        if state.grammars is not None:
            state.grammars.close()
        if state.image_pool is not None:
            state.image_pool.shutdown(wait=False, cancel_futures=True)
        if state.encoders is not None:
            await state.encoders.close()
        sock.close()
        log.info("server stopped")


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(engine_config, server_config))
