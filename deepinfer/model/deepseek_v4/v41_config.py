"""DeepSeek-V4.1-Flash's config.json (`model_type: deepseek_v41`), validated and parsed.

The file nests the language model under `text_config` and the vision tower under
`vision_config`. What is accepted is what DeepSeek's own engine (DeepInfer 0.1.0) accepts: its
config parser, plus the checks its model builder and cross-layer topology make at start-up,
each moved here so that a bad config fails before any weight is read, with the key named:

- `compress_ratios`: one entry per backbone layer and per DSpark layer, 0 (sliding window only),
  1 (C1: every token becomes a compressed entry) or 2 (C2: two tokens per entry). V4's rates 4
  and 128 are rejected, as DeepSeek's compressor rejects them. The first C1 layer is the YoCo
  boundary: it and the layers before it form the prefill side, the later layers consume it.
- `kv_source_layer_ids`, `index_source_layer_ids`, `index_k_source_layer_ids` (default: the KV
  sources): each layer from the first source on reuses the compressed KV, the top-k indices or
  the indexer keys of the nearest source at or before it. Only compressed layers may consume;
  a consumer and its source share their compress ratio; the segments refine each other
  (top-k within index-K within KV); the YoCo boundary is a KV source.
- `candidate_source_layer_id` (null: none), `candidate_topk_blocks`, `candidate_block_size`: the
  two-level top-k; every later layer picks its top-k inside the source's candidate blocks.
- `hc_*`: hyper-connections, `hc_shifted` true unless said otherwise.
- MoE keys: sqrtsoftplus scores, noaux_tc top-k, normalized top-k probabilities.
- `dspark_*`: the DSpark draft layers (`num_nextn_predict_layers` of them).
- `engram_*`: Engram layers with their prime-sized hashed tables.
- `vision_config`: the ViT's width, patch size (14 only) and merge ratio; depth, heads and MLP
  width default to the values DeepSeek's engine fixes in code.

Stricter than DeepSeek's parser in one respect: a layer id outside the backbone (in the sharing,
DSpark target or Engram lists), which DeepSeek's silently ignores, is an error here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.model.deepseek_v4.config import RopeSpec

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
SLIDING, C1, C2 = 0, 1, 2
COMPRESS_RATIOS = (SLIDING, C1, C2)
INDEX_ROPE_DIM = 64  # DeepSeek's indexer applies RoPE to exactly 64 channels
CANDIDATE_MAX_BLOCK_SIZE = 16
CANDIDATE_TOPK_MULTIPLE = 8
# DeepSeek's V4.1 ViT, fixed in its code: patch size, depth, heads, SwiGLU width rule.
VISION_PATCH_SIZE = 14
VISION_LAYERS = 32
VISION_HEADS = 16
VISION_MLP_RATIO = 2.7
VISION_MLP_MULTIPLE = 128
_FIXED_TEXT = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "num_key_value_heads": 1,
}
_FIXED_QUANT = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}
_FIXED_MOE = {"scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True}


@dataclass(slots=True, frozen=True)
class YarnSpec:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(slots=True, frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    num_shared_experts: int
    intermediate_size: int
    routed_scaling_factor: float


@dataclass(slots=True, frozen=True)
class CandidateBlocks:
    """Two-level top-k: `source_layer` keeps `topk_blocks` blocks of `block_size` compressed entries
    (its own top-k still ranks all entries); every later indexer layer chooses its top-k inside them."""

    source_layer: int
    topk_blocks: int
    block_size: int


@dataclass(slots=True, frozen=True)
class DSparkSpec:
    num_layers: int  # num_nextn_predict_layers
    block_size: int  # tokens drafted per block
    target_layer_ids: tuple[int, ...]  # backbone layers whose attention inputs feed the drafter
    markov_rank: int
    noise_token_id: int
    pad_token_id: int
    moe: MoeSpec  # the draft layers' own expert count and top-k


@dataclass(slots=True, frozen=True)
class EngramSpec:
    layer_ids: tuple[int, ...]
    max_ngram_size: int  # n-grams of 2..max_ngram_size: max_ngram_size - 1 tables per layer
    vocab_size: int  # nominal rows of one head's table; the real size is the next unused prime
    num_heads: int
    head_dim: int  # one table row
    pad_token_id: int
    compressed_vocab_size: int | None  # set: token ids are mapped onto the compressed vocabulary
    # Per Engram layer (in layer_ids order), per n-gram table, per head: its prime row count.
    table_sizes: tuple[tuple[tuple[int, ...], ...], ...]

    def layer_table_sizes(self, layer: int) -> tuple[tuple[int, ...], ...]:
        return self.table_sizes[self.layer_ids.index(layer)]

    def layer_rows(self, layer: int) -> int:
        """Rows of the layer's one stored table: all heads of all n-gram tables, end to end."""
        return sum(sum(heads) for heads in self.layer_table_sizes(layer))


@dataclass(slots=True, frozen=True)
class VisionSpec:
    """The vision tower: a ViT over 14-pixel patches, then d x d patches merged into one LM token."""

    hidden_size: int
    downsample_ratio: int  # d
    patch_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int  # the SwiGLU's hidden width

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(slots=True, frozen=True)
class DeepseekV41Arch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int  # the one shared KV vector per token: latent + RoPE channels
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # backbone layers only: 0, 1 or 2
    yoco_boundary: int | None  # first C1 layer; None when it is a DSpark layer (YoCo off)
    kv_source: tuple[int, ...]  # per backbone layer: whose compressed KV it reads (itself: own)
    index_source: tuple[int, ...]  # whose top-k indices it uses
    index_k_source: tuple[int, ...]  # whose indexer keys (wk, k_norm) it uses
    candidate: CandidateBlocks | None
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_shifted: bool
    hc_sinkhorn_iters: int
    hc_eps: float
    moe: MoeSpec
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float  # sliding-window layers and DSpark layers
    compress_rope_theta: float  # compressed layers, their compressors and indexers
    yarn: YarnSpec | None  # applies with compress_rope_theta
    max_position_embeddings: int
    tie_word_embeddings: bool
    use_fp4_sparse_kv: bool
    dspark: DSparkSpec
    engram: EngramSpec | None
    vision: VisionSpec
    bos_token_id: int
    eos_token_id: int
    fp8_block: tuple[int, int]

    @property
    def kv_lora_rank(self) -> int:
        return self.head_dim - self.rope_head_dim

    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-only layers and for DSpark layers (layer >= num_layers)."""
        return self.compress_ratios[layer] if layer < self.num_layers else SLIDING

    def owns_compressor(self, layer: int) -> bool:
        return self.compress_ratio(layer) != SLIDING and self.kv_source[layer] == layer

    def owns_indexer(self, layer: int) -> bool:
        return self.compress_ratio(layer) != SLIDING and self.index_source[layer] == layer

    def owns_index_keys(self, layer: int) -> bool:
        return self.owns_indexer(layer) and self.index_k_source[layer] == layer

    def is_engram_layer(self, layer: int) -> bool:
        return self.engram is not None and layer in self.engram.layer_ids

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV41Arch:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_raw(raw)

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> DeepseekV41Arch:
        _check_top_level(raw)
        text = _section(raw, "text_config")
        vision = _section(raw, "vision_config")
        t = _Reader(text, "text_config")
        for key, expected in _FIXED_TEXT.items():
            if t.get(key) != expected:
                raise ValueError(
                    f"config.json: text_config.{key}={t.get(key)!r} is not supported (expected {expected!r})"
                )
        num_layers = t.positive("num_hidden_layers")
        num_dspark = t.integer("num_nextn_predict_layers", 0, minimum=0)
        ratios = _compress_ratios(t, num_layers, num_dspark)
        boundary = _yoco_boundary(ratios, num_layers)
        backbone = ratios[:num_layers]
        head_dim = t.positive("head_dim")
        rope_head_dim = t.positive("qk_rope_head_dim")
        if rope_head_dim != INDEX_ROPE_DIM:
            raise ValueError(
                f"config.json: text_config.qk_rope_head_dim={rope_head_dim} is not supported "
                f"(DeepSeek's indexer applies RoPE to {INDEX_ROPE_DIM} channels)"
            )
        if head_dim <= rope_head_dim:
            raise ValueError(
                f"config.json: text_config.head_dim={head_dim} must exceed qk_rope_head_dim={rope_head_dim} "
                "(the KV latent is the rest)"
            )
        num_heads = t.positive("num_attention_heads")
        o_groups = t.positive("o_groups")
        if num_heads % o_groups:
            raise ValueError(
                f"config.json: text_config.o_groups={o_groups} must divide num_attention_heads={num_heads}"
            )
        index_head_dim = t.positive("index_head_dim")
        if index_head_dim < rope_head_dim:
            raise ValueError(
                f"config.json: text_config.index_head_dim={index_head_dim} is smaller than the RoPE channels "
                f"({rope_head_dim}) applied to it"
            )
        index_topk = t.positive("index_topk")
        kv_source = _source_map(t, "kv_source_layer_ids", num_layers)
        index_source = _source_map(t, "index_source_layer_ids", num_layers)
        index_k_key = (
            "index_k_source_layer_ids"
            if text.get("index_k_source_layer_ids") is not None
            else "kv_source_layer_ids"
        )
        index_k_source = _source_map(t, index_k_key, num_layers)
        maps = {
            "kv_source_layer_ids": kv_source,
            "index_source_layer_ids": index_source,
            index_k_key: index_k_source,
        }
        _check_sharing(maps, backbone)
        _check_refines("index_source_layer_ids", index_source, index_k_key, index_k_source)
        _check_refines(index_k_key, index_k_source, "kv_source_layer_ids", kv_source)
        if boundary is not None and kv_source[boundary] != boundary:
            raise ValueError(
                f"config.json: text_config.kv_source_layer_ids must include the YoCo boundary layer {boundary} "
                "(the first C1 layer): KV sharing may not cross it"
            )
        hc_mult = t.positive("hc_mult")
        moe = _moe(t, "n_routed_experts", "num_experts_per_tok")
        for key, expected in _FIXED_MOE.items():
            if t.required(key) != expected:
                raise ValueError(
                    f"config.json: text_config.{key}={t.get(key)!r} is not supported (expected {expected!r})"
                )
        engram = _engram(t, num_layers, hc_mult)
        quant = raw["quantization_config"]
        return cls(
            vocab_size=t.positive("vocab_size"),
            hidden_size=t.positive("hidden_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            rope_head_dim=rope_head_dim,
            q_lora_rank=t.positive("q_lora_rank"),
            o_groups=o_groups,
            o_lora_rank=t.positive("o_lora_rank"),
            sliding_window=t.positive("sliding_window"),
            compress_ratios=backbone,
            yoco_boundary=boundary,
            kv_source=kv_source,
            index_source=index_source,
            index_k_source=index_k_source,
            candidate=_candidate(t, backbone, index_source, index_topk),
            index_n_heads=t.positive("index_n_heads"),
            index_head_dim=index_head_dim,
            index_topk=index_topk,
            hc_mult=hc_mult,
            hc_shifted=t.boolean("hc_shifted", True),
            hc_sinkhorn_iters=t.positive("hc_sinkhorn_iters"),
            hc_eps=t.positive_number("hc_eps"),
            moe=moe,
            swiglu_limit=t.positive_number("swiglu_limit"),
            rms_norm_eps=t.positive_number("rms_norm_eps"),
            rope_theta=t.positive_number("rope_theta"),
            compress_rope_theta=t.positive_number("compress_rope_theta"),
            yarn=_yarn(t),
            max_position_embeddings=t.positive("max_position_embeddings"),
            tie_word_embeddings=t.boolean("tie_word_embeddings"),
            use_fp4_sparse_kv=t.boolean("use_fp4_sparse_kv", True),
            dspark=_dspark(t, raw, num_dspark, num_layers),
            engram=engram,
            vision=_vision(vision),
            bos_token_id=_Reader(raw, "").integer("bos_token_id", minimum=0),
            eos_token_id=_Reader(raw, "").integer("eos_token_id", minimum=0),
            fp8_block=(int(quant["weight_block_size"][0]), int(quant["weight_block_size"][1])),
        )


class _Reader:
    """Typed reads of one section; every error names `section.key`."""

    def __init__(self, section: dict[str, Any], name: str) -> None:
        self.section = section
        self.prefix = f"{name}." if name else ""

    def name(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str, default: Any = None) -> Any:
        return self.section.get(key, default)

    def required(self, key: str, default: Any = None) -> Any:
        value = self.section.get(key, default)
        if value is None:
            raise ValueError(f"config.json: {self.name(key)} is required for DeepSeek-V4.1")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int | None = None) -> int:
        value = self.required(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config.json: {self.name(key)} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"config.json: {self.name(key)}={value} must be at least {minimum}")
        return value

    def positive(self, key: str, default: int | None = None) -> int:
        return self.integer(key, default, minimum=1)

    def number(self, key: str, default: float | None = None) -> float:
        value = self.required(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"config.json: {self.name(key)} must be a number, got {value!r}")
        return float(value)

    def positive_number(self, key: str, default: float | None = None) -> float:
        value = self.number(key, default)
        if not value > 0:
            raise ValueError(f"config.json: {self.name(key)}={value} must be positive")
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool:
        value = self.required(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"config.json: {self.name(key)} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.required(key)
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ValueError(f"config.json: {self.name(key)} must be a list of integers, got {value!r}")
        return tuple(value)

    def layer_ids(self, key: str, num_layers: int) -> tuple[int, ...]:
        ids = self.int_list(key)
        if not ids:
            raise ValueError(f"config.json: {self.name(key)} must name at least one layer")
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"config.json: {self.name(key)} has {bad}, outside the backbone layers 0..{num_layers - 1}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"config.json: {self.name(key)} repeats a layer: {list(ids)}")
        return ids


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"config.json: {key} is required for DeepSeek-V4.1 and must be an object")
    return value


def _check_top_level(raw: dict[str, Any]) -> None:
    if not isinstance(raw, dict):
        raise ValueError("config.json: must be a JSON object")
    architectures = raw.get("architectures")
    if architectures != [ARCHITECTURE]:
        raise ValueError(f"config.json: architectures={architectures!r} must be [{ARCHITECTURE!r}]")
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json: model_type={raw.get('model_type')!r} must be {MODEL_TYPE!r}")
    if raw.get("dtype") != "bfloat16":
        raise ValueError(f"config.json: dtype={raw.get('dtype')!r} is not supported (expected 'bfloat16')")
    quant = raw.get("quantization_config")
    if not isinstance(quant, dict):
        raise ValueError(
            "config.json: quantization_config is required for DeepSeek-V4.1 and must be an object"
        )
    for key, expected in _FIXED_QUANT.items():
        if quant.get(key) != expected:
            raise ValueError(
                f"config.json: quantization_config.{key}={quant.get(key)!r} is not supported (expected {expected!r})"
            )


def _compress_ratios(t: _Reader, num_layers: int, num_dspark: int) -> tuple[int, ...]:
    ratios = t.int_list("compress_ratios")
    if len(ratios) != num_layers + num_dspark:
        raise ValueError(
            f"config.json: text_config.compress_ratios has {len(ratios)} entries; it needs one per backbone "
            f"and DSpark layer: num_hidden_layers + num_nextn_predict_layers = {num_layers + num_dspark}"
        )
    bad = sorted({r for r in ratios if r not in COMPRESS_RATIOS})
    if bad:
        raise ValueError(
            f"config.json: text_config.compress_ratios has {bad}; DeepSeek-V4.1 compresses by 0 (sliding window "
            "only), 1 (C1) or 2 (C2); V4's rates 4 and 128 are not V4.1's"
        )
    return ratios


def _yoco_boundary(ratios: tuple[int, ...], num_layers: int) -> int | None:
    boundary = next((i for i, r in enumerate(ratios) if r == C1), None)
    if boundary is None:
        raise ValueError(
            "config.json: text_config.compress_ratios has no C1 layer (ratio 1); the first one is the YoCo boundary"
        )
    return boundary if boundary < num_layers else None


def _source_map(t: _Reader, key: str, num_layers: int) -> tuple[int, ...]:
    """Each layer from the first source on reads from the nearest source at or before it."""
    sources = sorted(t.layer_ids(key, num_layers))
    mapping = list(range(num_layers))
    for layer in range(sources[0], num_layers):
        mapping[layer] = max(s for s in sources if s <= layer)
    return tuple(mapping)


def _check_sharing(maps: dict[str, tuple[int, ...]], ratios: tuple[int, ...]) -> None:
    for key, mapping in maps.items():
        for layer, source in enumerate(mapping):
            if source == layer:
                continue
            if ratios[layer] == SLIDING:
                raise ValueError(
                    f"config.json: text_config.{key} makes sliding-window layer {layer} share layer {source}'s "
                    "state; only compressed layers can (add it as a source)"
                )
            if ratios[layer] != ratios[source]:
                raise ValueError(
                    f"config.json: text_config.{key}: layer {layer} (compress ratio {ratios[layer]}) cannot share "
                    f"layer {source}'s (compress ratio {ratios[source]})"
                )


def _check_refines(fine_key: str, fine: tuple[int, ...], coarse_key: str, coarse: tuple[int, ...]) -> None:
    """Every segment of `fine` lies inside one segment of `coarse`."""
    for layer, source in enumerate(fine):
        if coarse[source] != coarse[layer]:
            raise ValueError(
                f"config.json: text_config.{fine_key} must refine text_config.{coarse_key}: layer {layer} takes it from layer "
                f"{source}, which reads {coarse_key} from layer {coarse[source]}, not {coarse[layer]}"
            )


def _candidate(
    t: _Reader, ratios: tuple[int, ...], index_source: tuple[int, ...], index_topk: int
) -> CandidateBlocks | None:
    if "candidate_source_layer_id" not in t.section:
        raise ValueError(
            "config.json: text_config.candidate_source_layer_id is required (null: no candidate blocks)"
        )
    if t.get("candidate_source_layer_id") is None:
        return None
    source = t.integer("candidate_source_layer_id", minimum=0)
    num_layers = len(ratios)
    if source >= num_layers:
        raise ValueError(
            f"config.json: text_config.candidate_source_layer_id={source} is outside the backbone layers 0..{num_layers - 1}"
        )
    if ratios[source] == SLIDING or index_source[source] != source:
        raise ValueError(
            f"config.json: text_config.candidate_source_layer_id={source} must be a compressed layer that runs its "
            "own indexer (one of index_source_layer_ids)"
        )
    topk_blocks = t.positive("candidate_topk_blocks")
    if topk_blocks % CANDIDATE_TOPK_MULTIPLE:
        raise ValueError(
            f"config.json: text_config.candidate_topk_blocks={topk_blocks} must be a multiple of {CANDIDATE_TOPK_MULTIPLE}"
        )
    block_size = t.positive("candidate_block_size")
    if block_size > CANDIDATE_MAX_BLOCK_SIZE:
        raise ValueError(
            f"config.json: text_config.candidate_block_size={block_size} must be at most {CANDIDATE_MAX_BLOCK_SIZE}"
        )
    for layer in range(source + 1, num_layers):
        if ratios[layer] != ratios[source]:
            raise ValueError(
                f"config.json: text_config.candidate_source_layer_id={source}: every later layer picks its top-k "
                f"inside its candidate blocks, but layer {layer} has compress ratio {ratios[layer]}, not {ratios[source]}"
            )
    if topk_blocks * block_size < index_topk:
        raise ValueError(
            f"config.json: text_config.candidate_topk_blocks={topk_blocks} x candidate_block_size={block_size} "
            f"holds fewer entries than index_topk={index_topk}"
        )
    return CandidateBlocks(source, topk_blocks, block_size)


def _check_moe(moe: MoeSpec, experts_key: str, top_k_key: str) -> None:
    if moe.top_k > moe.num_experts:
        raise ValueError(
            f"config.json: text_config.{top_k_key}={moe.top_k} must be at most {experts_key}={moe.num_experts}"
        )


def _yarn(t: _Reader) -> YarnSpec | None:
    scaling = t.get("rope_scaling")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json: text_config.rope_scaling must be an object, got {scaling!r}")
    s = _Reader(scaling, "text_config.rope_scaling")
    return YarnSpec(
        factor=s.positive_number("factor"),
        original_max_position_embeddings=s.positive("original_max_position_embeddings"),
        beta_fast=s.number("beta_fast"),
        beta_slow=s.number("beta_slow"),
    )


def _moe(t: _Reader, experts_key: str, top_k_key: str) -> MoeSpec:
    """A MoE's keys (the backbone's, or DSpark's own expert count and top-k), checked."""
    moe = MoeSpec(
        num_experts=t.positive(experts_key),
        top_k=t.positive(top_k_key),
        num_shared_experts=t.integer("n_shared_experts", minimum=0),
        intermediate_size=t.positive("moe_intermediate_size"),
        routed_scaling_factor=t.number("routed_scaling_factor"),
    )
    _check_moe(moe, experts_key, top_k_key)
    return moe


def _dspark(t: _Reader, raw: dict[str, Any], num_layers: int, num_backbone: int) -> DSparkSpec:
    moe = _moe(t, "dspark_n_routed_experts", "dspark_num_experts_per_tok")
    if not t.boolean("dspark_target_attn_input", True):
        raise ValueError(
            "config.json: text_config.dspark_target_attn_input=false is not supported: DSpark drafts from the "
            "target layers' attention inputs"
        )
    return DSparkSpec(
        num_layers=num_layers,
        block_size=t.positive("dspark_block_size"),
        target_layer_ids=t.layer_ids("dspark_target_layer_ids", num_backbone),
        markov_rank=t.positive("dspark_markov_rank"),
        noise_token_id=t.integer("dspark_noise_token_id", minimum=0),
        pad_token_id=_Reader(raw, "").integer("pad_token_id", minimum=0),
        moe=moe,
    )


def _engram(t: _Reader, num_layers: int, hc_mult: int) -> EngramSpec | None:
    if not t.get("engram_layer_ids"):
        return None
    layer_ids = t.layer_ids("engram_layer_ids", num_layers)
    if hc_mult < 2:
        raise ValueError(f"config.json: text_config.hc_mult={hc_mult}: Engram layers need at least 2 streams")
    max_ngram = t.integer("engram_max_ngram_size", minimum=2)
    vocab = t.integer("engram_vocab_size", minimum=2)
    heads = t.positive("engram_n_heads")
    compressed = t.get("engram_compressed_vocab_size")
    if compressed is not None:
        compressed = t.integer("engram_compressed_vocab_size", minimum=0) or None
    return EngramSpec(
        layer_ids=layer_ids,
        max_ngram_size=max_ngram,
        vocab_size=vocab,
        num_heads=heads,
        head_dim=t.positive("engram_head_dim"),
        pad_token_id=t.integer("engram_pad_token_id", minimum=0),
        compressed_vocab_size=compressed,
        table_sizes=engram_table_sizes(len(layer_ids), max_ngram - 1, heads, vocab),
    )


def engram_table_sizes(
    num_layers: int, num_tables: int, num_heads: int, vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Row counts of every head's hashed table: in layer, table, head order, the first prime at
    or above vocab_size, then each next prime above the previous head's, never one already used
    by any layer (distinct moduli keep the heads' hashes independent)."""
    used: set[int] = set()
    layers = []
    for _ in range(num_layers):
        tables = []
        for _ in range(num_tables):
            start = vocab_size - 1
            sizes = []
            for _ in range(num_heads):
                prime = next_prime(start)
                while prime in used:
                    prime = next_prime(prime)
                used.add(prime)
                sizes.append(prime)
                start = prime
            tables.append(tuple(sizes))
        layers.append(tuple(tables))
    return tuple(layers)


def next_prime(n: int) -> int:
    """The smallest prime greater than n."""
    candidate = max(n + 1, 2)
    while not _is_prime(candidate):
        candidate += 1
    return candidate


_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # decide every n < 3.3e24


def _is_prime(n: int) -> bool:
    """Miller-Rabin with a fixed witness set (exact in the range table sizes live in)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _vision(vision: dict[str, Any]) -> VisionSpec:
    """DeepSeek's engine reads only the widths and the patch geometry from vision_config and fixes
    the rest of its ViT in code (32 blocks, 16 heads, a SwiGLU of 2.7 x the width rounded up to a
    multiple of 128); those are the defaults of the optional keys here, so that tiny test towers
    can be smaller."""
    v = _Reader(vision, "vision_config")
    hidden = v.positive("hidden_size")
    patch = v.positive("patch_size")
    if patch != VISION_PATCH_SIZE:
        raise ValueError(
            f"config.json: vision_config.patch_size={patch} is not supported (DeepSeek's ViT takes "
            f"{VISION_PATCH_SIZE}-pixel patches)"
        )
    heads = v.positive("num_attention_heads", VISION_HEADS)
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(
            f"config.json: vision_config.num_attention_heads={heads} must split hidden_size={hidden} into heads "
            "of a multiple of 4 channels (2-D RoPE rotates channel pairs, half by row and half by column)"
        )
    default_mlp = -(-int(hidden * VISION_MLP_RATIO) // VISION_MLP_MULTIPLE) * VISION_MLP_MULTIPLE
    return VisionSpec(
        hidden_size=hidden,
        downsample_ratio=v.positive("downsample_ratio"),
        patch_size=patch,
        num_layers=v.positive("num_hidden_layers", VISION_LAYERS),
        num_heads=heads,
        intermediate_size=v.positive("intermediate_size", default_mlp),
    )


def rope_specs(arch: DeepseekV41Arch) -> tuple[RopeSpec, RopeSpec]:
    """(sliding-only layers, compressed layers): plain RoPE at rope_theta; compress_rope_theta
    with YaRN when the config scales, without magnitude correction (DeepSeek's mscale off)."""
    yarn = None
    if arch.yarn is not None:
        yarn = {
            "factor": arch.yarn.factor,
            "original_max_position_embeddings": arch.yarn.original_max_position_embeddings,
            "beta_fast": arch.yarn.beta_fast,
            "beta_slow": arch.yarn.beta_slow,
            "truncate": True,
            "attention_factor": 1.0,
        }
    return RopeSpec(arch.rope_theta, None), RopeSpec(arch.compress_rope_theta, yarn)
