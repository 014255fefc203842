"""DeepSeek-V4.1's vision encoder on tiny random weights: against the formulas written out here,
against DeepSeek's own ViT, projector, merge, patch and layout code run on CPU, loaded from the
tiny checkpoint (every broken vision tensor named), token counts, and batching."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
import tarfile
import types
import zipfile
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_weights import expected_vision_tensors, load_v41_weights
from deepinfer.model.deepseek_v4.vision import SPECIAL_EMBEDDINGS, VisionEncoderV41, image_token_count
from deepinfer.model.deepseek_v4.vision_projector import merge_patches
from deepinfer.model.deepseek_v4.vision_vit import PatchGrid, patch_positions, patchify
from tests.deepseek_v41.reference import ENGINE_SDIST, TILE_KERNELS_WHEEL, reference_file
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41, tiny_config, write_checkpoint

ARCH = DeepseekV41Arch.from_raw(tiny_config())
SPEC = ARCH.vision  # width 48, 4 heads of 12, 2 blocks, SwiGLU 64, patch 14, 2 x 2 merge
P = SPEC.patch_size
GRIDS = [PatchGrid(3, 5), PatchGrid(4, 4), PatchGrid(1, 3)]  # ragged, even, one row


def _random_state(seed: int) -> dict[str, torch.Tensor]:
    """HF names -> float32: norms near 1, matrices scaled by their fan-in, so no layer fades."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {name: spec.shape for name, spec in expected_vision_tensors(ARCH).items()}
    shapes |= dict.fromkeys(SPECIAL_EMBEDDINGS, (ARCH.hidden_size,))
    state = {}
    for name, shape in shapes.items():
        if "norm" in name:
            state[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            state[name] = 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return state


def _encoder(state: dict[str, torch.Tensor], spec=SPEC) -> VisionEncoderV41:
    encoder = VisionEncoderV41(spec, ARCH.hidden_size)
    encoder.load_state_dict(state, strict=True)
    return encoder.requires_grad_(False)


def _images(grids: list[PatchGrid], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(3, g.rows * P, g.cols * P, generator=gen) * 2 - 1 for g in grids]


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return _random_state(0)


# ---------------------------------------------------------------- (1) the formulas, written out


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight


def _rotate(x: torch.Tensor, positions: list[tuple[int, int]]) -> torch.Tensor:
    """Channel j (< head_dim / 2) turns with j + head_dim / 2: by the row for the first quarter
    of the head, by the column for the second, pair m of a quarter at 10000^(-4m / head_dim)."""
    head_dim = x.shape[-1]
    half, quarter = head_dim // 2, head_dim // 4
    out = x.clone()
    for j in range(half):
        axis, m = divmod(j, quarter)
        angle = torch.tensor([pos[axis] for pos in positions], dtype=torch.float64) * 10000.0 ** (
            -4 * m / head_dim
        )
        cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
        a, b = x[..., j], x[..., j + half]
        out[..., j], out[..., j + half] = a * cos - b * sin, a * sin + b * cos
    return out


def _dense(state: dict[str, torch.Tensor], image: torch.Tensor) -> torch.Tensor:
    """One image, every step spelled out: [tokens, hidden]."""
    s, width, heads, d = state, SPEC.hidden_size, SPEC.num_heads, SPEC.downsample_ratio
    rows, cols = image.shape[1] // P, image.shape[2] // P
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    x = torch.stack([image[:, r * P : (r + 1) * P, c * P : (c + 1) * P].reshape(-1) for r, c in cells])
    x = torch.einsum("ni,oi->no", x, s["vision.patch_embed.proj.weight"]) + s["vision.patch_embed.proj.bias"]
    for i in range(SPEC.num_layers):
        b = f"vision.blocks.{i}."
        h = _rms(x, s[b + "norm1.weight"])
        qkv = torch.einsum("ni,oi->no", h, s[b + "attn.wqkv.weight"]) + s[b + "attn.wqkv.bias"]
        q, k, v = (qkv[:, j * width : (j + 1) * width].reshape(len(cells), heads, -1) for j in range(3))
        q, k = _rotate(q, cells), _rotate(k, cells)
        scores = torch.einsum("qhc,khc->hqk", q, k) / math.sqrt(width // heads)
        o = torch.einsum("hqk,khc->qhc", scores.softmax(-1), v).reshape(len(cells), width)
        x = x + torch.einsum("ni,oi->no", o, s[b + "attn.wo.weight"]) + s[b + "attn.wo.bias"]
        g = torch.einsum("ni,oi->no", _rms(x, s[b + "norm2.weight"]), s[b + "mlp.w1.weight"])
        gate, up = g[:, : SPEC.intermediate_size], g[:, SPEC.intermediate_size :]
        x = x + torch.einsum("ni,oi->no", gate * torch.sigmoid(gate) * up, s[b + "mlp.w2.weight"])
    x = _rms(x, s["vision.norm.weight"])
    merged_rows, merged_cols = -(-rows // d), -(-cols // d)
    tokens = []
    for br in range(merged_rows):
        for bc in range(merged_cols):
            block = torch.zeros(width, d, d)  # cells past the image's edge stay zero
            for i in range(d):
                for j in range(d):
                    r, c = br * d + i, bc * d + j
                    if r < rows and c < cols:
                        block[:, i, j] = x[r * cols + c]
            tokens.append(block.reshape(-1))
    t = torch.einsum("ni,oi->no", torch.stack(tokens), s["aligner.w1.weight"]) + s["aligner.w1.bias"]
    t = 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))
    t = torch.einsum("ni,oi->no", t, s["aligner.w2.weight"]) + s["aligner.w2.bias"]
    seq = [s["image_start"]]
    for br in range(merged_rows):
        seq += [t[br * merged_cols + bc] for bc in range(merged_cols)] + [s["image_newline"]]
    return torch.stack([*seq, s["image_end"]])


def test_encoder_equals_the_formulas_written_out(state):
    images = _images(GRIDS, 1)
    got = _encoder(state)(images)
    expected = torch.cat([_dense(state, image) for image in images])
    assert got.shape == expected.shape == (sum(image_token_count(g, 2) for g in GRIDS), ARCH.hidden_size)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- (2) DeepSeek's own code

_ENGINE = "deepinfer-0.1.0/deepinfer/"
_VIT = _ENGINE + "model_executor/models/vision_encoder/vit.py"
_PROJECTOR = _ENGINE + "model_executor/models/vision_encoder/mlp_projector.py"
_EMBED_OPS = _ENGINE + "model_executor/layers/tilelang_ops/image_embed_ops.py"
_NORM = _ENGINE + "model_executor/layers/tilelang_ops/norm.py"
_NAMES = _ENGINE + "hugging_face/names.py"
_PROCESSOR = _ENGINE + "ve/processor/image_processor.py"
_TOKENS = _ENGINE + "multimodal_tokens.py"
_ROPE, _SWIGLU = "tile_kernels/torch/rope.py", "tile_kernels/torch/swiglu.py"
_VIT_CONSTANTS = (
    "PATCH_SIZE",
    "EMBED_DIM",
    "DEPTH",
    "NUM_HEADS",
    "MLP_RATIO",
    "MULTIPLE_OF",
    "MAX_GRID_SIZE",
)


class _OnCpu(ast.NodeTransformer):
    """DeepSeek's rotary table is built on "cuda"; here it is built on the CPU."""

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.copy_location(ast.Constant("cpu"), node) if node.value == "cuda" else node


def _compile(source: Path, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The named top-level functions, classes and assignments of one file, and nothing else
    (its imports pull in GPU kernel languages that are not installed here)."""
    body = [node for node in ast.parse(source.read_text()).body if _defined(node) in names]
    assert {_defined(node) for node in body} == names, source
    # Lazy annotations: they name modules that are not here.
    lazy = ast.parse("from __future__ import annotations").body
    module = ast.fix_missing_locations(_OnCpu().visit(ast.Module(body=lazy + body, type_ignores=[])))
    exec(compile(module, str(source), "exec", dont_inherit=True), namespace)
    return namespace


def _defined(node: ast.stmt) -> str | None:
    """The name a top-level function, class or single-name assignment defines."""
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _flash_attn(q, k, v, cu_seqlens_q, softmax_scale, causal, **_):
    """Varlen attention as flash-attn computes it: each segment attends to itself."""
    assert softmax_scale is None and not causal
    out, bounds = torch.empty_like(q), cu_seqlens_q.tolist()
    for start, end in itertools.pairwise(bounds):
        scores = torch.einsum("qhc,khc->hqk", q[start:end], k[start:end]) / math.sqrt(q.shape[-1])
        out[start:end] = torch.einsum("hqk,khc->qhc", scores.softmax(-1), v[start:end])
    return (out,)


class _AttrDict(dict):
    __getattr__ = dict.__getitem__


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> types.SimpleNamespace:
    root = tmp_path_factory.mktemp("v41_vision_reference")
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        for name in (_VIT, _PROJECTOR, _EMBED_OPS, _NORM, _NAMES, _PROCESSOR, _TOKENS):
            tar.extract(name, root, filter="data")
    with zipfile.ZipFile(reference_file(TILE_KERNELS_WHEEL)) as wheel:
        wheel.extract(_ROPE, root)
        wheel.extract(_SWIGLU, root)
    rope = _compile(root / _ROPE, {"rotary_embedding_ref"}, {"torch": torch})["rotary_embedding_ref"]
    swiglu = _compile(root / _SWIGLU, {"swiglu_forward"}, {"torch": torch})["swiglu_forward"]
    norm = _compile(root / _NORM, {"norm_ref"}, {"torch": torch})["norm_ref"]

    def apply_rotary(q, cos_sin, k, interleaved):  # TileKernels' in-place kernel, by its reference
        cos, sin = cos_sin.chunk(2, dim=-1)
        for x in (q, k):
            x.copy_(rope(x, cos, sin, interleaved=interleaved))

    vit = _compile(
        root / _VIT,
        {"NORM_EPS", *_VIT_CONSTANTS, "_linear", "_norm", "RMSNorm", "PatchEmbedFlatten"}
        | {"VisionRotaryEmbedding", "Attention", "SwiGLU", "Block", "VisionTransformer"},
        {
            "torch": torch,
            "F": F,
            "nn": torch.nn,
            "Any": Any,
            "norm": norm,
            "apply_rotary": apply_rotary,
            "_flash_attn_fwd": _flash_attn,
            "swiglu_forward": lambda x, fmt: swiglu(x),
            "dtype_to_str": str,
            "deep_gemm": types.SimpleNamespace(cublaslt_gemm_nt=lambda x, w, out, _: out.copy_(x @ w.T)),
            "is_sm_major_10": lambda: False,
            "accelerator_kind": lambda: "cuda",
            "cpu_timer": types.SimpleNamespace(record=lambda _: lambda f: f),
        },
    )
    tokens = _compile(root / _TOKENS, {"TokenType"}, {"IntEnum": IntEnum})["TokenType"]
    processor = _compile(
        root / _PROCESSOR,
        {"ImageLayout", "expanded_image_token_len", "downsampled_seqlens", "_layout_from_pixels"}
        | {"solve_resize_ratio", "safe_resize", "compute_image_layout", "_load_image_anyres_cache"}
        | {"load_image_anyres"},
        {"torch": torch, "math": math, "NamedTuple": NamedTuple, "TokenType": tokens},
    )
    ops = _compile(
        root / _EMBED_OPS,
        {"batch_downsample_ref", "rgb_pad_to_patches_ref", "replace_input_embeds_ref"},
        {"torch": torch, "F": F},
    )
    names = _compile(root / _NAMES, {"_VISION_PREFIX", "_VISION_RENAME", "_vision_to_model"}, {})
    projector = _compile(root / _PROJECTOR, {"MlpProjector"}, {"nn": torch.nn, "AttrDict": _AttrDict})
    return types.SimpleNamespace(
        vit=vit,
        vit_defaults={k: vit[k] for k in _VIT_CONSTANTS},
        projector=projector["MlpProjector"],
        tokens=tokens,
        load_image_anyres=processor["load_image_anyres"],
        ops=ops,
        to_model=names["_vision_to_model"],
    )


def _deepseek_tower(
    deepseek, arch: DeepseekV41Arch, **constants: Any
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """DeepSeek's ViT (its file's constants, some replaced) and projector for this arch."""
    deepseek.vit |= deepseek.vit_defaults | constants
    vit = deepseek.vit["VisionTransformer"](recomputing_every_layer=2)  # also the unfused residual path
    cfg = _AttrDict(
        projector_type="downsample_mlp_gelu",
        input_dim=arch.vision.hidden_size,
        hidden_size=arch.hidden_size,
        depth=2,
        downsample_ratio=arch.vision.downsample_ratio,
    )
    return vit, deepseek.projector(cfg)


_TOWER_PREFIXES = ("vision_pipeline.aligner.visual_encoder.", "vision_pipeline.aligner.aligner.")


def _deepseek_modules(deepseek, state: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """DeepSeek's ViT and projector at the tiny sizes, loaded through DeepSeek's name map."""
    # Its SwiGLU width rule, round_up(int(width * ratio), multiple), made to give 64.
    vit, projector = _deepseek_tower(
        deepseek,
        ARCH,
        EMBED_DIM=SPEC.hidden_size,
        DEPTH=SPEC.num_layers,
        NUM_HEADS=SPEC.num_heads,
        MLP_RATIO=1.0,
        MULTIPLE_OF=SPEC.intermediate_size,
        MAX_GRID_SIZE=16,
    )
    mapped = {deepseek.to_model(name): t for name, t in state.items() if name not in SPECIAL_EMBEDDINGS}
    for module, prefix in zip((vit, projector), _TOWER_PREFIXES, strict=True):
        module.load_state_dict(
            {n.removeprefix(prefix): t for n, t in mapped.items() if n.startswith(prefix)}, strict=True
        )
    return vit, projector


def _deepseek_embed(deepseek, state, pixels: list[torch.Tensor]) -> torch.Tensor:
    """DeepSeek's path for RGB images [H, W, 3] uint8 already at their patch-aligned size:
    processor geometry, patches, ViT, merge, projector, token layout."""
    vit, projector = _deepseek_modules(deepseek, state)
    ratio, tt = SPEC.downsample_ratio, deepseek.tokens
    layouts = [deepseek.load_image_anyres((p.shape[1], p.shape[0]), P, ratio, 10_000) for p in pixels]
    crops = torch.cat([layout[3] for layout in layouts])  # [images, 2] (cols, rows)
    cu_patches = F.pad((crops[:, 0] * crops[:, 1]).cumsum(0), (1, 0)).int()
    cu_bytes = F.pad(torch.tensor([p.numel() for p in pixels]).cumsum(0), (1, 0))
    sizes = torch.tensor([(p.shape[1], p.shape[0]) for p in pixels])
    raw = torch.cat([p.reshape(-1) for p in pixels])
    patches = deepseek.ops["rgb_pad_to_patches_ref"](
        raw, cu_bytes, sizes, crops, cu_patches, int(cu_patches[-1]), P, 0.5, 0.5, 127
    )
    positions = torch.cat([layout[4] for layout in layouts])
    features = vit(patches.float(), positions, cu_patches, int((cu_patches[1:] - cu_patches[:-1]).max()))
    merged = deepseek.ops["batch_downsample_ref"](features, crops, ratio, "downsample_mlp_gelu")
    image_embeds = projector.layers(merged)
    token_types = torch.cat([layout[5] for layout in layouts])
    out = torch.zeros(len(token_types), ARCH.hidden_size)
    specials = [tt.IMAGE_NEW_LINE, tt.IMAGE_START, tt.IMAGE_END]
    special_embeds = torch.stack([state["image_newline"], state["image_start"], state["image_end"]])
    deepseek.ops["replace_input_embeds_ref"](
        out, token_types, image_embeds, tt.IMAGE, torch.tensor(specials), special_embeds
    )
    return out


def _normalise(pixels: torch.Tensor) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, H, W]: DeepSeek's mean = std = 0.5, rounded to bfloat16 as its
    patches are."""
    return ((pixels.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5).to(torch.bfloat16).float()


def _pixels(grids: list[PatchGrid], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (g.rows * P, g.cols * P, 3), generator=gen, dtype=torch.uint8) for g in grids
    ]


def test_encoder_equals_deepseeks_pipeline(deepseek, state):
    pixels = _pixels(GRIDS, 2)
    with torch.no_grad():
        expected = _deepseek_embed(deepseek, state, pixels)
    got = _encoder(state)([_normalise(p) for p in pixels])
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_patches_and_positions_are_deepseeks(deepseek):
    pixels = _pixels([PatchGrid(2, 3)], 3)[0]
    raw, size = pixels.reshape(-1), torch.tensor([[3 * P, 2 * P]])
    theirs = deepseek.ops["rgb_pad_to_patches_ref"](
        raw,
        torch.tensor([0, raw.numel()]),
        size,
        torch.tensor([[3, 2]]),
        torch.tensor([0, 6]),
        6,
        P,
        0.5,
        0.5,
        127,
    )
    ours, grid = patchify(_normalise(pixels), P)
    assert grid == PatchGrid(2, 3) and torch.equal(ours, theirs.float())
    for rows, cols in ((2, 3), (4, 1), (3, 3)):
        layout = deepseek.load_image_anyres((cols * P, rows * P), P, 2, 10_000)
        assert torch.equal(layout[3], torch.tensor([[cols, rows]]))
        assert torch.equal(patch_positions(PatchGrid(rows, cols)), layout[4])


@pytest.mark.parametrize("ratio", [2, 3])
def test_merge_equals_deepseeks_downsample(deepseek, ratio):
    grids = [PatchGrid(5, 7), PatchGrid(3, 3), PatchGrid(1, 4), PatchGrid(6, 2)]
    features = torch.randn(sum(g.patches for g in grids), 8, generator=torch.Generator().manual_seed(ratio))
    crops = torch.tensor([[g.cols, g.rows] for g in grids])
    expected = deepseek.ops["batch_downsample_ref"](features, crops, ratio, "downsample_mlp_gelu")
    got = torch.cat(
        [
            merge_patches(f, g, ratio)
            for f, g in zip(features.split([g.patches for g in grids]), grids, strict=True)
        ]
    )
    assert torch.equal(got, expected)


def test_default_tower_is_deepseeks(deepseek):
    """vision_config without the optional keys gives the ViT DeepSeek fixes in code, and at that
    full size every checkpoint name maps onto its modules' parameters with the same shape."""
    defaults = deepseek.vit_defaults
    raw = tiny_config(hidden_size=4096)
    raw["vision_config"] = {"hidden_size": defaults["EMBED_DIM"], "downsample_ratio": 2, "patch_size": 14}
    arch = DeepseekV41Arch.from_raw(raw)
    spec = arch.vision
    assert (spec.num_layers, spec.num_heads, spec.patch_size, spec.intermediate_size) == (
        defaults["DEPTH"],
        defaults["NUM_HEADS"],
        defaults["PATCH_SIZE"],
        2816,  # round_up(int(1024 * 2.7), 128)
    )
    with torch.device("meta"):
        modules = _deepseek_tower(deepseek, arch)
        ours = VisionEncoderV41(spec, arch.hidden_size)
    theirs = {
        prefix + name: tuple(t.shape)
        for module, prefix in zip(modules, _TOWER_PREFIXES, strict=True)
        for name, t in module.state_dict().items()
    }
    expected = expected_vision_tensors(arch)
    assert {deepseek.to_model(name): spec.shape for name, spec in expected.items()} == theirs
    own = {name: tuple(t.shape) for name, t in ours.state_dict().items() if name not in SPECIAL_EMBEDDINGS}
    assert own == {name: spec.shape for name, spec in expected.items()}


# ---------------------------------------------------------------- (3) from the checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyV41:
    return build_v41(tmp_path_factory.mktemp("v41_vision_tiny"), tiny_config(), seed=1)


def test_encoder_loads_from_the_tiny_checkpoint(tiny):
    weights = load_v41_weights(tiny.path, ARCH)
    encoder = VisionEncoderV41.from_weights(ARCH, weights)
    names = set(expected_vision_tensors(ARCH)) | set(SPECIAL_EMBEDDINGS)
    assert set(encoder.state_dict()) == names
    assert all(torch.equal(t, tiny.values[n]) for n, t in encoder.state_dict().items())
    images = _images([PatchGrid(2, 3)], 4)
    assert torch.equal(encoder(images), _encoder({n: tiny.values[n] for n in names})(images))
    text_only = dataclasses.replace(weights, vision={})
    with pytest.raises(ValueError, match="no vision tower"):
        VisionEncoderV41.from_weights(ARCH, text_only)


BF16 = torch.bfloat16
BROKEN = [
    (
        "missing",
        lambda s: s.pop("vision.blocks.1.mlp.w2.weight"),
        r"vision tensors missing.*vision\.blocks\.1\.mlp\.w2\.weight",
    ),
    ("missing bias", lambda s: s.pop("aligner.w2.bias"), r"missing.*aligner\.w2\.bias"),
    (
        "merge width",
        lambda s: s.__setitem__("aligner.w1.weight", torch.zeros(64, 48 * 9, dtype=BF16)),
        r"aligner\.w1\.weight: shape \(64, 432\), expected \(64, 192\)",
    ),
    (
        "patch size",
        lambda s: s.__setitem__("vision.patch_embed.proj.weight", torch.zeros(48, 3 * 16 * 16, dtype=BF16)),
        r"vision\.patch_embed\.proj\.weight: shape \(48, 768\)",
    ),
    (
        "SwiGLU width",
        lambda s: s.__setitem__("vision.blocks.0.mlp.w1.weight", torch.zeros(64, 48, dtype=BF16)),
        r"vision\.blocks\.0\.mlp\.w1\.weight: shape \(64, 48\), expected \(128, 48\)",
    ),
    (
        "integer",
        lambda s: s.__setitem__("vision.norm.weight", torch.zeros(48, dtype=torch.int8)),
        r"vision\.norm\.weight: stored as torch\.int8",
    ),
    (
        "extra block",
        lambda s: s.__setitem__("vision.blocks.2.norm1.weight", torch.zeros(48, dtype=BF16)),
        r"unexpected vision.*vision\.blocks\.2\.norm1",
    ),
    (
        "quantized",
        lambda s: s.__setitem__("vision.blocks.0.attn.wqkv.scale", torch.zeros(5, 2, dtype=torch.uint8)),
        r"scales without a quantized weight.*vision\.blocks\.0\.attn\.wqkv\.scale",
    ),
]


@pytest.mark.parametrize(("mutate", "message"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_vision_tensor_is_named(tiny, tmp_path, mutate, message):
    stored = dict(tiny.stored)
    mutate(stored)
    write_checkpoint(tmp_path, tiny.config, stored)
    with pytest.raises(ValueError, match=message):
        load_v41_weights(tmp_path, ARCH)


# ---------------------------------------------------------------- (4) token counts, (5) batches


@pytest.mark.parametrize("ratio", [2, 3])
def test_embeddings_per_image_follow_the_token_count(deepseek, ratio):
    spec = dataclasses.replace(SPEC, downsample_ratio=ratio)
    state = _random_state(5)
    state["aligner.w1.weight"] = torch.randn(ARCH.hidden_size, SPEC.hidden_size * ratio * ratio) * 0.05
    encoder = _encoder(state, spec)
    for grid in (
        PatchGrid(1, 1),
        PatchGrid(2, 3),
        PatchGrid(3, 3),
        PatchGrid(4, 7),
        PatchGrid(7, 4),
        PatchGrid(5, 1),
    ):
        merged_rows, merged_cols = math.ceil(grid.rows / ratio), math.ceil(grid.cols / ratio)
        count = merged_rows * (merged_cols + 1) + 2
        layout = deepseek.load_image_anyres((grid.cols * P, grid.rows * P), P, ratio, 10_000)
        assert image_token_count(grid, ratio) == count == layout[0] == len(layout[5]), grid
        embeddings = encoder(_images([grid], 6))
        assert embeddings.shape == (count, ARCH.hidden_size), grid
        assert torch.equal(embeddings[0], state["image_start"]) and torch.equal(
            embeddings[-1], state["image_end"]
        )
        newlines = [(r + 1) * (merged_cols + 1) for r in range(merged_rows)]  # after each row
        assert all(torch.equal(embeddings[i], state["image_newline"]) for i in newlines), grid


def test_a_batch_of_two_images_equals_each_alone(state):
    encoder = _encoder(state)
    first, second = _images([PatchGrid(3, 5), PatchGrid(4, 4)], 7)
    together = encoder([first, second])
    alone = torch.cat([encoder([first]), encoder([second])])
    assert together.shape == alone.shape
    # Each image goes through the tower alone (vision_vit.py): bits, not a tolerance chosen on one CPU.
    assert torch.equal(together, alone)
    patches = torch.cat([patchify(first, P)[0], patchify(second, P)[0]])
    assert torch.equal(encoder.embed_patches(patches, [PatchGrid(3, 5), PatchGrid(4, 4)]), together)
    with pytest.raises(ValueError, match=r"patches \[31, 3, 14, 14\] do not match 35 patches"):
        encoder.embed_patches(patches, [PatchGrid(3, 5), PatchGrid(4, 5)])
