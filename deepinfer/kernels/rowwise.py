"""ctypes binding of rowwise.c: RMSNorm (with the residual add) and rotary embedding for fp32 rows,
SwiGLU for bf16 rows; and for the sampler, fp32 logits' greedy argmax, their draws (temperature,
top-k, top-p, min-p) and their logprobs.

Callers use these for contiguous fp32 CPU tensors and PyTorch otherwise; `rowwise_kernels()` is
None when no C compiler is available.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from deepinfer.kernels import isa
from deepinfer.kernels.build import load_kernel_library

_LOGPROB_TOP = 20  # rowwise.c's LOGPROB_TOP: the most logprobs a row asks for


class RowwiseKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._norm = lib.rms_norm_rows
        self._norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        self._norm.restype = None
        self._rotary = lib.rotary_rows
        self._rotary.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        self._rotary.restype = ctypes.c_int
        self.rotary_address = ctypes.cast(self._rotary, ctypes.c_void_p).value  # for decode_layers.c
        self._swiglu_bf16 = lib.swiglu_rows_bf16
        self._swiglu_bf16.argtypes = [ptr, i64, ptr, i64, i64]
        self._swiglu_bf16.restype = None
        self._argmax = lib.argmax_rows
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr]
        self._argmax.restype = None
        self._draw = lib.draw_rows
        self._draw.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
        self._draw.restype = None
        self._logprobs = lib.logprob_rows
        self._logprobs.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
        self._logprobs.restype = None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(v), v) for v = x + residual, or (norm(x), None). x, residual: contiguous fp32 [..., dim]."""
        dim = x.shape[-1]
        out = torch.empty_like(x)
        summed = None if residual is None else torch.empty_like(x)
        self._norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), None if summed is None else summed.data_ptr(),
            weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
        )  # fmt: skip
        return out, summed

    def rotary_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, dim] in place (heads and values contiguous); cos/sin [P, dim] fp32."""
        tokens, heads, dim = x.shape
        status = self._rotary(
            x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], tokens, heads, dim,
            x.stride(0),
        )  # fmt: skip
        if status:
            raise IndexError(f"a position is outside the rotary tables (0..{cos.shape[0] - 1})")

    def swiglu_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16(silu(gate) * up) for bf16 CPU rows gate_up [N, 2I] = [gate | up] (values
        contiguous), computed in fp32 and rounded once: a new bf16 [N, I]. Reads gate_up only."""
        if (
            gate_up.dtype is not torch.bfloat16
            or gate_up.dim() != 2
            or not gate_up.is_cpu
            or gate_up.shape[1] % 2
        ):
            raise ValueError(
                f"expected bfloat16 CPU rows [N, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}"
            )
        if gate_up.stride(1) != 1:
            gate_up = gate_up.contiguous()
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, dim, dtype=torch.bfloat16)
        self._swiglu_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, dim)
        return out

    def argmax(self, x: torch.Tensor) -> list[int]:
        """torch.argmax(x, dim=-1).tolist() for fp32 CPU rows x [N, V] (values contiguous): the first
        largest value's position, the first NaN's where a row has one. Reads x only."""
        x = _logit_rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out.tolist()

    def draw(
        self,
        x: torch.Tensor,
        rows: list[int],
        params: list[tuple[float, int, float, float]],
        uniforms: list[float],
    ) -> list[int]:
        """For each t, an inverse-CDF draw with uniforms[t] in [0, 1) from row rows[t] of x,
        params[t] = (temperature > 0, top_k, top_p, min_p): softmax(x / temperature) over the
        tokens at or above the top_k-th largest (0: all), then the tokens whose strictly heavier
        tokens hold less than top_p of the mass (ties stay together), then those of at least min_p
        times the top probability; the first token whose running share of what is kept reaches the
        uniform. Tokens more than 87 temperatures below the best (-inf among them) weigh nothing.
        fp32 CPU rows x [N, V] (values contiguous); reads x only."""
        x = _logit_rows(x)
        if not all(0 <= r < x.shape[0] for r in rows):
            raise IndexError(f"rows {rows} outside 0..{x.shape[0] - 1}")
        if not all(setting[0] > 0 for setting in params):
            raise ValueError(f"temperatures must be positive, got {[setting[0] for setting in params]}")
        index = torch.tensor(rows, dtype=torch.int64)
        temperature = torch.tensor([setting[0] for setting in params], dtype=torch.float32)
        top_k = torch.tensor([setting[1] for setting in params], dtype=torch.int64)
        top_p = torch.tensor([setting[2] for setting in params], dtype=torch.float32)
        min_p = torch.tensor([setting[3] for setting in params], dtype=torch.float32)
        draws = torch.tensor(uniforms, dtype=torch.float64)
        out = torch.empty(len(rows), dtype=torch.int64)
        self._draw(
            x.data_ptr(), x.stride(0), index.data_ptr(), len(rows), x.shape[1], temperature.data_ptr(),
            top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), draws.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        picks = out.tolist()
        if any(pick < 0 for pick in picks):
            raise MemoryError("no scratch for a truncated row's draw")
        return picks

    def logprobs(
        self, x: torch.Tensor, rows: list[int], temperatures: list[float], tokens: list[int], tops: list[int]
    ) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
        """For each t: row rows[t] of x's log_softmax at temperatures[t] > 0, as (the logprob of
        tokens[t], its rank: 1 + the tokens strictly more likely, the tops[t] <= 20 most likely
        (token, logprob), the more likely first and the lower token first among equals); None
        for a row holding a NaN or +inf. fp32 CPU rows x [N, V] (values contiguous); reads x only."""
        x = _logit_rows(x)
        if not all(0 <= r < x.shape[0] for r in rows) or not all(0 <= t < x.shape[1] for t in tokens):
            raise IndexError(f"rows {rows} or tokens {tokens} outside {tuple(x.shape)}")
        if not all(t > 0 for t in temperatures) or not all(0 <= k <= _LOGPROB_TOP for k in tops):
            raise ValueError(f"temperatures must be positive and tops 0..{_LOGPROB_TOP}")
        count = len(rows)
        lp, rank = torch.empty(count, dtype=torch.float32), torch.empty(count, dtype=torch.int64)
        top_ids = torch.empty(count, _LOGPROB_TOP, dtype=torch.int64)
        top_values = torch.empty(count, _LOGPROB_TOP, dtype=torch.float32)
        index = torch.tensor(rows, dtype=torch.int64)  # kept alive until the call returns
        temps = torch.tensor(temperatures, dtype=torch.float32)
        chosen = torch.tensor(tokens, dtype=torch.int64)
        wanted = torch.tensor(tops, dtype=torch.int64)
        self._logprobs(
            x.data_ptr(), x.stride(0), index.data_ptr(), count, x.shape[1], temps.data_ptr(), chosen.data_ptr(),
            wanted.data_ptr(), lp.data_ptr(), rank.data_ptr(), top_ids.data_ptr(), top_values.data_ptr(),
        )  # fmt: skip
        answers: list[tuple[float, int, list[tuple[int, float]]] | None] = []
        for t, (value, place, k) in enumerate(zip(lp.tolist(), rank.tolist(), tops)):
            top = list(zip(top_ids[t, :k].tolist(), top_values[t, :k].tolist()))
            answers.append(None if place < 0 else (value, place, top))
        return answers


def _logit_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the sampler's kernels read it: fp32 CPU rows [N, V > 0] with contiguous values (a
    copy where they are not); ValueError for anything else."""
    if x.dtype is not torch.float32 or x.dim() != 2 or not x.is_cpu or x.shape[1] == 0:
        raise ValueError(f"expected float32 CPU rows [N, V > 0], got {x.dtype} {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def fits(x: torch.Tensor) -> bool:
    """Whether the C path takes this tensor: fp32, on the CPU, contiguous."""
    return x.dtype is torch.float32 and x.is_cpu and x.is_contiguous()


def rowwise_kernels(target_flags: tuple[str, ...] | None = None) -> RowwiseKernels | None:
    """The kernels built for `target_flags` (default: kernels/isa.py's level); None without a C compiler."""
    return _rowwise_kernels(isa.compiler_flags() if target_flags is None else target_flags)


@cache
def _rowwise_kernels(target_flags: tuple[str, ...]) -> RowwiseKernels | None:
    lib = load_kernel_library("rowwise", ("-ffp-contract=off",), target_flags)
    return None if lib is None else RowwiseKernels(lib)
