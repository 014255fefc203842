"""Starting and stopping an encode-role server (`deepinfer serve --role encode`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import uvicorn

from deepinfer.config import EngineConfig, ServerConfig
from deepinfer.encoder.service import EncoderService, build_encoder_app
from deepinfer.encoder.tower import VisionTower, read_config
from deepinfer.model.loader.source import resolve_model_path
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.server.header_timeout import header_timeout_protocol
from deepinfer.server.images import image_pool
from deepinfer.server.serve import base_url, bind_socket
from deepinfer.transport.kv_transfer import KVTransferServer

log = logging.getLogger(__name__)


class _AnnouncingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, line: str) -> None:
        super().__init__(config)
        self._line = line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            print(self._line, flush=True)


async def serve_encoder(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    path = resolve_model_path(engine_config.model)
    read_config(path)  # a checkpoint that cannot encode fails before the socket or any weight
    sock = bind_socket(server_config.host, server_config.port)
    pd = engine_config.disaggregation
    try:
        tower = await asyncio.to_thread(VisionTower, path, engine_config.num_threads)
        transfer = KVTransferServer(
            tower.layout,
            pd.kv_transfer_host,
            pd.kv_transfer_port,
            pd.kv_transfer_lease,
            key=cluster_key_of(pd.cluster_key_file),  # engines prove they hold it before a pull
        )
    except BaseException:
        sock.close()
        raise
    service = EncoderService(tower, transfer, image_pool(server_config.image_workers), server_config)
    url = base_url(sock)
    line = (
        f"DeepInfer encoder is serving {path.name} at {url}  (POST {url}/v1/encode, health: {url}/health, "
        f"metrics: {url}/metrics; embeddings leased on {transfer.address}; pid {os.getpid()})"
    )
    config = uvicorn.Config(
        build_encoder_app(service),
        http=header_timeout_protocol(server_config.header_timeout),
        log_level=server_config.log_level,
        lifespan="off",
    )
    reaper = asyncio.get_running_loop().create_task(service.reap_forever())
    try:
        await _AnnouncingServer(config, line).serve(sockets=[sock])
    finally:
        reaper.cancel()
        service.close()
        sock.close()
        log.info("encoder stopped")


def run_encoder(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner() as runner:
        runner.run(serve_encoder(engine_config, server_config))
