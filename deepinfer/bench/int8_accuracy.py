"""How far `quantization="int8"` moves the default model's next-token distributions from fp32.

    .venv/bin/python -m deepinfer.bench.int8_accuracy

Scores a few fixed texts with both engines and reports, over every position, the mean KL
divergence KL(fp32 || int8) in nats and how often the two agree on the most likely token.
"""

from __future__ import annotations

import torch

from deepinfer import LLM

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}"
TEXTS = [
    CHAT.format(
        "What is the capital of France? Explain briefly.",
        "The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
    ),
    CHAT.format(
        "Write a haiku about the sea.",
        "Waves fold into foam,\nthe tide keeps its patient time,\nsalt wind on my face.",
    ),
    "The history of the Roman empire begins with the founding of Rome by Romulus in 753 BC, "
    "and its long decline ended with the fall of Constantinople in 1453.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]


def main() -> None:
    fp32 = LLM(kv_cache_memory=64 << 20)
    int8 = LLM(kv_cache_memory=64 << 20, quantization="int8")
    tokenizer = fp32.get_tokenizer()
    kls, agreements, positions = [], [], 0
    for text in TEXTS:
        ids = tokenizer.encode(text)
        reference = torch.log_softmax(fp32.engine.core.score(ids), dim=-1)
        quantized = torch.log_softmax(int8.engine.core.score(ids), dim=-1)
        kls.append((reference.exp() * (reference - quantized)).sum(-1))
        agreements.append(reference.argmax(-1) == quantized.argmax(-1))
        positions += len(ids)
    kl = torch.cat(kls).mean().item()
    agreement = torch.cat(agreements).float().mean().item()
    print(
        f"{len(TEXTS)} texts, {positions} positions: mean KL(fp32 || int8) {kl:.4f} nats, top-1 agreement {agreement:.1%}"
    )


if __name__ == "__main__":
    main()
