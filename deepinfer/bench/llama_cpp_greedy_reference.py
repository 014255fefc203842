"""llama.cpp's greedy continuations of the 16 held prompts, stored as a test fixture.

    .venv/bin/python -m deepinfer.bench.llama_cpp_greedy_reference [--llama-server PATH]

Runs `llama-server` (deepinfer/bench/build_llama_server.sh builds it) on the default model's GGUF and asks
it, one prompt at a time, for up to 32 tokens at temperature 0 (ending at an end token, which is
not stored), the prompt given as the token ids our tokenizer makes (so both engines continue the
very same ids). EOS is not ignored: llama-server's ignore_eos bans the end tokens, which changes
the continuation where the model would end, while our engine's only stops at them. The ids and
llama.cpp's tokens go to tests/engine/data/llama_cpp_greedy.json, which
tests/engine/test_gguf_quantization.py compares our `quantization="gguf"` engine with; `make test`
needs no llama.cpp. Rerun it when the default model or the prompts change.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from deepinfer.bench.report import utc_now_iso
from deepinfer.bench.server_process import running_server
from deepinfer.model.loader.source import default_model_path, file_digest

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "engine" / "data" / "llama_cpp_greedy.json"
NEW_TOKENS = 32
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    CHAT.format("What is the capital of France?"),
    CHAT.format("Write a haiku about the sea."),
    CHAT.format("Explain photosynthesis to a ten-year-old."),
    CHAT.format("Give me three tips for learning to play the guitar."),
    CHAT.format("Translate 'good morning, how are you?' into Spanish."),
    CHAT.format("Write a Python function that reverses a string."),
    CHAT.format("What are the main causes of the French Revolution?"),
    CHAT.format("Summarize the plot of Romeo and Juliet in two sentences."),
    CHAT.format("How do I make a cup of green tea?"),
    CHAT.format("List the planets of the solar system in order."),
    CHAT.format("Why is the sky blue?"),
    CHAT.format("Suggest a name for a small bakery by the harbour."),
    "The history of the Roman empire begins with",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village at the edge of a forest,",
    "The three laws of thermodynamics are",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--llama-server", default=shutil.which("llama-server") or "build/llama-bin/llama-server"
    )
    parser.add_argument("--port", type=int, default=18790)
    parser.add_argument(
        "--compare",
        metavar="ARGS",
        help="instead of writing the fixture, run llama-server with these extra arguments (e.g. "
        "'-fa off') and count the prompts whose continuation equals the fixture's: llama.cpp against itself",
    )
    args = parser.parse_args()

    from deepinfer.model.loader.load import load_model

    gguf = default_model_path()
    import torch

    tokenizer = load_model(None, torch.float32, torch.device("cpu"), "gguf").tokenizer
    end_ids = set(tokenizer.eos_token_ids)
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=60)
    version_line = next(line for line in (version.stdout + version.stderr).splitlines() if "version" in line)
    command = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(args.port),
               "-np", "1", "-c", "2048", "-t", "2", "--no-webui", *(args.compare or "").split()]  # fmt: skip
    base = f"http://127.0.0.1:{args.port}"
    cases = []
    with running_server(command, base, 300, ready_path="/health"):
        for text in PROMPTS:
            ids = tokenizer.encode(text)
            body = {
                "prompt": ids,
                "n_predict": NEW_TOKENS,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
            }
            reply = httpx.post(f"{base}/completion", json=body, timeout=300).json()
            tokens = [t for t in reply["tokens"] if t not in end_ids]
            if not tokens or (len(tokens) != NEW_TOKENS and reply.get("stop_type") != "eos"):
                sys.exit(f"llama-server returned {len(tokens)} tokens for {text!r}: {reply}")
            cases.append({"text": text, "prompt_ids": ids, "llama_cpp_tokens": tokens})
    if args.compare is not None:
        stored = json.loads(FIXTURE.read_text())["cases"]
        same = [case["llama_cpp_tokens"] == old["llama_cpp_tokens"] for case, old in zip(cases, stored)]
        print(f"llama-server {args.compare!r}: {sum(same)} of {len(same)} continuations equal the fixture's")
        return
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    fixture = {
        "about": "llama.cpp's greedy continuations (temperature 0, up to an end token, not stored) of held prompts; "
        "written by deepinfer/bench/llama_cpp_greedy_reference.py",
        "date": utc_now_iso(),
        "model": gguf.name,
        "model_sha256": file_digest(gguf),
        "llama_cpp": version_line.strip(),
        "command": " ".join(command),
        "new_tokens": NEW_TOKENS,
        "cases": cases,
    }
    FIXTURE.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {FIXTURE}")


if __name__ == "__main__":
    main()
