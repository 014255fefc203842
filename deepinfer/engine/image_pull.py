"""An engine's side of image encoders (`--encoder`): the embeddings an encode-role server
computed for a request's images, pulled when the request arrives.

The encoder leases each image's embeddings on its direct-transfer listener (engine/kv_transfer.py:
one chunk, keyed by the image's content hash) and the API side passes the lease on in
`ImageInput.encoded`. Pulling when the request is added, rather than when its prefill reaches
the image, makes a failure that request's alone (it ends with an error before it holds a KV
block) and the pulled bytes then travel with the request, so no cache eviction can lose them
before the prefill. An image whose embeddings the engine's encoder-output cache holds is not
pulled: its lease is released unread, as is a second lease of an image the request holds twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

import msgspec

from deepinfer.engine.kv_transfer import KVPuller
from deepinfer.image_input import ImageInput
from deepinfer.sequence import KVSource

log = logging.getLogger(__name__)

FLOAT32 = 4


class ImageFetchError(RuntimeError):
    """A request's image embeddings did not come from its encoder (gone, lease over, too slow)."""


class ImagePuller:
    def __init__(self, layout: str, timeout_s: float) -> None:
        self.layout = layout  # image_input.embeddings_layout of this engine's model
        self._puller = KVPuller(timeout_s, threads=4)
        self.num_pulled = 0
        self.num_reused = 0  # leased images the encoder-output cache already held

    def fetch(self, images: list[ImageInput], cached: Callable[[bytes], bytes | None]) -> list[ImageInput]:
        """`images` with each leased one's embeddings in `embeds` (from `cached`, the engine's
        encoder-output cache by content hash, else pulled, in parallel); the rest as they are.
        ImageFetchError when a pull fails or times out. Mutates nothing of its arguments."""
        pulls: dict[bytes, Future] = {}
        found: dict[bytes, bytes] = {}
        for image in images:
            if image.encoded is None:
                continue
            source = KVSource(image.encoded.address, image.encoded.transfer_id)
            key = image.content_hash
            if key not in found and key not in pulls:
                embeds = cached(key)
                if embeds is not None:
                    found[key] = embeds
                    self.num_reused += 1
                else:
                    pulls[key] = self._puller.pull(source, [key], self.layout)
                    continue
            self._release(source)
        errors = []
        for key, future in pulls.items():
            try:  # every pull is waited for (each is bounded by the timeout): none outlives the request
                payloads = future.result()
            except Exception as error:
                errors.append(str(error))
                continue
            if len(payloads) != 1:
                errors.append("the encoder no longer holds the image's embeddings")
                continue
            found[key] = payloads[0].tobytes()
            self.num_pulled += 1
        if errors:
            raise ImageFetchError(f"an image's embeddings did not arrive from its encoder: {errors[0]}")
        out = []
        for image in images:
            if image.encoded is None:
                out.append(image)
                continue
            embeds = found[image.content_hash]
            if len(embeds) % (image.num_tokens * FLOAT32):
                raise ImageFetchError(
                    f"the encoder sent {len(embeds)} bytes for an image of {image.num_tokens} tokens"
                )
            out.append(msgspec.structs.replace(image, encoded=None, embeds=embeds))
        return out

    def _release(self, source: KVSource) -> None:
        """End a lease this engine will not read (an empty pull), without waiting for it."""
        self._puller.pull(source, [], self.layout).add_done_callback(_log_failed_release)

    def close(self) -> None:
        self._puller.close()


def _log_failed_release(future: Future) -> None:
    # The lease then ends on the encoder's clock instead: nothing to undo here.
    if future.exception() is not None:
        log.debug("releasing an image lease failed: %s", future.exception())
