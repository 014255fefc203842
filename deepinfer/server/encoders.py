"""The API side of image encoders (`--encoder URL`): a request's image parts go to an
encode-role server, which preprocesses and encodes them and answers, per image, its grid, token
count, content hash and the lease the engine pulls the embeddings from (engine/image_pull.py).

The parts go as the client gave them (data URLs, or URLs the encoder fetches): preprocessing is
half the per-image work on the CPU, and it scales with the encoders this way. Encoders are tried
in turn from the one after the last that answered; one that cannot be reached, times out or
fails is skipped, and when none answers the request gets a 503 naming them. A bad image is the
encoder's 400, passed on naming the part.
"""

from __future__ import annotations

import itertools
import logging

import httpx

from deepinfer.image_input import EncodedAt, ImageInput
from deepinfer.recipe.ir import ImagePart
from deepinfer.server.errors import ApiError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class EncoderClient:
    def __init__(self, urls: list[str], timeout_s: float) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self._next = itertools.cycle(range(len(self.urls)))
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))

    async def encode(self, parts: list[ImagePart], api_key: str | None = None) -> list[ImageInput]:
        """The parts' images as the engine gets them (no pixels: `encoded` says where their
        embeddings wait), offsets 0 (expand_placeholders places them). The client's `api_key`
        goes along: an encoder started with the engines' --api-key values checks it."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        body = {
            "images": [
                {"url": p.url or "", "detail": p.detail, "media_type": p.media_type, "path": p.path}
                for p in parts
            ]
        }
        first = next(self._next)
        failures = []
        for url in self.urls[first:] + self.urls[:first]:
            try:
                response = await self._http.post(url + "/v1/encode", json=body, headers=headers)
            except httpx.HTTPError as error:
                failures.append(f"{url}: {type(error).__name__} {error}".rstrip())
                continue
            if response.status_code == 400:
                error = _error_of(response)
                raise ApiError(400, error.get("message", "bad image"), param=error.get("param"))
            if response.status_code != 200:
                failures.append(f"{url}: HTTP {response.status_code}")
                continue
            return [_image(item) for item in response.json()["images"]]
        log.warning("no image encoder answered: %s", "; ".join(failures))
        raise ApiError(
            503,
            f"no image encoder answered (of {len(self.urls)}; their addresses are in the server's log)",
            code="encoder_unavailable",
            headers={"retry-after": "1"},
        )

    async def close(self) -> None:
        await self._http.aclose()


def _error_of(response: httpx.Response) -> dict:
    try:
        return dict(response.json().get("error") or {})
    except (ValueError, AttributeError):
        return {"message": f"the encoder refused an image: {response.text[:200]}"}


def _image(item: dict) -> ImageInput:
    return ImageInput(
        0,
        int(item["num_tokens"]),
        int(item["patch_rows"]),
        int(item["patch_cols"]),
        b"",
        bytes.fromhex(item["content_hash"]),
        encoded=EncodedAt(item["address"], item["transfer_id"]),
    )
