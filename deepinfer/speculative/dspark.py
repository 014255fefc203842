"""DSpark drafting (DeepSeek-V4.1's draft layers, model/dspark_v41.py): one non-causal block
forward gives every draft position's hidden state, then the drafts are drawn in order, each with
the Markov correction of the draft before it, each with the confidence head's estimate.
"""

from __future__ import annotations

import torch

from deepinfer.model.dspark_v41 import DSparkV41


@torch.inference_mode()
def draft(
    drafter: DSparkV41,
    target_features: torch.Tensor,  # [S, W, n * hidden]: positions p - W .. p - 1 (drafter.window)
    last_tokens: torch.Tensor,  # [S] the last token of each sequence (not yet run by the target)
    last_positions: torch.Tensor,  # [S] its position p
    num_drafts: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [S, k] (positions p + 1 ..), confidences [S, k]
    """Greedy (temperature 0: the argmax of the corrected logits) or sampled from
    softmax(logits / temperature) with `generator`. Feature rows at negative positions are
    ignored (any values)."""
    if num_drafts < 1:
        raise ValueError(f"num_drafts={num_drafts}: at least one draft")
    positions, visible = drafter.window(last_positions)
    if target_features.shape[:2] != positions.shape:
        raise ValueError(
            f"target features {tuple(target_features.shape)}: expected [S, W={positions.shape[1]}, ...] rows"
        )
    context = drafter.context_keys(target_features, positions)
    hidden = drafter.block_hidden(last_tokens, last_positions, context, visible, num_drafts)
    base = drafter.logits(hidden)  # [S, k, vocab]
    tokens = torch.empty(last_tokens.shape[0], num_drafts, dtype=torch.long, device=last_tokens.device)
    confidences = torch.empty(tokens.shape, device=last_tokens.device)
    previous = last_tokens
    for j in range(num_drafts):
        embedding, correction = drafter.markov(previous)
        confidences[:, j] = drafter.confidence(hidden[:, j], embedding, j)
        logits = base[:, j] + correction
        if temperature == 0.0:
            tokens[:, j] = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tokens[:, j] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        previous = tokens[:, j]
    return tokens, confidences
