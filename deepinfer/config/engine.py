"""Engine options: one frozen, validated config shared by `LLM(...)`, `deepinfer serve`, the
benchmarks and the engine process.

Every value is checked in `__post_init__`, so a bad option fails where it is given (the API side
of `deepinfer serve`, the `LLM` constructor) before any weight loads, with an error naming it.
Options are grouped by what they configure (cache, scheduler, speculative decoding, KV store);
`EngineConfig.from_kwargs` takes them flat, as `LLM(**options)` and the command line give them.
Torch-free: the engine resolves `device` and `dtype` to torch objects itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer.config.fields import ConfigError, check_choice, check_positive, normalize_sizes, option
from deepinfer.config.rope import parse_rope_scaling
from deepinfer.config.units import parse_int_list
from deepinfer.security.loopback import require_loopback
from deepinfer.store.config import KVStoreConfig, StoreLocation, parse_store_url
from deepinfer.store.retention import RetentionPolicy, parse_retention

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
DEFAULT_CHUNK_BLOCKS = 16

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = option(16, help="tokens per KV-cache block")
    kv_cache_memory: int | None = option(
        None,
        size=True,
        help="bytes for every KV cache of the engine (target, draft model, MTP), e.g. 512MiB, 2GiB "
        "or 2GB (default: 2 GiB on CPU, 90%% of free memory on GPU)",
    )
    num_blocks: int | None = option(None, help="number of KV-cache blocks (overrides --kv-cache-memory)")
    enable_prefix_caching: bool = option(True, help="reuse the KV of shared prompt prefixes")
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = option(
        "auto",
        help="float16: half the KV bytes, twice the tokens per GiB (attention still in fp32); "
        "bfloat16: the same bytes, a bf16 model's own K/V values (on a CPU with AVX512-BF16 its "
        "attention then runs in bf16 products, on AMX tiles where the CPU has them); float32: full "
        "precision (an fp32 model only); auto: for a model running on a GGUF's own blocks "
        "bfloat16 where the CPU attention computes it in bf16 products, else float16 (llama.cpp's "
        "default); bfloat16 for a model in bfloat16 on the CPU; else the model's dtype",
    )

    def __post_init__(self) -> None:
        normalize_sizes(self)
        check_positive("block_size", self.block_size, allow_none=False)
        check_positive("kv_cache_memory", self.kv_cache_memory)
        check_positive("num_blocks", self.num_blocks)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", "float16", "bfloat16", "float32"))


CPU_STEP_TOKENS = 1024  # default step budgets, by device (SchedulerConfig.on_device)
ACCELERATOR_STEP_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, help="most sequences running at once")
    max_num_batched_tokens: int | None = option(
        None,
        help="token budget of one step (default: 1024 on the CPU, where shorter steps let 32 "
        "streams' first tokens out sooner at no cost in throughput; 2048 on a GPU)",
    )
    prefill_chunk_size: int | None = option(None, help="most prompt tokens of one sequence per step")
    max_prefill_attention: int | None = option(
        524288,
        help="most attended positions (each new prompt token counts the positions it attends) of "
        "the prefills sharing a step beside its first: a short suffix after a long cached prefix is "
        "costly for its context, and batched with others it delays every one of them (None in "
        "Python: no cap)",
    )
    max_model_len: int | None = option(
        None,
        help="context length (default: the model's); past its trained context only with --rope-scaling",
    )
    scheduling_policy: Literal["fcfs", "priority"] = option(
        "fcfs", help="fcfs, or priority (lower value first)"
    )
    async_scheduling: bool = option(
        False,
        help="plan step N+1 while step N's forward runs (on a forward thread), and hand step N's "
        "outputs on while step N+1 runs; greedy output is unchanged (see docs/benchmarks.md for "
        "where it pays on the CPU)",
    )

    def on_device(self, device_type: str) -> SchedulerConfig:
        """This config with the step budget's default filled in for a device type ("cpu",
        "cuda"): a new config, this one unchanged. Measured on a 2-core Intel Xeon with AMX (32
        streams of 256 words -> 128 tokens, GGUF default): 1024 gave 373-386 output tok/s and TTFT
        p50 2.5-2.8 s against 2048's 347-348 tok/s and 3.6-3.7 s; 512 and 768 the same as 1024."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = CPU_STEP_TOKENS if device_type == "cpu" else ACCELERATOR_STEP_TOKENS
        return dataclasses.replace(self, max_num_batched_tokens=budget)

    def __post_init__(self) -> None:
        check_positive("max_num_seqs", self.max_num_seqs, allow_none=False)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("prefill_chunk_size", self.prefill_chunk_size)
        check_positive("max_prefill_attention", self.max_prefill_attention)
        check_positive("max_model_len", self.max_model_len)
        check_choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))


SPECULATIVE_METHODS = ("ngram", "draft", "mtp", "dspark")
SPECULATIVE_LENGTHS = ("fixed", "dynamic", "confidence")
# Proposers whose drafts carry a confidence (their `has_confidence`): the draft model's and MTP's
# own probability of the token they propose, DSpark's confidence head. Prompt lookup has none.
CONFIDENCE_METHODS = ("draft", "mtp", "dspark")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    speculative_method: Literal["ngram", "draft", "mtp", "dspark"] | None = option(
        None,
        help="speculative decoding: ngram (prompt lookup), draft (a draft model), mtp (DeepSeek MTP) "
        "or dspark (DeepSeek-V4.1's DSpark layers)",
    )
    num_speculative_tokens: int = option(5, help="most draft tokens verified per step")
    speculative_length: Literal["fixed", "dynamic", "confidence"] = option(
        "dynamic",
        help="dynamic: per-step length from expected acceptance and the profiled step cost; "
        "confidence (draft, mtp, dspark): lengths chosen after drafting from the drafts' confidences "
        "and the profiled step cost; fixed: always the most",
    )
    speculative_model: str | None = option(
        None,
        metavar="PATH",
        help="draft model for --speculative-method draft (default: the target model itself)",
    )
    speculative_ngram_min: int = option(2, help="shortest suffix n-gram prompt lookup matches")
    speculative_ngram_max: int = option(4, help="longest suffix n-gram prompt lookup tries first")

    def __post_init__(self) -> None:
        if self.speculative_method is not None:
            check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("num_speculative_tokens", f"must be an integer >= 1, got {n!r}")
        check_choice("speculative_length", self.speculative_length, SPECULATIVE_LENGTHS)
        if (
            self.speculative_length == "confidence"
            and self.speculative_method is not None
            and self.speculative_method not in CONFIDENCE_METHODS
        ):
            raise ConfigError(
                "speculative_length",
                f"'confidence' needs a proposer whose drafts carry a confidence ({', '.join(CONFIDENCE_METHODS)}); "
                f"speculative_method={self.speculative_method!r} gives none (use 'dynamic' or 'fixed')",
            )
        if self.speculative_model is not None and self.speculative_method != "draft":
            raise ConfigError(
                "speculative_model",
                f"only used with speculative_method='draft', not {self.speculative_method!r}",
            )
        if self.speculative_ngram_min < 1:
            raise ConfigError("speculative_ngram_min", f"must be >= 1, got {self.speculative_ngram_min}")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ConfigError(
                "speculative_ngram_max",
                f"must be >= speculative_ngram_min ({self.speculative_ngram_min}), "
                f"got {self.speculative_ngram_max}",
            )

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None


@dataclass(frozen=True, slots=True)
class StoreConfig:
    kv_store: str | None = option(None, help="persistent KV store: DIR | file://DIR | redis://HOST:PORT[/DB]")
    kv_host_cache_bytes: int | None = option(
        None, size=True, help="host-memory KV tier, e.g. 8GiB (default: none)"
    )
    kv_retention: str | None = option(
        None, help="TTL per traffic class, e.g. agent=3d,chat=7d (the default); more classes may be added"
    )
    kv_store_max_bytes: int | None = option(None, size=True, help="size cap of the persistent store")
    kv_chunk_blocks: int = option(
        DEFAULT_CHUNK_BLOCKS, help="full blocks per KV chunk (stored, and moved by the PD handoffs)"
    )
    kv_store_encrypt: bool = option(
        False,
        help="encrypt stored KV chunks with AES-GCM keyed by --cluster-key-file (a store others can "
        "read); with the key alone chunks are authenticated, not encrypted",
    )

    def __post_init__(self) -> None:
        normalize_sizes(self)
        if self.kv_store is not None:
            parse_store_url(self.kv_store)  # raises naming --kv-store
        if self.kv_retention is not None:
            try:
                parse_retention(self.kv_retention)
            except ValueError as exc:
                raise ConfigError("kv_retention", str(exc)) from None
        check_positive("kv_chunk_blocks", self.kv_chunk_blocks, allow_none=False)

    @property
    def location(self) -> StoreLocation | None:
        return parse_store_url(self.kv_store) if self.kv_store is not None else None

    @property
    def retention(self) -> RetentionPolicy:
        return parse_retention(self.kv_retention) if self.kv_retention else RetentionPolicy()

    @property
    def enabled(self) -> bool:
        return self.kv_store is not None or bool(self.kv_host_cache_bytes)

    @property
    def identity(self) -> str | None:
        """Which shared store this is, for engines and routers to compare (no credentials)."""
        location = self.location
        if location is None:
            return None
        if location.kind == "file":
            return "file://" + os.path.abspath(os.path.expanduser(location.path))
        return f"redis://{location.host}:{location.port}/{location.db}"

    @property
    def traffic_classes(self) -> list[str]:
        """The classes requests may name (each has a retention)."""
        return sorted(self.retention.ttls)

    def settings(self) -> KVStoreConfig:
        """The tier stack's settings (store tuning beyond these options keeps its defaults)."""
        return KVStoreConfig(
            location=self.location,
            host_cache_bytes=self.kv_host_cache_bytes or 0,
            retention=self.retention,
            blocks_per_chunk=self.kv_chunk_blocks,
            size_cap_bytes=self.kv_store_max_bytes,
            encrypt=self.kv_store_encrypt,
        )


ROLES = ("both", "prefill", "decode", "encode")
KV_TRANSFERS = ("direct", "store")
TRANSFER_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (the role, the KV handoff) and the KV events a router reads."""

    role: Literal["both", "prefill", "decode", "encode"] = option(
        "both",
        help="both: prefill and decode every request (a plain replica); prefill: compute prompts' KV "
        "and hand it off to a decode engine; decode: receive the KV and generate; encode: only the "
        "vision encoder (DeepSeek-V4.1), which preprocesses and encodes images for --encoder engines",
    )
    kv_transfer: Literal["direct", "store"] = option(
        "direct",
        help="how the prompt's KV goes from the prefill to the decode engine: direct (the decoder pulls "
        "it over TCP) or store (through the shared --kv-store both engines use)",
    )
    kv_transfer_host: str = option(
        "127.0.0.1",
        help="address the prefill engine's (or encoder's) KV transfer listener binds; another than "
        "loopback needs --cluster-key-file",
    )
    kv_transfer_port: int = option(0, help="port of the prefill engine's KV transfer listener (0: any free)")
    kv_transfer_lease: float = option(
        30.0,
        help="seconds a prefill engine keeps a handed-off prompt's KV blocks for its decoder to pull them "
        "(a decoder that never comes, or stalls, frees them when the lease ends)",
    )
    kv_transfer_timeout: float = option(
        30.0,
        help="seconds a decode engine waits for a KV transfer before it applies --kv-transfer-failure "
        "(and an engine with --encoder for an image's embeddings before it fails the request)",
    )
    kv_transfer_failure: Literal["recompute", "fail"] = option(
        "recompute",
        help="what a decode engine does when the prompt's KV does not arrive: recompute it, or fail the "
        "request with an error",
    )
    encoders: Sequence[str] = option(
        default_factory=tuple,
        flag="--encoder",
        repeat=True,
        metavar="URL",
        help="http(s) URL of a `--role encode` server that encodes this engine's request images (their "
        "embeddings come back over the direct transfer); repeat for several, tried in turn",
    )
    encoder_timeout: float = option(
        300.0,
        help="seconds an --encoder may take to preprocess and encode one request's images (the "
        "embeddings' pull is bounded by --kv-transfer-timeout)",
    )
    kv_events_endpoint: str | None = option(
        None,
        help="publish KV events (block stored / removed, per tier) on this ZMQ PUB endpoint in vLLM's "
        "wire format, e.g. tcp://127.0.0.1:5557 (port 0: any free port, reported by /v1/engine_info)",
    )
    kv_events_token_ids: bool = option(
        True,
        help="KV events carry each block's token ids (vLLM's format); --no-kv-events-token-ids sends "
        "empty token id lists, the block hashes alone, to consumers that need only those",
    )
    cluster_key_file: str | None = option(
        None,
        metavar="PATH",
        help="the deployment's shared secret (a file of 32+ bytes, mode 600) every peer proves it holds: "
        "KV transfer, PD handoff, KV events, encoder. Without it peer-facing listeners bind loopback only",
    )

    def __post_init__(self) -> None:
        check_choice("role", self.role, ROLES)
        check_choice("kv_transfer", self.kv_transfer, KV_TRANSFERS)
        check_choice("kv_transfer_failure", self.kv_transfer_failure, TRANSFER_FAILURE_POLICIES)
        port = self.kv_transfer_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("kv_transfer_port", f"expected 0..65535, got {port!r}")
        check_positive("kv_transfer_lease", self.kv_transfer_lease, allow_none=False)
        check_positive("kv_transfer_timeout", self.kv_transfer_timeout, allow_none=False)
        check_positive("encoder_timeout", self.encoder_timeout, allow_none=False)
        object.__setattr__(self, "encoders", tuple(self.encoders))
        for url in self.encoders:
            if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+/?$", url):
                raise ConfigError("encoders", f"expected an http(s)://HOST:PORT URL, got {url!r}")
        if self.encoders and self.role not in ("both", "prefill"):
            raise ConfigError("encoders", f"only a both or prefill engine takes images, not {self.role}")
        endpoint = self.kv_events_endpoint
        if endpoint is not None and not re.match(r"^(tcp|ipc|inproc)://\S+$", endpoint):
            raise ConfigError(
                "kv_events_endpoint",
                f"expected a ZMQ endpoint such as tcp://127.0.0.1:5557, got {endpoint!r}",
            )
        if self.cluster_key_file is None:
            self._check_keyless_binds()

    def _check_keyless_binds(self) -> None:
        try:
            require_loopback(self.kv_transfer_host, "--kv-transfer-host")
        except ValueError as error:
            raise ConfigError("kv_transfer_host", str(error)) from None
        endpoint = self.kv_events_endpoint
        if endpoint is not None and endpoint.startswith("tcp://"):
            host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
            try:
                require_loopback(host, "--kv-events-endpoint")
            except ValueError as error:
                raise ConfigError("kv_events_endpoint", str(error)) from None

    @property
    def direct_prefill(self) -> bool:
        """A prefill engine that serves its KV to decoders over TCP."""
        return self.role == "prefill" and self.kv_transfer == "direct"


EPLB_POLICIES = ("auto", "hierarchical", "global")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the engine spans processes and machines. `world = tensor_parallel_size *
    data_parallel_size` ranks, one process each; `deepinfer serve` starts the ranks of its machine
    itself, or a launcher (torchrun, Slurm, ...) starts every rank with RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT in the environment."""

    tensor_parallel_size: int = option(
        1, help="ranks that split every layer (attention heads, MLP, vocabulary) and step together"
    )
    data_parallel_size: int = option(
        1, help="ranks that each schedule their own requests and KV cache (attention data parallelism)"
    )
    enable_expert_parallel: bool = option(
        False, help="MoE: shard whole experts over all ranks, tokens dispatched and combined by all-to-all"
    )
    nnodes: int = option(1, help="machines the ranks span (torchrun style)")
    node_rank: int | None = option(
        None, help="this machine's index; node 0 serves HTTP (default: $NODE_RANK, $GROUP_RANK or 0)"
    )
    master_addr: str | None = option(
        None, help="address of node 0 for the rendezvous (default: $MASTER_ADDR or 127.0.0.1)"
    )
    master_port: int | None = option(
        None, help="rendezvous port on node 0 (default: $MASTER_PORT; one machine: a free port)"
    )
    distributed_backend: Literal["auto", "gloo", "nccl"] = option(
        "auto", help="torch.distributed backend (auto: nccl on CUDA, gloo on CPU)"
    )
    distributed_timeout: float = option(
        120.0, help="seconds a rank waits for its peers (rendezvous, collectives) before the engine fails"
    )
    cpu_binding: bool = option(
        False, help="pin each rank of a machine to its own share of the cores (with --num-threads per rank)"
    )
    enable_eplb: bool = option(
        False, help="expert-load balancing: record expert loads and re-place experts (needs expert parallel)"
    )
    num_redundant_experts: int = option(
        0, help="EPLB: extra expert replicas per MoE layer, placed on the hottest experts"
    )
    eplb_interval: int = option(1000, help="EPLB: forward steps between rebalances")
    eplb_policy: Literal["auto", "hierarchical", "global"] = option(
        "auto",
        help="EPLB placement: hierarchical (expert groups to nodes, then ranks) or global; auto: "
        "hierarchical when the groups divide over the nodes",
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes", "eplb_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if self.node_rank is not None and (
            isinstance(self.node_rank, bool)
            or not isinstance(self.node_rank, int)
            or not 0 <= self.node_rank < self.nnodes
        ):
            raise ConfigError(
                "node_rank", f"must be in 0..{self.nnodes - 1} (--nnodes), got {self.node_rank!r}"
            )
        if self.master_port is not None and not (
            isinstance(self.master_port, int)
            and not isinstance(self.master_port, bool)
            and 0 < self.master_port < 65536
        ):
            raise ConfigError("master_port", f"must be a TCP port (1..65535), got {self.master_port!r}")
        check_choice("distributed_backend", self.distributed_backend, ("auto", "gloo", "nccl"))
        check_positive("distributed_timeout", self.distributed_timeout, allow_none=False)
        if self.world_size % self.nnodes:
            raise ConfigError(
                "nnodes",
                f"{self.world_size} ranks (tensor_parallel_size x data_parallel_size) do not divide "
                f"over {self.nnodes} nodes",
            )
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1:
            raise ConfigError(
                "data_parallel_size",
                "data parallelism together with tensor parallelism is not supported yet: use one of them",
            )
        if (
            isinstance(self.num_redundant_experts, bool)
            or not isinstance(self.num_redundant_experts, int)
            or (self.num_redundant_experts < 0)
        ):
            raise ConfigError(
                "num_redundant_experts", f"must be an integer >= 0, got {self.num_redundant_experts!r}"
            )
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ConfigError("enable_eplb", "expert-load balancing needs --enable-expert-parallel")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ConfigError(
                "num_redundant_experts", "redundant experts are placed by EPLB: add --enable-eplb"
            )
        check_choice("eplb_policy", self.eplb_policy, EPLB_POLICIES)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


SUB_CONFIGS = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "store": StoreConfig,
    "disaggregation": DisaggregationConfig,
    "parallel": ParallelConfig,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = option(
        None, help="a .gguf file or a HF directory (default: the embedded model)", flag="model"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        help="weights and activations dtype (auto: bfloat16 on CUDA; on the CPU bfloat16 for a bf16/fp16 "
        "checkpoint of the Llama family where the CPU has AVX512-BF16 or AMX, float32 otherwise)",
    )
    device: str = option("auto", help="auto, cpu or cuda[:N]")
    attention_backend: Literal["auto", "torch", "cpu_paged", "triton"] = option(
        "auto",
        help="attention implementation (auto: the C kernels on CPU, Triton on CUDA when installed)",
    )
    num_threads: int | None = option(
        None,
        help="CPU threads for torch and the kernels, per rank (default: the CPUs this process may use, its "
        "affinity and cgroup CPU quota, split over the machine's ranks)",
    )
    # gguf: a GGUF's linears computed on its own packed blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q3_K-Q6_K) by
    # native kernels, as llama.cpp does. int8: W8A8 linears (int8 weights per channel, per-token
    # activation scales), not bit-equal to fp32. none: the weights dense in `dtype`.
    quantization: Literal["none", "int8", "gguf"] | None = option(
        None,
        help="gguf: compute on a GGUF's packed blocks with native kernels; int8: W8A8 linears; none: "
        "dense weights in --dtype (default: gguf for a GGUF file on the CPU in float32, none otherwise)",
    )
    # keep: FP8 block-scaled checkpoint weights (DeepSeek-V3) stay FP8 in memory and run through the
    # Triton FP8 linear (layers/fp8_linear.py); on the CPU only under TRITON_INTERPRET=1 (tests).
    fp8_weights: Literal["auto", "dequantize", "keep"] = option(
        "auto",
        help="FP8 block-scaled checkpoint weights: keep them in FP8 (Triton backend, CUDA compute capability "
        ">= 8.9) or dequantize them at load (auto: keep where that holds)",
    )
    grammar_compile_timeout: float = option(
        10.0,
        help="seconds a structured-output grammar (JSON schema, forced tool call) may take to compile; "
        "slower ones are refused (400)",
    )
    rope_scaling: Mapping[str, Any] | None = option(
        None,
        metavar="JSON",
        help="RoPE scaling of a Llama-family model, overriding its checkpoint's, to serve past its "
        'trained context, e.g. \'{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":8192}\' '
        "(rope_type yarn, linear or llama3); the context becomes factor x the original length",
    )
    yoco_prefill_truncation: Literal["off", "compact"] = option(
        "off",
        help="YoCo models (DeepSeek-V4.1): compact runs the layers from the YoCo boundary on over only "
        "a prompt's last --yoco-prefill-keep-tokens tokens, their sliding windows clipped to them "
        "(DeepSeek's bounded replay: less prefill work, the prompt's last rows change); off: every token",
    )
    yoco_prefill_keep_tokens: int | None = option(
        None,
        help="prompt tokens --yoco-prefill-truncation compact keeps: at least the sliding window plus "
        "the tokens a sequence may roll back (the model checks it)",
    )
    enforce_eager: bool = option(
        False, help="never replay CUDA graphs: every step launches its kernels one by one (CUDA only)"
    )
    cuda_graph_sizes: str | None = option(
        None,
        metavar="SIZES",
        help="batch sizes a pure-decode step is captured as a CUDA graph for, e.g. 1,2,4,8,16 (a "
        "smaller batch pads to the next one up, a larger one runs eagerly; default: 1,2,4,8, then "
        "every 8 up to --max-num-seqs). Llama-family models on the Triton backend",
    )
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    disaggregation: DisaggregationConfig = dataclasses.field(default_factory=DisaggregationConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise ConfigError("device", f"expected auto, cpu or cuda[:N], got {self.device!r}")
        check_choice("attention_backend", self.attention_backend, ("auto", "torch", "cpu_paged", "triton"))
        check_positive("num_threads", self.num_threads)
        check_choice("fp8_weights", self.fp8_weights, ("auto", "dequantize", "keep"))
        if self.quantization is not None:
            check_choice("quantization", self.quantization, ("none", "int8", "gguf"))
        check_positive("grammar_compile_timeout", self.grammar_compile_timeout, allow_none=False)
        if self.cuda_graph_sizes is not None:
            try:
                parse_int_list(self.cuda_graph_sizes)
            except (ValueError, AttributeError) as exc:
                raise ConfigError("cuda_graph_sizes", str(exc)) from None
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", parse_rope_scaling(self.rope_scaling))
        if self.cache.kv_cache_dtype == "float32" and self.dtype in ("bfloat16", "float16"):
            raise ConfigError("kv_cache_dtype", f"float32 needs an fp32 model, not dtype={self.dtype}")
        self._check_yoco()
        if self.store.kv_store_encrypt and self.disaggregation.cluster_key_file is None:
            raise ConfigError("kv_store_encrypt", "encrypting stored KV chunks needs --cluster-key-file")
        if self.parallel.world_size > 1:
            if self.speculative.enabled:
                raise ConfigError(
                    "speculative_method", "speculative decoding over several ranks is not supported yet"
                )
            if self.store.enabled:
                raise ConfigError("kv_store", "the KV store over several ranks is not supported yet")
            if self.quantization not in (None, "none") and self.parallel.tensor_parallel_size > 1:
                raise ConfigError(
                    "quantization", f"{self.quantization} with tensor parallelism is not supported yet"
                )
            if self.disaggregation.role != "both":
                raise ConfigError("role", "prefill/decode roles over several ranks are not supported yet")
            if self.disaggregation.kv_events_endpoint is not None:
                raise ConfigError("kv_events_endpoint", "KV events over several ranks are not supported yet")
        if self.scheduler.async_scheduling:
            self._check_async_scheduling()
        if self.store.enabled and not self.cache.enable_prefix_caching:
            raise ConfigError(
                "kv_store", "the KV store and host tier need prefix caching (enable_prefix_caching)"
            )
        pd = self.disaggregation
        if pd.role == "encode":
            self._check_encode_role()
            return
        if pd.role != "both" and not self.cache.enable_prefix_caching:
            raise ConfigError(
                "role", f"a {pd.role} engine hands KV off by prefix hash: it needs enable_prefix_caching"
            )
        if pd.role != "both" and pd.kv_transfer == "store" and self.store.kv_store is None:
            raise ConfigError(
                "kv_transfer", f"kv_transfer='store' needs a shared --kv-store on the {pd.role} engine"
            )

    def _check_encode_role(self) -> None:
        """An encoder runs the vision tower alone: options of the LLM, its KV cache or the KV
        handoff between LLM engines mean nothing there, and are refused rather than ignored."""
        pd = self.disaggregation
        meaningless = (
            ("kv_transfer", pd.kv_transfer != "direct", "its embeddings go out over the direct transfer"),
            ("kv_events_endpoint", pd.kv_events_endpoint is not None, "it has no KV cache"),
            ("kv_store", self.store.enabled, "it has no KV cache"),
            ("speculative_method", self.speculative.enabled, "it generates nothing"),
            ("yoco_prefill_truncation", self.yoco_prefill_truncation != "off", "it runs no prefill"),
            ("rope_scaling", self.rope_scaling is not None, "it runs no language model"),
            ("async_scheduling", self.scheduler.async_scheduling, "it schedules nothing"),
            ("tensor_parallel_size", self.parallel.world_size > 1, "it runs on one rank"),
        )
        for name, given, why in meaningless:
            if given:
                raise ConfigError(name, f"not an option of an encode-role server ({why})")

    def _check_yoco(self) -> None:
        """The values alone; the model checks the keep length against its window (check_engine)."""
        check_choice("yoco_prefill_truncation", self.yoco_prefill_truncation, ("off", "compact"))
        keep = self.yoco_prefill_keep_tokens
        if self.yoco_prefill_truncation == "off":
            if keep is not None:
                raise ConfigError(
                    "yoco_prefill_keep_tokens", "only used with yoco_prefill_truncation='compact'"
                )
            return
        if keep is None:
            raise ConfigError(
                "yoco_prefill_keep_tokens",
                "yoco_prefill_truncation='compact' needs the number of tokens to keep",
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError("yoco_prefill_keep_tokens", f"must be an integer >= 1, got {keep!r}")

    def _check_async_scheduling(self) -> None:
        """What async scheduling does not cover: features that read or write the KV cache or the
        drafts beside the forward thread, or step with other ranks."""
        unsupported = (
            ("speculative_method", self.speculative.enabled, "speculative decoding"),
            ("kv_store", self.store.enabled, "the KV store and host tier"),
            ("role", self.disaggregation.role != "both", "prefill/decode roles"),
            ("encoders", bool(self.disaggregation.encoders), "image encoders"),
            ("data_parallel_size", self.parallel.world_size > 1, "several ranks"),
        )
        for name, used, what in unsupported:
            if used:
                raise ConfigError(
                    "async_scheduling", f"{what} ({name}) cannot be combined with async scheduling"
                )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Options given flat (`block_size=32, kv_store="dir"`), each routed to its sub-config."""
        top = {f.name for f in dataclasses.fields(cls)} - set(SUB_CONFIGS)
        owners = {f.name: group for group, sub in SUB_CONFIGS.items() for f in dataclasses.fields(sub)}
        unknown = set(kwargs) - top - set(owners)
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}; known: {sorted(top | set(owners))}")
        grouped: dict[str, dict[str, Any]] = {group: {} for group in SUB_CONFIGS}
        for name, value in kwargs.items():
            if name in owners:
                grouped[owners[name]][name] = value
        return cls(
            **{name: value for name, value in kwargs.items() if name in top},
            **{group: SUB_CONFIGS[group](**values) for group, values in grouped.items()},
        )

    def to_kwargs(self) -> dict[str, Any]:
        """The inverse of from_kwargs: every option by its flat name."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SUB_CONFIGS}
        for group in SUB_CONFIGS:
            sub = getattr(self, group)
            flat.update({f.name: getattr(sub, f.name) for f in dataclasses.fields(sub)})
        return flat

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with some options changed, given flat."""
        return EngineConfig.from_kwargs(**{**self.to_kwargs(), **kwargs})
