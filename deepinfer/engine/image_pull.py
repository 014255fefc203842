"""An engine's side of image encoders (`--encoder`): the embeddings an encode-role server
computed for a request's images, pulled while the request waits.

The encoder leases each image's embeddings on its direct-transfer listener (transport/kv_transfer.py:
one chunk, keyed by the image's content hash) and the API side passes the lease on in
`ImageInput.encoded`. The pulls start when the request is added and run on the puller's threads;
the request's sequence waits with `num_pending` raised (the scheduler does not admit it) and the
engine polls the pulls each step, so a slow or stalled encoder delays that request alone. A
failure is that request's alone too: it ends with an error before it holds a KV block. The pulled
bytes then travel with the request, so no cache eviction can lose them before the prefill. An
image whose embeddings the engine's encoder-output cache holds is not pulled: its lease is
released unread, as is a second lease of an image the request holds twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import numpy as np

from deepinfer.image_input import ImageInput
from deepinfer.sequence import KVSource, Sequence
from deepinfer.transport.kv_transfer import KVPuller

log = logging.getLogger(__name__)

FLOAT32 = 4


@dataclass(slots=True)
class _Pending:
    seq: Sequence
    pulls: dict[bytes, Future[list[np.ndarray]]]  # content hash -> its pull, in flight or landed
    found: dict[bytes, bytes]  # content hash -> embeddings (the cache's, then the landed pulls')


class ImagePuller:
    """The pulls of waiting requests' image embeddings: attach() starts them and holds the
    sequence back, poll() (each engine step) lands them or reports the failures, forget()
    drops an aborted sequence's."""

    def __init__(self, layout: str, timeout_s: float, key: bytes | None = None) -> None:
        self.layout = layout  # image_input.embeddings_layout of this engine's model
        self._puller = KVPuller(timeout_s, threads=4, key=key)  # key: the cluster key
        self._pending: dict[int, _Pending] = {}  # seq_id -> what it waits for
        self.num_pulled = 0
        self.num_reused = 0  # leased images the encoder-output cache already held

    @property
    def num_in_flight(self) -> int:
        """Sequences waiting on their images' pulls."""
        return len(self._pending)

    def attach(self, seq: Sequence, cached: Callable[[bytes], bytes | None]) -> None:
        """Start pulling the embeddings of `seq`'s leased images that `cached` (the engine's
        encoder-output cache, by content hash) lacks, in parallel, and raise `seq.num_pending`
        until poll() lands them. With nothing to pull, `seq.request.images` is replaced at once
        by the images carrying their embeddings."""
        pulls: dict[bytes, Future[list[np.ndarray]]] = {}
        found: dict[bytes, bytes] = {}
        for image in seq.request.images:
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
        pending = _Pending(seq, pulls, found)
        if not pulls and self._land(pending) is None:
            return  # all from the cache: nothing to wait for (a failure is poll()'s to report)
        seq.num_pending += 1
        self._pending[seq.seq_id] = pending

    def poll(self) -> dict[str, str]:
        """Land the sequences whose pulls all arrived: their request's images are replaced by
        ones carrying the embeddings. Each sequence done with, landed or failed, has its
        `num_pending` dropped by one. Returns request_id -> error for those whose pull failed or
        timed out, or sent embeddings of the wrong size (those are to end)."""
        failures: dict[str, str] = {}
        for seq_id, pending in list(self._pending.items()):
            error = None
            for key, future in pending.pulls.items():
                if key in pending.found or not future.done():
                    continue
                try:
                    payloads = future.result()
                except Exception as failure:
                    error = str(failure)
                    break
                if len(payloads) != 1:
                    error = "the encoder no longer holds the image's embeddings"
                    break
                pending.found[key] = payloads[0].tobytes()
                self.num_pulled += 1
            if error is None and any(key not in pending.found for key in pending.pulls):
                continue  # still pulling
            del self._pending[seq_id]
            pending.seq.num_pending -= 1
            if error is not None:
                error = f"an image's embeddings did not arrive from its encoder: {error}"
            else:
                error = self._land(pending)
            if error is not None:
                failures[pending.seq.request_id] = error
        return failures

    def forget(self, seqs: list[Sequence]) -> None:
        """Stop waiting for these (aborted) sequences' pulls: a pull still running ends on its
        own, bounded by the timeout, and its result is dropped with the future."""
        for seq in seqs:
            self._pending.pop(seq.seq_id, None)

    @staticmethod
    def _land(pending: _Pending) -> str | None:
        """Replace the request's leased images by ones carrying their embeddings (mutates
        `pending.seq.request.images`); for embeddings of the wrong size, the error, and nothing
        changed."""
        request = pending.seq.request
        images: list[ImageInput] = []
        for image in request.images:
            if image.encoded is None:
                images.append(image)
                continue
            embeds = pending.found[image.content_hash]
            if len(embeds) % (image.num_tokens * FLOAT32):
                return f"the encoder sent {len(embeds)} bytes for an image of {image.num_tokens} tokens"
            images.append(msgspec.structs.replace(image, encoded=None, embeds=embeds))
        request.images = images
        return None

    def _release(self, source: KVSource) -> None:
        """End a lease this engine will not read (an empty pull), without waiting for it."""
        self._puller.pull(source, [], self.layout).add_done_callback(_log_failed_release)

    def close(self) -> None:
        self._pending.clear()
        self._puller.close()


def _log_failed_release(future: Future) -> None:
    # The lease then ends on the encoder's clock instead: nothing to undo here.
    if future.exception() is not None:
        log.debug("releasing an image lease failed: %s", future.exception())
