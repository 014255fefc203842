"""The encoder's HTTP side: POST /v1/encode, /health, /metrics, and the leases of what it encoded.

An engine's API server (server/encoders.py) posts a request's image parts as the client gave them
(data URLs, or http(s) URLs this server fetches under its own --image-fetch policy): the
preprocessing runs here, in a process pool, as well as the tower, so image-heavy traffic scales
with encoders and not with LLM replicas. Each image's embeddings are leased on the direct-transfer
listener (one chunk keyed by the image's content hash, under a transfer id of its own) for
--kv-transfer-lease seconds; the answer says where, with the grid, token count and content hash
the engine's side needs to place the image in its prompt.
"""

from __future__ import annotations

import asyncio
import secrets
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.config import ServerConfig
from deepinfer.encoder.tower import VisionTower
from deepinfer.recipe.ir import ImagePart
from deepinfer.server.auth import check_api_key
from deepinfer.server.errors import ApiError, error_response
from deepinfer.server.http_io import read_json
from deepinfer.server.images import ImageLimits, prepare_images
from deepinfer.transport.kv_transfer import KVTransferServer

REAP_INTERVAL_S = 0.25


class PartWire(msgspec.Struct):
    url: str
    detail: str | None = None
    media_type: str | None = None
    path: str | None = None


class EncodeBody(msgspec.Struct):
    images: list[PartWire]


class EncoderService:
    """The tower, the preprocessing pool and the transfer listener, shared by the routes."""

    def __init__(
        self, tower: VisionTower, transfer: KVTransferServer, pool: ProcessPoolExecutor, config: ServerConfig
    ) -> None:
        self.tower = tower
        self.transfer = transfer
        self.pool = pool
        self.config = config
        self.policy = config.image_fetch_policy()
        self.limits = ImageLimits(config.max_images_per_request, config.image_max_pixels)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="vision-tower")  # the tower is not shared
        self.num_requested = 0  # images asked for (encoded, or found in the cache)

    async def encode(self, parts: list[ImagePart]) -> list[dict[str, object]]:
        """Preprocess, encode and lease every part; a bad image is an ApiError(400) naming it.
        Adds one lease per image to the transfer listener."""
        images = await prepare_images(self.pool, parts, self.policy, self.limits)
        loop = asyncio.get_running_loop()
        payloads = await loop.run_in_executor(self._compute, self.tower.embeddings, images)
        self.num_requested += len(images)
        answer = []
        for image, payload in zip(images, payloads, strict=True):
            transfer_id = f"{image.content_hash.hex()}-{secrets.token_hex(8)}"
            self.transfer.lease(transfer_id, [image.content_hash], [payload])
            answer.append(
                {
                    "num_tokens": image.num_tokens,
                    "patch_rows": image.patch_rows,
                    "patch_cols": image.patch_cols,
                    "content_hash": image.content_hash.hex(),
                    "address": self.transfer.address,
                    "transfer_id": transfer_id,
                }
            )
        return answer

    async def reap_forever(self) -> None:
        """Drop leases pulled, failed or past their deadline (the listener only marks them)."""
        while True:
            self.transfer.reap()
            await asyncio.sleep(REAP_INTERVAL_S)

    def metrics(self) -> str:
        """Prometheus text: what this encoder did since it started."""
        t = self.transfer
        rows = [
            (
                "images_requested",
                "counter",
                "images asked for (encoded or found in the cache)",
                self.num_requested,
            ),
            ("images_encoded", "counter", "images run through the vision tower", self.tower.num_encoded),
            ("images_served", "counter", "image embeddings an engine pulled", t.num_sent - t.num_released),
            (
                "leases_released",
                "counter",
                "leases an engine ended unread (it had the image cached)",
                t.num_released,
            ),
            ("leases_expired", "counter", "leases that ended before an engine pulled them", t.num_expired),
            ("leases_active", "gauge", "embeddings leased, not yet pulled or expired", t.num_leases),
            ("leased_bytes", "gauge", "host memory the leased embeddings hold", t.num_bytes),
            (
                "transfer_peers_refused",
                "counter",
                "transfer connections closed unread: over the limit, or without the cluster key",
                t.num_refused,
            ),
        ]
        lines = []
        for name, kind, text, value in rows:
            full = f"deepinfer_encoder_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}", f"{full} {value}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.transfer.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
        self.pool.shutdown(wait=False, cancel_futures=True)


def build_encoder_app(service: EncoderService) -> FastAPI:
    app = FastAPI(title="DeepInfer encoder", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(error, "openai")

    @app.post("/v1/encode")
    async def encode(request: Request) -> JSONResponse:
        # The key first, then the body within its limit: nothing unauthenticated is read.
        check_api_key(service.config.api_keys, request.headers)
        raw = await read_json(request, service.config.max_body_bytes)
        try:
            body = msgspec.convert(raw, EncodeBody)
        except msgspec.ValidationError as error:
            raise ApiError(400, f"POST /v1/encode: {error}", param="images") from None
        parts = [
            ImagePart(url=p.url, media_type=p.media_type, detail=p.detail, path=p.path) for p in body.images
        ]
        return JSONResponse({"layout": service.tower.layout, "images": await service.encode(parts)})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "role": "encode"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        config = service.config
        if (config.api_keys or config.admin_keys) and not config.public_metrics:
            check_api_key(config.admin_keys or config.api_keys, request.headers)
        return Response(service.metrics(), media_type="text/plain; version=0.0.4")

    return app
