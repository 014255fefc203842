"""The narrow interface between the engine and a grammar library.

The engine holds one `GrammarMatcher` per constrained sequence. Each step it asks the matchers to
write their allowed-token bitmask rows (`GrammarBackend.fill_bitmasks`, one call for the batch),
the runner applies the bitmask to the logits (`deepinfer.structured.bitmask`), and after sampling
the engine feeds each sampled token back with `accept_token`. Speculative decoding checks drafts
with `validate_tokens` and undoes rejected tokens with `rollback`.

Bitmask layout (shared with llguidance and xgrammar): a C-contiguous int32 array on the CPU,
`[rows, ceil(vocab_size / 32)]`; token t is allowed in a row when bit `t % 32` of word `t // 32`
is set. Any object with numpy's `ctypes.data` or torch's `data_ptr()` works, so this module needs
neither library.
"""

from __future__ import annotations

from typing import Any, Protocol

from deepinfer.structured.errors import GrammarError
from deepinfer.structured.spec import GrammarSpec
from deepinfer.structured.tokenizer_info import TokenizerInfo


class GrammarMatcher(Protocol):
    """The state of one sequence in its grammar."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write this sequence's allowed tokens into `bitmask[row]`.

        Once the grammar has terminated, only EOS is allowed."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) if the grammar forbids it."""

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept; the state is unchanged."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def is_terminated(self) -> bool:
        """True once nothing but EOS may follow (or EOS was accepted)."""

    def reset(self) -> None:
        """Back to the start of the grammar (a preempted sequence recomputed from scratch)."""

    @property
    def error(self) -> str | None:
        """Why the matcher entered its error state, or None."""


class CompiledGrammar(Protocol):
    """A compiled, immutable grammar: cheap to turn into fresh matchers, shared by requests."""

    spec: GrammarSpec

    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer."""

    name: str
    tokenizer_info: TokenizerInfo

    def compile(self, spec: GrammarSpec) -> CompiledGrammar | GrammarError:
        """Compile, blocking; may take long (the compile service runs it on a worker thread).

        Returns a GrammarError (never raises) for a spec it cannot enforce."""

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], bitmask: Any) -> None:
        """Fill several rows at once (possibly in parallel); rows not listed are left untouched."""

    @property
    def options_key(self) -> str:
        """Everything besides spec and tokenizer that changes compiled grammars (cache key part)."""


def row_pointer(bitmask: Any, row: int) -> tuple[int, int]:
    """(address, byte size) of one bitmask row, for numpy arrays and CPU torch tensors alike."""
    if hasattr(bitmask, "data_ptr"):  # torch.Tensor
        if bitmask.device.type != "cpu":
            raise ValueError("the grammar bitmask must live in CPU memory; copy it to the device afterwards")
        if str(bitmask.dtype) != "torch.int32" or bitmask.dim() != 2 or not bitmask.is_contiguous():
            raise ValueError("the grammar bitmask must be a contiguous 2-D int32 tensor")
        base = bitmask.data_ptr()
    else:
        if str(bitmask.dtype) != "int32" or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("the grammar bitmask must be a C-contiguous 2-D int32 array")
        base = bitmask.ctypes.data
    rows, words = int(bitmask.shape[0]), int(bitmask.shape[1])
    # The grammar library writes through this raw address: a bad row would corrupt memory.
    if not 0 <= row < rows:
        raise IndexError(f"bitmask row {row} out of range for {rows} rows")
    return base + row * words * 4, words * 4
