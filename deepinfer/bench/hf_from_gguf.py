"""Write a GGUF's values as an HF checkpoint directory (config, tokenizer, safetensors).

    python -m deepinfer.bench.hf_from_gguf --dtype bfloat16   # build/peer-models/<gguf>-bfloat16

Peers that read only HF checkpoints (vLLM) and our own exact-weight path need the default
model as a directory. Nothing may be downloaded here, so the directory is made from the GGUF
we ship: transformers dequantizes its blocks (and undoes llama.cpp's q/k row permutation),
and the values are saved in the dtype asked for. Every engine given the directory then runs
the same numbers, those of the GGUF, not of the original bf16 release.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Written last: a directory that has it is complete (an interrupted write is redone).
_MARKER = "deepinfer-from-gguf.json"


def hf_dir_is_complete(folder: Path, gguf: Path, dtype: str) -> bool:
    """Whether ``folder`` holds a finished conversion of this GGUF in this dtype."""
    try:
        record = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return record == {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "dtype": dtype}


def peer_model_dir(gguf: Path, dtype: str) -> Path:
    """Where the benchmarks keep ``gguf``'s directory in ``dtype``, relative to the checkout."""
    return Path("build/peer-models") / f"{gguf.stem}-{dtype}"


def write_hf_dir(gguf: Path, folder: Path, dtype: str = "float32") -> Path:
    """The HF directory of ``gguf`` in ``dtype`` ("float32" or "bfloat16"), written once."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if hf_dir_is_complete(folder, gguf, dtype):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=getattr(torch, dtype))
    # The loaded model is dense; what marks it "quantized with gguf" only blocks saving it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / _MARKER).write_text(
        json.dumps({"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "dtype": dtype})
    )
    return folder


def main(argv: list[str] | None = None) -> Path:
    """Writes the directory (the embedded default model unless --gguf) and prints its path: the
    `--hf-dir` of `deepinfer bench peers` and the `--model` of our own bf16 runs."""
    parser = argparse.ArgumentParser(description="Write a GGUF's values as an HF checkpoint directory.")
    parser.add_argument("--gguf", help="the GGUF file (default: the embedded default model)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--out", help="the directory (default: build/peer-models/<gguf stem>-<dtype>)")
    args = parser.parse_args(argv)
    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from deepinfer.model.loader.source import default_model_path

        gguf = default_model_path()
    folder = write_hf_dir(gguf, Path(args.out) if args.out else peer_model_dir(gguf, args.dtype), args.dtype)
    print(folder)
    return folder


if __name__ == "__main__":
    main()
