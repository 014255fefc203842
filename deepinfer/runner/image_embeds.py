"""The embeddings a step puts at its image token positions, with an encoder-output cache.

A prefill chunk that reaches an image's positions needs that image's embeddings (all of them
are computed at once: the tower sees the whole picture), and a chunk that covers only part of
an image takes its rows. Outputs are kept by content hash, least recently used first out, so a
later chunk of the same image, the same image in a later turn or in another request is not
encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from deepinfer.image_input import ImageInput
from deepinfer.runner.inputs import RowSpan

PATCH = 14  # the preprocessing cuts 14-pixel patches (recipe/images/geometry.py)
DEFAULT_CACHE_BYTES = 256 << 20

# patches [P, 3, 14, 14] and each image's (rows, cols) -> embeddings [sum of tokens, hidden]
Encoder = Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor]


def image_patches(image: ImageInput) -> torch.Tensor:
    """[rows * cols, 3, 14, 14] float32, (x / 255 - 0.5) / 0.5 in scanline order: the
    preprocessing's normalisation (ImagePixels.patches), bit for bit."""
    rows, cols = image.patch_rows, image.patch_cols
    hwc = torch.frombuffer(bytearray(image.pixels), dtype=torch.uint8).view(rows * PATCH, cols * PATCH, 3)
    x = (hwc.float() / 255.0 - 0.5) / 0.5
    grid = x.view(rows, PATCH, cols, PATCH, 3)
    return grid.permute(0, 2, 4, 1, 3).reshape(rows * cols, 3, PATCH, PATCH).contiguous()


def pulled_embeddings(image: ImageInput) -> torch.Tensor:
    """[num_tokens, hidden] float32 from the bytes an encoder sent (engine/image_pull.py)."""
    flat = torch.frombuffer(bytearray(image.embeds), dtype=torch.float32)
    if flat.numel() % image.num_tokens:
        raise ValueError(f"{len(image.embeds)} bytes of embeddings for an image of {image.num_tokens} tokens")
    return flat.view(image.num_tokens, -1)


class ImageEmbeddings:
    def __init__(self, encode: Encoder, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.encode = encode
        self.max_bytes = max_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.num_encoded = 0  # images run through the tower (a cache hit does not count)

    def get(self, content_hash: bytes) -> torch.Tensor | None:
        """The cached embeddings of an image [num_tokens, hidden], if any (marked recently used)."""
        if content_hash not in self._cache:
            return None
        self._cache.move_to_end(content_hash)
        return self._cache[content_hash]

    def of(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings [num_tokens, hidden]; those not cached are encoded together."""
        missing = list(
            {image.content_hash: image for image in images if image.content_hash not in self._cache}.values()
        )
        for image in [image for image in missing if image.embeds]:  # an encoder's, pulled already
            self._put(image.content_hash, pulled_embeddings(image))
        missing = [image for image in missing if not image.embeds]
        if missing:
            patches = torch.cat([image_patches(image) for image in missing])
            out = self.encode(patches, [(image.patch_rows, image.patch_cols) for image in missing])
            for image, embeds in zip(
                missing, out.split([image.num_tokens for image in missing]), strict=True
            ):
                if embeds.shape[0] != image.num_tokens:
                    raise ValueError(
                        f"the vision tower gives {embeds.shape[0]} tokens for a {image.patch_rows}x"
                        f"{image.patch_cols}-patch image whose prompt holds {image.num_tokens}"
                    )
                self._put(image.content_hash, embeds.clone())
            self.num_encoded += len(missing)
        found = []
        for image in images:
            self._cache.move_to_end(image.content_hash)
            found.append(self._cache[image.content_hash])
        return found

    def _put(self, key: bytes, embeds: torch.Tensor) -> None:
        self._cache[key] = embeds
        self._bytes += embeds.nbytes
        # Never drop what was just added: a step needs it even when it alone is over the budget.
        while self._bytes > self.max_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._bytes -= dropped.nbytes

    def splice(
        self, spans: Sequence[RowSpan], offsets: Sequence[int], num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(image_mask [T] bool over the step's flattened rows, embeddings [mask.sum(), hidden] in
        row order), or None when no span reaches an image."""
        if not any(span.images for span in spans):
            return None
        pieces: list[tuple[int, torch.Tensor]] = []
        mask = torch.zeros(num_rows, dtype=torch.bool)
        for span, row in zip(spans, offsets, strict=True):
            if not span.images:
                continue
            end = span.start + len(span.token_ids)
            for image, embeds in zip(span.images, self.of(span.images), strict=True):
                first, last = max(image.offset, span.start), min(image.end, end)
                at = row + first - span.start
                mask[at : at + last - first] = True
                pieces.append((at, embeds[first - image.offset : last - image.offset]))
        pieces.sort(key=lambda piece: piece[0])
        return mask, torch.cat([embeds for _, embeds in pieces])
