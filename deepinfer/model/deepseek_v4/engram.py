"""DeepSeek-V4.1's Engram: a hashed n-gram memory added to the mHC streams of a few layers.

For every token, the n-grams that end at it (orders 2 .. max_ngram_size) are hashed into
prime-sized tables, one per order and head; the gathered rows, end to end, are projected
(`engram.wkv`) into one key per stream and one shared value; each stream then adds the value
scaled by a gate from how well its RMS-normalised state matches its key.

N-gram ids, per token at position p of its sequence (column r is the token at p - r):
- token ids go through the compressed vocabulary first when the checkpoint has one (many raw
  ids, e.g. casings and spacings of one word, share one compressed id; `compressed_vocabulary`
  builds the map from the tokenizer as DeepSeek's engine does);
- a column before the sequence's first token reads the Engram pad token (`engram_pad_token_id`,
  mapped like any token), so in a flattened batch no sequence's first tokens ever hash with the
  previous sequence's last ones (DeepSeek's C++ `fill_engram_row` does the same);
- a chunk that starts later in its sequence (chunked prefill, decode) takes its first columns
  from `context`: the max_ngram_size - 1 tokens before the chunk;
- image tokens: an image position reads IMAGE_SENTINEL instead of its id, and from the first
  column that reads one (walking back from p) every column is the pad token, so no n-gram spans
  an image and text after an image hashes as if its sequence started there. The kept token ids
  (the context of a later chunk) hold the sentinel at image positions, so a prompt chunked
  across an image reads what it reads whole: the id alone cannot tell (a `<｜image｜>` id the
  request gives no image for is text), DeepSeek's compressed ids hold the sentinel the same way.

Hash (TileKernels' `engram_hash`): with one odd int64 multiplier per column and layer,
h_n = XOR_{r<n} (id_r * mult_r) for n = 2 .. max_ngram_size, and head j of order n reads row
h_n mod prime[n][j] of its table; the layer's one stored table holds the (order, head) tables
end to end, so a row index is that plus the table's offset. The products cannot overflow: the
multipliers are drawn below int64_max / vocabulary (DeepSeek's NumPy recipe, reproduced here
because the table contents were trained against those exact draws).

Gate (TileKernels' `engram_gate_fwd`), per token and stream h, D = hidden size:
    dot_h = sum(x_h * k_h * q_weight_h * k_weight_h) * rstd(x_h) * rstd(k_h) / sqrt(D)
    x_h  += sigmoid(sign(dot_h) * sqrt(max(|dot_h|, 1e-6))) * v
The signed square root flattens large scores so one strong match cannot saturate the gate.

Image rows (TileKernels' `engram_hash` / `engram_gate_fwd` with `image_token_mask`): their
table rows are -1 (`rows` with the mask) and their streams are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers

from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch, EngramSpec
from deepinfer.model.deepseek_v4.v41_weights import EngramTable

GATE_CLAMP = 1e-6  # the floor under |dot| before the square root (DeepSeek's clamp_value)
HASH_SEED = 0  # DeepSeek's NgramHashMapping default; the trained tables depend on it
PAD_TOKEN = "<｜▁pad▁｜>"
PAD_ID = 2  # DeepSeek's engine refuses a tokenizer with its pad elsewhere
IMAGE_SENTINEL = -1  # an image position in Engram's token ids (DeepSeek's compressed sentinel)


def compressed_vocabulary(tokenizer: Tokenizer) -> torch.Tensor:
    """int64 [vocab]: raw token id -> compressed id, DeepSeek's rule. Each token's text, decoded
    alone (special tokens kept), is keyed by its NFKC, accent-less, lower-case form with runs of
    whitespace as one space and trimmed (a token that is only whitespace stays one space); a token
    whose text is not valid UTF-8 alone (a byte piece) keeps its vocabulary spelling, so distinct
    pieces stay distinct. Compressed ids are given in order of first appearance."""
    if tokenizer.token_to_id(PAD_TOKEN) != PAD_ID:
        raise ValueError(f"Engram: the tokenizer's {PAD_TOKEN} is not token {PAD_ID}")
    keep_space = "\ue000"  # a private-use stand-in, so Strip cannot empty a lone space
    normalize = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    ).normalize_str
    size = tokenizer.get_vocab_size()
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    ids: dict[str, int] = {}
    mapping = []
    for token_id, text in enumerate(texts):
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else (normalize(text) or text)
        if key is None:
            raise ValueError(f"Engram: token {token_id} has no spelling in the tokenizer's vocabulary")
        mapping.append(ids.setdefault(key, len(ids)))
    return torch.tensor(mapping, dtype=torch.int64)


def hash_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, vocab_size: int, seed: int = HASH_SEED
) -> torch.Tensor:
    """int64 [layers, max_ngram_size]: DeepSeek's odd multipliers, a NumPy PCG64 stream per layer
    seeded with seed + 10007 * layer. Drawn below (int64_max // vocab) // 2, then 2x + 1: odd,
    and a product with any token id stays below int64_max."""
    bound = max(1, (np.iinfo(np.int64).max // vocab_size) // 2)
    rows = []
    for layer in layer_ids:
        draws = np.random.default_rng(int(seed + 10007 * layer)).integers(
            0, bound, size=(max_ngram_size,), dtype=np.int64
        )
        rows.append(draws * 2 + 1)
    return torch.from_numpy(np.stack(rows))


def table_offsets(table_sizes: torch.Tensor) -> torch.Tensor:
    """int64 [orders * heads]: where each (order, head) table starts in the layer's stored table
    (the exclusive prefix sum of its sizes, order-major like the checkpoint's rows)."""
    sizes = table_sizes.reshape(-1).long()
    return torch.cumsum(sizes, 0) - sizes


def ngram_context(previous: Sequence[Sequence[int]], max_ngram_size: int, pad_id: int) -> torch.Tensor:
    """int64 [S, max_ngram_size - 1]: each sequence's last tokens before its chunk, oldest first,
    left-padded with pad_id where the sequence has fewer (a fresh prompt has none)."""
    width = max_ngram_size - 1
    rows = []
    for tokens in previous:
        tail = list(tokens[len(tokens) - width :]) if width else []
        rows.append([pad_id] * (width - len(tail)) + tail)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(previous), width)


def ngram_windows(token_ids: torch.Tensor, seq_lens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """token_ids [T] (the sequences' chunks end to end), seq_lens [S] (sum T), context [S, n - 1]
    (each chunk's preceding tokens, oldest first) -> int64 [T, n], column r the token r back."""
    n = context.shape[1] + 1
    seq_lens = seq_lens.long()
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)  # [T] owning sequence
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    local = torch.arange(len(token_ids)) - starts[seq]  # [T] index inside its chunk
    back = local[:, None] - torch.arange(n)[None, :]  # [T, n] chunk index of column r
    own = token_ids.long()[(starts[seq][:, None] + back).clamp(min=0)]
    # back < 0: before the chunk, context column n - 1 + back (back >= -(n - 1) since local >= 0);
    # the clamps only keep the unused side of each where() in range.
    earlier = context.long()[seq[:, None], (back + n - 1).clamp(0, n - 2)]
    return torch.where(back >= 0, own, earlier)


def with_image_sentinels(token_ids: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
    """token_ids [T], image_mask [T] bool (None: all text) -> int64 [T], IMAGE_SENTINEL at the
    image positions: what Engram reads, and what a sequence keeps as a later chunk's context."""
    ids = token_ids.long()
    if image_mask is None:
        return ids
    return torch.where(image_mask.to(ids.device), IMAGE_SENTINEL, ids)


def cut_at_images(windows: torch.Tensor, pad_id: int) -> torch.Tensor:
    """windows int64 [T, n] (column r = r tokens back, IMAGE_SENTINEL at image positions) -> the
    same with every column from the first image one on (walking back) replaced by pad_id."""
    hit = (windows == IMAGE_SENTINEL).long().cumsum(dim=1) > 0  # [T, n]
    return windows.masked_fill(hit, pad_id)


def engram_hash(
    windows: torch.Tensor,
    multipliers: torch.Tensor,
    table_sizes: torch.Tensor,
    offsets: torch.Tensor,
    image_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """windows int64 [T, n] (compressed ids, column r = r tokens back), multipliers int64 [n],
    table_sizes [n - 1, heads] (primes), offsets [(n - 1) * heads], image_mask [T] bool (None:
    all text) -> rows int64 [T, (n - 1) * heads], -1 on image rows as TileKernels gives them."""
    products = windows.long() * multipliers.long()  # [T, n], below int64_max by the multipliers' bound
    sizes = table_sizes.long()
    h = products[:, 0]
    rows = []
    for order in range(1, windows.shape[1]):
        h = h ^ products[:, order]  # the hash of the (order + 1)-gram ending here
        rows.append(h[:, None] % sizes[order - 1][None, :])  # non-negative: every product is
    out = torch.cat(rows, dim=1) + offsets.long()
    return out if image_mask is None else out.masked_fill(image_mask[:, None], -1)


def gather_embeddings(table: EngramTable, rows: torch.Tensor) -> torch.Tensor:
    """rows int64 [T, C] -> float32 [T, C * head_dim]: only these rows are read from the mapped
    FP8 table and dequantized, in column order (the order wkv's inputs expect)."""
    return table.lookup(rows).flatten(1)


def gate_scores(
    streams: torch.Tensor,
    keys: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    eps: float,
    clamp: float = GATE_CLAMP,
) -> torch.Tensor:
    """streams, keys [T, m, D], RMSNorm weights [m, D] -> float32 gates in (0, 1) [T, m]."""
    x, key = streams.float(), keys.float()
    # Both RMSNorm weights only scale the product, so they fold into one (the kernel's fused weight).
    fused = weight_hidden.float() * weight_embed.float()  # [m, D]
    rstd_x = torch.rsqrt(x.square().mean(-1) + eps)  # [T, m]
    rstd_k = torch.rsqrt(key.square().mean(-1) + eps)
    dot = (x * key * fused).sum(-1) * rstd_x * rstd_k * x.shape[-1] ** -0.5  # [T, m]
    return torch.sigmoid(dot.sign() * dot.abs().clamp_min(clamp).sqrt())


def engram_gate(
    streams: torch.Tensor,
    kv: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    eps: float,
    clamp: float = GATE_CLAMP,
) -> torch.Tensor:
    """streams [T, m, D], kv [T, m + 1, D] (a key per stream, then the shared value), RMSNorm
    weights [m, D] -> new streams [T, m, D] in streams' dtype; computed in float32."""
    m = streams.shape[1]
    gate = gate_scores(streams, kv[:, :m], weight_hidden, weight_embed, eps, clamp)  # [T, m]
    value = kv[:, m].float()  # [T, D], shared by the streams
    return (streams.float() + gate[..., None] * value[:, None, :]).to(streams.dtype)


class EngramHashing:
    """What turns a batch's token ids into every Engram layer's table rows: the vocabulary map,
    the pad token, and per layer its multipliers, prime table sizes and offsets."""

    def __init__(self, spec: EngramSpec, vocab_size: int, vocab_map: torch.Tensor | None = None) -> None:
        if spec.compressed_vocab_size is not None:
            if vocab_map is None:
                raise ValueError(
                    "Engram: text_config.engram_compressed_vocab_size is set: the compressed vocabulary map is needed"
                )
            if int(vocab_map.max()) + 1 != spec.compressed_vocab_size or int(vocab_map.min()) < 0:
                raise ValueError(
                    f"Engram: the vocabulary map's ids span 0..{int(vocab_map.max())}, not the "
                    f"{spec.compressed_vocab_size} compressed ids of engram_compressed_vocab_size"
                )
            vocab_size = spec.compressed_vocab_size
        self.spec = spec
        self.vocab_map = None if vocab_map is None else vocab_map.long()
        self.multipliers = hash_multipliers(spec.layer_ids, spec.max_ngram_size, vocab_size)  # [L, n]
        self.table_sizes = torch.tensor(spec.table_sizes, dtype=torch.int64)  # [L, n - 1, heads]
        self.offsets = torch.stack([table_offsets(sizes) for sizes in self.table_sizes])  # [L, C]

    @classmethod
    def from_arch(cls, arch: DeepseekV41Arch, vocab_map: torch.Tensor | None = None) -> EngramHashing:
        if arch.engram is None:
            raise ValueError("the model has no Engram layers")
        return cls(arch.engram, arch.vocab_size, vocab_map)

    def context(self, previous: Sequence[Sequence[int]]) -> torch.Tensor:
        """Raw ids [S, n - 1] before each chunk, pad where the sequence has none."""
        return ngram_context(previous, self.spec.max_ngram_size, self.spec.pad_token_id)

    def windows(
        self,
        token_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        context: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Raw token ids [T] of S chunks -> the n-gram ids [T, n] every Engram layer hashes.
        context None: every chunk starts its sequence (all earlier columns are pad); its image
        positions hold IMAGE_SENTINEL, as the chunk's do where image_mask [T] is set."""
        if context is None:
            context = self.context([[] for _ in range(len(seq_lens))])
        windows = ngram_windows(with_image_sentinels(token_ids, image_mask), seq_lens, context)
        # Cut and mapped after gathering, so the pad is mapped too (DeepSeek's compressed pad
        # token) and no sentinel is left to map.
        windows = cut_at_images(windows, self.spec.pad_token_id)
        return windows if self.vocab_map is None else self.vocab_map[windows]

    def rows(self, layer: int, windows: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """n-gram ids [T, n] -> this layer's table rows [T, (n - 1) * heads], -1 on image rows."""
        i = self.spec.layer_ids.index(layer)
        return engram_hash(windows, self.multipliers[i], self.table_sizes[i], self.offsets[i], image_mask)


class Engram(torch.nn.Module):
    """One layer's Engram, applied to the mHC streams at the start of its block (DeepSeek adds it
    to the trunk after the previous block's post mix, before this block's pre mix)."""

    def __init__(
        self,
        layer: int,
        hashing: EngramHashing,
        table: EngramTable,
        wkv: torch.Tensor,  # [hidden * (m + 1), orders * heads * head_dim], dequantized
        q_weight: torch.Tensor,  # [m, hidden]: the streams' RMSNorm weight
        k_weight: torch.Tensor,  # [m, hidden]: the keys' RMSNorm weight
        eps: float,
    ) -> None:
        super().__init__()
        self.layer, self.hashing, self.table, self.eps = layer, hashing, table, eps
        self.wkv = torch.nn.Parameter(wkv, requires_grad=False)
        self.q_weight = torch.nn.Parameter(q_weight, requires_grad=False)
        self.k_weight = torch.nn.Parameter(k_weight, requires_grad=False)

    @classmethod
    def from_weights(
        cls,
        arch: DeepseekV41Arch,
        layer: int,
        hashing: EngramHashing,
        tensors: dict[str, torch.Tensor],
        table: EngramTable,
    ) -> Engram:
        """From load_v41_weights' float32 tensors (HF names) and the layer's mapped table."""
        prefix = f"layers.{layer}.engram."
        return cls(
            layer,
            hashing,
            table,
            tensors[prefix + "wkv.weight"],
            tensors[prefix + "q_weight"],
            tensors[prefix + "k_weight"],
            arch.rms_norm_eps,
        )

    def forward(
        self,
        streams: torch.Tensor,  # [T, m, hidden]
        token_ids: torch.Tensor,  # [T] raw ids, the S chunks end to end
        seq_lens: torch.Tensor,  # [S]
        context: torch.Tensor | None = None,  # [S, n - 1] raw ids before each chunk (-1: image)
        image_mask: torch.Tensor | None = None,  # [T] bool, None: all text
    ) -> torch.Tensor:
        windows = self.hashing.windows(token_ids, seq_lens, context, image_mask)
        return self.forward_windows(streams, windows, image_mask)

    def forward_windows(
        self, streams: torch.Tensor, windows: torch.Tensor, image_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """With the n-gram ids [T, n] computed once for all Engram layers of a step; the rows
        image_mask [T] marks keep their streams (DeepSeek's gate leaves them as they are). Every
        row is computed, as the kernel does (an image row's window is all pad, a valid table
        row), so the text rows' float32 results do not depend on where the images are."""
        embeddings = gather_embeddings(
            self.table, self.hashing.rows(self.layer, windows)
        )  # [T, C * head_dim]
        kv = F.linear(embeddings, self.wkv).unflatten(-1, (streams.shape[1] + 1, streams.shape[2]))
        gated = engram_gate(streams, kv, self.q_weight, self.k_weight, self.eps)
        if image_mask is None:
            return gated
        return torch.where(image_mask.to(streams.device)[:, None, None], streams, gated)
