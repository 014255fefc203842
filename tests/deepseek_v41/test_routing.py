"""V4.1's MoE routing (layers/v4_moe.py's V4Router with its image-token bias `bias_vl`) against
TileKernels' pure-PyTorch gate reference, against DeepSeek's engine's gate_forward (which bias it
hands the gate for which tokens) running on that reference, and against a token-by-token loop
written from the formulas; image tokens choose by bias_vl and text tokens by bias, and the tiny
checkpoint's bias_vl is loaded (target and DSpark) and used by the model."""

from __future__ import annotations

import ast
import math
import tarfile
import types
import zipfile
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.moe import V4Router
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_dspark import DSparkV41
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v4.v41_weights import load_v41_weights
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.reference import ENGINE_SDIST, TILE_KERNELS_WHEEL, reference_file
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41, tiny_config

HIDDEN, EXPERTS, TOP_K, SCALE = 16, 12, 4, 2.5
TOKEN_COUNTS = (0, 1, 5, 64, 257)
_TK_TOPK = "tile_kernels/torch/topk.py"
_DS_MLP = "deepinfer-0.1.0/deepinfer/model_executor/models/v4_modules/mlp.py"


def _compile(nodes: list[ast.stmt], filename: str, namespace: dict) -> dict:
    # Postponed annotations: theirs name types we do not define.
    future = ast.parse("from __future__ import annotations").body
    exec(compile(ast.Module(body=future + nodes, type_ignores=[]), filename, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def tk_gate() -> Callable:
    """TileKernels' moe_topk_gate_forward with its stable_topk and sqrt_softplus_ref, from the
    wheel's file alone (off Ascend the scores are float32 softplus().sqrt())."""
    with zipfile.ZipFile(reference_file(TILE_KERNELS_WHEEL)) as wheel:
        source = wheel.read(_TK_TOPK).decode()
    wanted = {"sqrt_softplus_ref", "stable_topk", "moe_topk_gate_forward"}
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    return _compile(nodes, _TK_TOPK, {"torch": torch, "F": F, "is_ascend": lambda: False})[
        "moe_topk_gate_forward"
    ]


@pytest.fixture(scope="module")
def ds_gate_forward(tk_gate) -> Callable:
    """DeepSeek's DeepseekMoE.gate_forward compiled alone, on one rank, no forced imbalance; its
    gate call (TileKernels' `moe_topk_gate` kernel) is answered by TileKernels' reference."""
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        source = tar.extractfile(_DS_MLP).read().decode()
    moe = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DeepseekMoE")
    method = next(n for n in moe.body if isinstance(n, ast.FunctionDef) and n.name == "gate_forward")

    def moe_topk_gate(logits: torch.Tensor, force_random=None, **kwargs):
        assert force_random is None  # the kernel's random routing for profiling: not in the reference
        return tk_gate(logits, **kwargs)

    one_rank = types.SimpleNamespace(size=lambda: 1)
    namespace = {
        "torch": torch,
        "envs": types.SimpleNamespace(DEEPINFER_FORCE_IMBALANCE_RATIO=0),
        "PG": types.SimpleNamespace(context_parallel_group=lambda: one_rank),
        "moe_topk_gate": moe_topk_gate,
    }
    return _compile([method], _DS_MLP, namespace)["gate_forward"]


def _router(seed: int, ties: bool = False) -> V4Router:
    """Random weights; bias_vl three times bias's spread, so it moves many tokens' choices.
    `ties`: experts in threes (3i, 3i+1, 3i+2) share their weight row and both biases, so every
    token's biased scores tie in threes and the k = 4 boundary falls inside the second three."""
    gen = torch.Generator().manual_seed(seed)
    router = V4Router(HIDDEN, EXPERTS, TOP_K, "sqrtsoftplus", SCALE, None, image_bias=True)
    router.weight.data = torch.randn(EXPERTS, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
    router.bias.data = 0.1 * torch.randn(EXPERTS, generator=gen)
    router.bias_vl.data = 0.3 * torch.randn(EXPERTS, generator=gen)
    if ties:
        for p in (router.weight, router.bias, router.bias_vl):
            p.data = p.data[0::3].repeat_interleave(3, dim=0)
    return router


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, HIDDEN] (every fourth row zero: all its scores tie, the biases alone decide) and a
    random image mask [n]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=gen)
    x[::4] = 0
    return x, torch.rand(n, generator=gen) < 0.5


def _route(router: V4Router, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return router(x, torch.zeros(x.shape[0], dtype=torch.int64), mask)


def _ds_moe(router: V4Router) -> types.SimpleNamespace:
    """What DeepSeek's gate_forward reads of its module, holding our router's tensors (its gate
    projection: a ReplicatedLinear with float32 output)."""
    no_eplb = types.SimpleNamespace(logical_to_physical_map=None, logical_count=None)
    return types.SimpleNamespace(
        num_topk=router.top_k,
        routed_scaling_factor=router.routed_scaling_factor,
        scoring_func="sqrtsoftplus",
        ep_rank=0,
        ep_size=1,
        e_score_correction_bias=router.bias.data,
        e_score_correction_bias_vl=router.bias_vl.data,
        use_mega_gate=False,
        gate=lambda h: F.linear(h, router.weight),
        _eplb_layer=lambda: no_eplb,
    )


def _dense(router: V4Router, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in float64 from the formulas: s_e = sqrt(log(1 + exp(l_e))); the k experts
    with the highest s_e + b_e, b = bias_vl for an image token and bias for a text one, an equal
    sum going to the lower e; w_e = scale * s_e / (sum of the chosen s)."""
    w = router.weight.double().tolist()
    weights, ids = [], []
    for t in range(x.shape[0]):
        row = x[t].double().tolist()
        bias = (router.bias_vl if mask[t] else router.bias).double().tolist()
        s = [
            math.sqrt(math.log1p(math.exp(sum(a * b for a, b in zip(w[e], row, strict=True)))))
            for e in range(EXPERTS)
        ]
        chosen = sorted(range(EXPERTS), key=lambda e: (-(s[e] + bias[e]), e))[:TOP_K]
        total = sum(s[e] for e in chosen)
        ids.append(chosen)
        weights.append([SCALE * s[e] / total for e in chosen])
    return torch.tensor(weights).reshape(-1, TOP_K), torch.tensor(ids, dtype=torch.int64).reshape(-1, TOP_K)


@pytest.mark.parametrize("ties", [False, True])
def test_gate_equals_tilekernels_reference(tk_gate, ties):
    router = _router(1, ties)
    for n in TOKEN_COUNTS:
        x, mask = _tokens(n, n)
        for image in (None, mask):
            weights, ids = _route(router, x, image)
            ref_ids, ref_weights = tk_gate(
                F.linear(x, router.weight),
                TOP_K,
                False,  # use_shared_as_routed: V4.1's shared expert is run apart
                0,
                SCALE,
                0,
                "sqrtsoftplus",
                bias=router.bias.data,
                image_bias=None if image is None else router.bias_vl.data,
                image_token_mask=image,
            )
            assert torch.equal(ids, ref_ids), (n, image is None)
            assert torch.equal(weights, ref_weights), (n, image is None)  # the same float32 steps


@pytest.mark.parametrize("ties", [False, True])
def test_gate_equals_deepseeks_gate_forward(ds_gate_forward, ties):
    """DeepSeek's engine passes bias_vl as the image bias only when the step has an image mask."""
    router = _router(2, ties)
    module = _ds_moe(router)
    for n in TOKEN_COUNTS:
        x, mask = _tokens(n, 100 + n)
        for image in (None, mask):
            metadata = types.SimpleNamespace(
                images_seq_mask=image, is_prompt=True, gate_force_random=None, valid_token_mask=None
            )
            ref_ids, ref_weights = ds_gate_forward(module, x, metadata)
            weights, ids = _route(router, x, image)
            assert torch.equal(ids, ref_ids), (n, image is None)
            assert torch.equal(weights, ref_weights), (n, image is None)


@pytest.mark.parametrize("ties", [False, True])
def test_gate_equals_the_formula_token_by_token(ties):
    router = _router(3, ties)
    x, mask = _tokens(97, 3)
    weights, ids = _route(router, x, mask)
    dense_weights, dense_ids = _dense(router, x, mask)
    assert torch.equal(ids, dense_ids)
    torch.testing.assert_close(weights, dense_weights.float(), rtol=1e-6, atol=1e-6)


def test_image_tokens_choose_by_bias_vl_and_text_tokens_by_bias():
    router = _router(4)
    x, mask = _tokens(64, 4)
    text_weights, text_ids = _route(router, x, None)
    image_weights, image_ids = _route(router, x, torch.ones(64, dtype=torch.bool))
    swapped = _router(4)
    swapped.bias.data = router.bias_vl.data.clone()
    assert all(torch.equal(a, b) for a, b in zip(_route(swapped, x, None), (image_weights, image_ids)))
    # The data moves choices: a router that ignored bias_vl would route these tokens as text.
    assert (image_ids != text_ids).any(dim=-1).float().mean() > 0.25
    # An all-text mask is no mask.
    no_image = _route(router, x, torch.zeros(64, dtype=torch.bool))
    assert torch.equal(no_image[0], text_weights) and torch.equal(no_image[1], text_ids)
    # A mixed batch: its image rows as in the all-image batch, its text rows as in the text one.
    weights, ids = _route(router, x, mask)
    assert torch.equal(ids[mask], image_ids[mask]) and torch.equal(ids[~mask], text_ids[~mask])
    assert torch.equal(weights[mask], image_weights[mask])
    assert torch.equal(weights[~mask], text_weights[~mask])


def test_a_mixed_batch_equals_each_token_routed_alone():
    router = _router(5, ties=True)
    x, mask = _tokens(33, 5)
    weights, ids = _route(router, x, mask)
    for t in range(33):
        alone_weights, alone_ids = _route(router, x[t : t + 1], mask[t : t + 1])
        assert torch.equal(alone_ids[0], ids[t]), t
        # One row may take another matmul kernel than the batch: equal to float32 rounding.
        torch.testing.assert_close(alone_weights[0], weights[t], rtol=1e-6, atol=0)


def test_an_image_mask_needs_an_image_bias():
    v4_router = V4Router(HIDDEN, EXPERTS, TOP_K, "sqrtsoftplus", SCALE, None)
    v4_router.weight.data.zero_()
    v4_router.bias.data.zero_()
    with pytest.raises(ValueError, match="bias_vl"):
        _route(v4_router, torch.zeros(2, HIDDEN), torch.tensor([True, False]))
    with pytest.raises(ValueError, match="hash-routed"):
        V4Router(HIDDEN, EXPERTS, TOP_K, "sqrtsoftplus", SCALE, 50, image_bias=True)


# -- the model -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyV41:
    return build_v41(tmp_path_factory.mktemp("v41_routing") / "tiny", tiny_config(), seed=0)


@pytest.fixture(scope="module")
def model(tiny) -> DeepseekV41ForCausalLM:
    return DeepseekV41ForCausalLM.from_pretrained(tiny.path)


def test_the_checkpoints_bias_vl_is_loaded_in_target_and_dspark(tiny, model):
    arch = DeepseekV41Arch.from_file(tiny.path)
    weights = load_v41_weights(tiny.path, arch)
    drafter = DSparkV41(arch, weights.tensors, model.embed.data, model.head.data)
    gates = {f"layers.{i}.": layer.ffn.gate for i, layer in enumerate(model.layers)}
    gates |= {f"mtp.{i}.": layer.ffn.gate for i, layer in enumerate(drafter.layers)}
    assert len(gates) == arch.num_layers + arch.dspark.num_layers
    for prefix, gate in gates.items():
        assert torch.equal(gate.bias_vl, tiny.values[prefix + "ffn.gate.bias_vl"]), prefix
        assert torch.equal(gate.bias, tiny.values[prefix + "ffn.gate.bias"]), prefix
        assert not torch.equal(gate.bias_vl, gate.bias), prefix


def _run(
    model: DeepseekV41ForCausalLM, ids: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One new sequence's prompt in one step -> (final hidden [n, hidden], each layer's chosen
    experts [n, k] as its router returned them)."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.ffn.gate.register_forward_hook(lambda _module, _args, out: chosen.append(out[1]))
        for layer in model.layers
    ]
    try:
        cache = ContiguousV41Cache(model.arch)
        seq = cache.add_sequence()
        layout = StepLayout((0,), (ids.shape[0],))
        hidden = model.forward_cached(
            ids, torch.arange(ids.shape[0]), layout, cache.step([seq], layout), image_mask=mask
        )
    finally:
        for hook in hooks:
            hook.remove()
    return hidden, chosen


def test_the_model_routes_marked_tokens_by_bias_vl(model):
    ids = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(0))
    text, text_routes = _run(model, ids, None)
    assert torch.equal(_run(model, ids, torch.zeros(12, dtype=torch.bool))[0], text)
    images, image_routes = _run(model, ids, torch.ones(12, dtype=torch.bool))
    # Every layer routes some token elsewhere by bias_vl (the tiny experts move the hidden little).
    for layer, (a, b) in enumerate(zip(text_routes, image_routes, strict=True)):
        assert not torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values), layer
    assert not torch.equal(images, text)
    gates = [layer.ffn.gate for layer in model.layers]
    saved = [gate.bias.data for gate in gates]
    engrams = [layer.engram for layer in model.layers]
    # Every layer's text bias replaced by its image bias, and no Engram (image rows keep their
    # streams): what all-image tokens must see.
    try:
        for gate, layer in zip(gates, model.layers, strict=True):
            gate.bias.data = gate.bias_vl.data
            layer.engram = None
        assert torch.equal(_run(model, ids, None)[0], images)
    finally:
        for gate, bias, layer, engram in zip(gates, saved, model.layers, engrams, strict=True):
            gate.bias.data = bias
            layer.engram = engram
    # Only the last token marked: the rows before it (causal) are the text ones. Not bit for bit:
    # Engram now leaves the last row's streams as they are, and a different last row moves the
    # earlier rows' attention output by float32 rounding (~1e-6).
    last = torch.zeros(12, dtype=torch.bool)
    last[-1] = True
    marked, marked_routes = _run(model, ids, last)
    torch.testing.assert_close(marked[:-1], text[:-1], rtol=0, atol=1e-5)
    assert (marked[-1] - text[-1]).abs().max() > 1e-3
    for a, b in zip(text_routes, marked_routes, strict=True):
        assert torch.equal(a[:-1], b[:-1])
    with pytest.raises(ValueError, match="image_mask"):
        _run(model, ids, torch.zeros(11, dtype=torch.bool))
