"""Random walks through a grammar: the matcher's mask decides every token.

A walk samples uniformly from the allowed tokens. Uniform sampling inside a free-text field
almost never picks a closing token (a handful among ~49k), so after a random budget of steps the
walk prefers *closers*: if one of a few short closing texts (`"`, `}`, `]`, a format's closing
tag) is accepted in full by the grammar, it is taken half the time; otherwise it samples uniformly among the
allowed one-character tokens (a character-level walk, which leaves a regex like `[a-z]+/` in a few
steps), or among all allowed tokens if none is one character. Every token still comes from the
mask and goes through `accept_token`, which is what is under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.structured.backend import GrammarMatcher

JSON_CLOSERS = ('"', "}", "]")
_SHORT_TOKENS: dict[int, np.ndarray] = {}


def short_token_flags(tokenizer, vocab_size: int) -> np.ndarray:
    """flags[t] is True when token t decodes to exactly one character."""
    key = id(tokenizer)
    if key not in _SHORT_TOKENS:
        flags = np.zeros(vocab_size, dtype=bool)
        for t in range(min(vocab_size, len(tokenizer))):
            flags[t] = len(tokenizer.decode([t])) == 1
        _SHORT_TOKENS[key] = flags
    return _SHORT_TOKENS[key]


@dataclass(slots=True)
class Walk:
    token_ids: list[int]
    ended_with_eos: bool
    steps: int


def allowed_tokens(bitmask: np.ndarray, row: int, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def random_walk(
    matcher: GrammarMatcher,
    tokenizer,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    rng: np.random.Generator,
    closers: tuple[str, ...] = JSON_CLOSERS,
    max_budget: int = 48,
    max_steps: int = 3000,
) -> Walk:
    closer_ids = [tokenizer.encode(c, add_special_tokens=False) for c in closers]
    short = short_token_flags(tokenizer, vocab_size).copy()
    short[list(eos_ids)] = True  # ending is always one of the short choices
    budget = int(rng.integers(0, max_budget + 1))
    bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    tokens: list[int] = []
    pending: list[int] = []  # the rest of a closer being written, one masked token per step
    for step in range(max_steps):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, 0, vocab_size)
        assert allowed.size, f"empty mask after {tokenizer.decode(tokens)!r}"
        if matcher.is_terminated():
            assert set(allowed.tolist()) <= set(eos_ids), "only EOS may follow a terminated grammar"
        allowed_set = set(allowed.tolist())
        token: int | None = None
        if pending and pending[0] in allowed_set:
            token = pending.pop(0)
        elif step >= budget and not matcher.is_terminated():
            # The mask may refuse a valid but non-canonical split of a forced text, so a closer
            # only counts when its first token is in the mask now.
            fitting = [
                ids
                for ids in closer_ids
                if ids[0] in allowed_set and matcher.validate_tokens(ids) == len(ids)
            ]
            # Half the time only: a closer can be plain content too (`}` inside a string that an
            # email format keeps open), and then the character-level walk must make progress.
            if fitting and rng.random() < 0.5:
                pending = list(fitting[int(rng.integers(len(fitting)))])
                token = pending.pop(0)
            else:
                single = allowed[short[allowed]]
                token = int(rng.choice(single if single.size else allowed))
        if token is None:
            pending = []
            token = int(rng.choice(allowed))
        assert token in allowed_set
        assert matcher.accept_token(token), matcher.error
        if token in eos_ids:
            return Walk(tokens, True, step)
        tokens.append(token)
    raise AssertionError(f"walk did not terminate in {max_steps} steps: {tokenizer.decode(tokens)[:300]!r}")
