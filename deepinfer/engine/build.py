"""The engine builder: one validated config (or weights already loaded) -> an EngineCore with every
collaborator built (device, model, cache budget, KV manager, runner, speculation, KV connector,
image puller, scheduler). The core only steps what it is given."""

from __future__ import annotations

import dataclasses
import logging

import torch

from deepinfer.attention.cpu_paged import bf16_products
from deepinfer.cache_layout import CacheGroup, CacheLayout, plan_cache_layout
from deepinfer.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, parse_int_list
from deepinfer.config.rope import check_context_length
from deepinfer.engine.connectors.connector import ConnectorChain, KVConnector
from deepinfer.engine.connectors.offload import KVOffloader, TierEvents
from deepinfer.engine.connectors.pd import DecodeReceiver, PrefillHandoff
from deepinfer.engine.core import EngineCore, KVConnection
from deepinfer.engine.grammar import GrammarManager
from deepinfer.engine.image_pull import ImagePuller
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.parallel.context import RankContext, rank_threads
from deepinfer.engine.scheduler import Scheduler
from deepinfer.image_input import embeddings_layout
from deepinfer.kernels import isa
from deepinfer.model.base import CausalLM
from deepinfer.model.layers.expert_parallel import ExpertBalancer
from deepinfer.model.layers.fp8_linear import keeps_fp8_weights
from deepinfer.model.loader.dtype import engine_dtype, model_dtype
from deepinfer.model.loader.load import LoadedModel, check_model_engine, load_model
from deepinfer.runner import graphs
from deepinfer.runner.device import torch_device
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.model_runner import ModelRunner, cpu_kernel_chosen, triton_chosen
from deepinfer.security.cluster_key import cluster_key_of
from deepinfer.speculative.build import (
    build_speculative_decoder,
    feature_layers,
    load_draft_model,
    proposer_cache_groups,
)
from deepinfer.store import build_kv_store
from deepinfer.transport.kv_event_log import KVEventLog

log = logging.getLogger(__name__)


def check_model_options(config: EngineConfig, loaded: LoadedModel) -> None:
    """Options that depend on the model, checked before any cache is allocated."""
    if loaded.quantization != config.quantization:
        raise ValueError(
            f"quantization={config.quantization!r} but the model given was loaded with {loaded.quantization!r}"
        )
    if config.cache.kv_cache_dtype != "auto" and not loaded.model.supports_kv_cache_dtype:
        raise ValueError(
            f"kv_cache_dtype={config.cache.kv_cache_dtype!r}: {type(loaded.model).__name__} keeps its KV "
            "cache in the model's dtype"
        )


def engine_device(config: EngineConfig, parallel: RankContext | None) -> torch.device:
    """The device of this rank (on CUDA, one per rank of the machine)."""
    device = torch_device(config.device)
    if device.type == "cuda" and parallel is not None and device.index is None:
        return torch.device("cuda", parallel.topology.local_rank)
    return device


def kv_cache_dtype(
    config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's element type. `auto`, for a model running on a GGUF's own blocks: 16 bits
    (batched decode reads the cache more than the weights, and half the bytes is most of its
    time), bf16 where the CPU attention computes a bf16 cache in bf16 products (AMX tiles,
    VDPBF16PS: an 8k prefill 2.5x faster on the AMX Xeon, 1.4x on Zen 4), else fp16, as
    llama.cpp keeps it. The model's dtype otherwise, bf16 for a bf16 model on the CPU too (its
    K/V values as they are, which the same kernel reads)."""
    choice = config.cache.kv_cache_dtype
    if choice == "auto":
        model = loaded.model
        if loaded.resolved_quantization != "gguf" or not model.supports_kv_cache_dtype:
            return dtype
        return torch.bfloat16 if bf16_attention(config, model, device) else torch.float16
    if choice == "float32" and dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype='float32' needs an fp32 model; this one computes in {dtype}")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(choice, torch.float32)


def bf16_attention(config: EngineConfig, model: CausalLM, device: torch.device) -> bool:
    """Whether this engine's attention would compute a bf16 cache in bf16 products: the C
    kernel's backend on the CPU, with bf16 instructions for the model's head size."""
    if device.type != "cpu" or not cpu_kernel_chosen(config.attention_backend, device):
        return False
    return model.uses_attention_backend and bf16_products(model.attention_shape()[2])


def config_on_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with the defaults that depend on the device filled in (the step budget): what
    every rank plans its caches and schedules with."""
    return dataclasses.replace(config, scheduler=config.scheduler.on_device(device.type))


def plan_engine_caches(
    config: EngineConfig, groups: list[CacheGroup], device: torch.device, parallel: RankContext | None = None
) -> CacheLayout:
    """One budget for every cache of the engine (target, draft model, MTP). The ranks of a
    tensor-parallel group hold different shares of the KV heads, but one scheduler addresses
    their blocks: they all take the smallest block count any of them can afford."""
    cache, scheduler = config.cache, config.scheduler
    budget = cache.kv_cache_memory
    if budget is None and cache.num_blocks is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.9)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES

    def plan(num_blocks: int | None) -> CacheLayout:
        return plan_cache_layout(
            groups,
            cache.block_size,
            budget_bytes=budget,
            num_blocks=num_blocks,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
        )

    layout = plan(cache.num_blocks)
    if parallel is not None and parallel.topology.tp_size > 1:
        agreed = parallel.comm.all_reduce_min(layout.groups[0].num_blocks)
        if agreed != layout.groups[0].num_blocks:
            layout = plan(agreed)
    return layout


def build_expert_balancer(
    config: EngineConfig, model: CausalLM, parallel: RankContext | None
) -> ExpertBalancer | None:
    """EPLB over the model's expert-parallel layers (--enable-eplb)."""
    layers = model.expert_layers()
    if parallel is None or not config.parallel.enable_eplb or not layers:
        return None
    ep = layers[0].ep
    router = getattr(getattr(model, "arch", None), "router", None)
    return ExpertBalancer(
        layers,
        ep,
        config.parallel.eplb_interval,
        num_groups=router.num_groups if router is not None else 1,
        num_nodes=parallel.topology.nnodes,
        policy=config.parallel.eplb_policy,
    )


def build_kv_connection(
    config: EngineConfig, kv: KVCacheManager, caches: KVCaches, kv_events: KVEventLog | None
) -> KVConnection:
    """The store connector (if a store or host tier is configured), then the role's: a prefill
    engine's handoff (and its transfer listener), a direct-transfer decode engine's receiver."""
    tier_events = TierEvents(kv_events) if kv_events is not None else None
    store = build_kv_store(
        config.store.settings(),
        on_host_evict=tier_events.host_evicted if tier_events is not None else None,
        cluster_key=cluster_key_of(config.disaggregation.cluster_key_file),
    )
    connection = KVConnection(store=store)
    connectors: list[KVConnector] = []
    if store is not None:
        connectors.append(KVOffloader(store, kv, caches, tier_events))
    pd = config.disaggregation
    if pd.role == "prefill":
        handoff = PrefillHandoff(kv, caches, pd, store, config.store.kv_chunk_blocks)
        connection.transfer_address = handoff.address
        connectors.append(handoff)
        if pd.kv_transfer == "direct":
            connection.transfer_layout = handoff.chunks.describe()
    elif pd.role == "decode" and pd.kv_transfer == "direct":
        receiver = DecodeReceiver(kv, caches, pd, config.store.kv_chunk_blocks)
        connection.transfer_layout = receiver.layout
        connectors.append(receiver)
    if connectors:
        connection.connector = connectors[0] if len(connectors) == 1 else ConnectorChain(connectors)
    return connection


def build_engine_core(
    config: EngineConfig, loaded: LoadedModel | None = None, parallel: RankContext | None = None
) -> EngineCore:
    """Build every collaborator from one validated config (loading the weights, or taking
    `loaded`) and the core that steps them. With `parallel`, the core is rank 0 of a
    tensor-parallel group or one data-parallel rank, and loads this rank's shard."""
    torch.set_num_threads(rank_threads(config, parallel.topology if parallel else None))
    device = engine_device(config, parallel)
    config = config_on_device(config, device)
    if parallel is not None and loaded is not None:
        raise ValueError("an engine over several ranks loads its own shards: `loaded` cannot be given")
    if loaded is None:
        check_model_engine(config)
        dtype = engine_dtype(config, device)
    else:
        type(loaded.model).check_engine(loaded.config, config)
        dtype = model_dtype(loaded.model)  # weights already loaded: what they compute in
    loaded = loaded or load_model(
        config.model,
        dtype,
        device,
        config.quantization,
        parallel.model_parallel() if parallel else None,
        config.rope_scaling,
        keep_fp8=keeps_fp8_weights(
            config.fp8_weights, triton_chosen(config.attention_backend, device), device
        ),
    )
    check_model_options(config, loaded)
    loaded.model.configure(config)
    model = loaded.model
    kv_dtype = kv_cache_dtype(config, loaded, dtype, device)
    max_positions = loaded.config.max_position_embeddings
    # Past the positions the model places (trained, or stretched by --rope-scaling): refused.
    check_context_length(config.scheduler.max_model_len, max_positions, config.rope_scaling)
    max_model_len = config.scheduler.max_model_len or max_positions

    draft = load_draft_model(config, loaded, max_model_len, dtype, device)
    declared: dict[str, list[CacheGroup]] = {
        "target": model.cache_groups(kv_dtype),
        **proposer_cache_groups(config.speculative.speculative_method, model, draft, kv_dtype),
    }
    layout = plan_engine_caches(config, [g for groups in declared.values() for g in groups], device, parallel)
    # KV events are logged only when someone publishes them (a router reads them).
    kv_events = KVEventLog() if config.disaggregation.kv_events_endpoint else None
    kv = KVCacheManager(layout, config.cache.enable_prefix_caching, kv_events)
    capture = graphs.decode_graph_capture(device, config.enforce_eager)
    caches = KVCaches(layout, declared, device, scratch_block=capture is not None)
    # On the CPU the model has every core: masks are computed inline rather than by a pool.
    grammars = GrammarManager(
        loaded.tokenizer,
        loaded.config.vocab_size,
        config.grammar_compile_timeout,
        mask_threads=0 if device.type == "cpu" else None,
    )
    runner = ModelRunner(
        model,
        caches,
        device,
        config.attention_backend,
        grammars.bitmask,
        peers=parallel.peers if parallel else None,
        experts=build_expert_balancer(config, model, parallel),
        feature_layers=feature_layers(config, model),
    )
    if capture is not None:
        sizes = config.cuda_graph_sizes
        runner.use_decode_graphs(
            capture,
            parse_int_list(sizes) if sizes else graphs.default_sizes(config.scheduler.max_num_seqs),
            min(max_model_len, graphs.DEFAULT_MAX_CONTEXT),
        )
    spec = build_speculative_decoder(config, runner, caches, draft) if config.speculative.enabled else None
    connection = build_kv_connection(config, kv, caches, kv_events)
    pd = config.disaggregation
    # Images an encode-role server encoded: their embeddings are pulled as requests arrive.
    image_puller = (
        ImagePuller(
            embeddings_layout(loaded.config.raw),
            pd.kv_transfer_timeout,
            cluster_key_of(pd.cluster_key_file),
        )
        if pd.encoders and model.accepts_images
        else None
    )
    core = EngineCore(
        config,
        loaded=loaded,
        max_model_len=max_model_len,
        layout=layout,
        kv=kv,
        kv_events=kv_events,
        grammars=grammars,
        runner=runner,
        spec=spec,
        connection=connection,
        image_puller=image_puller,
        scheduler=Scheduler(config.scheduler, max_model_len, kv),
        parallel=parallel,
    )
    log.info(
        "engine ready: %s in %s, %d KV blocks in %d cache group(s) (%.0f bytes/token), "
        "attention=%s, CUDA graphs %s, C kernels for %s on %d threads",
        loaded.name,
        str(dtype).removeprefix("torch."),
        kv.num_blocks,
        len(layout.groups),
        layout.bytes_per_token,
        runner.backend.name,
        "on" if runner.graphs is not None else "off",
        isa.describe(),
        torch.get_num_threads(),
    )
    return core
