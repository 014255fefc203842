"""Published API prices, as plain data with the date they were read. USD per million tokens.

Prices change; a preset is a dated fact, not a current quote. Pass your own as
``in_miss,in_hit,out`` on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Prices:
    """USD per 1M tokens: input on a prefix-cache miss, input on a hit, output."""

    input_miss: float
    input_hit: float
    output: float
    name: str = "custom"
    as_of: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        for field_name in ("input_miss", "input_hit", "output"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"price {field_name} must be >= 0, got {getattr(self, field_name)}")


_DEEPSEEK_PRICING_PAGE = "DeepSeek API docs, Models & Pricing (api-docs.deepseek.com/quick_start/pricing)"

PRESETS: dict[str, Prices] = {
    preset.name: preset
    for preset in (
        # Cache-hit input is 1/50 of a miss: the ratio the economics issue uses.
        Prices(0.14, 0.0028, 0.28, "deepseek-v4-flash", "2026-07", _DEEPSEEK_PRICING_PAGE),
        Prices(0.435, 0.003625, 0.87, "deepseek-v4-pro", "2026-07", _DEEPSEEK_PRICING_PAGE),
        Prices(0.28, 0.028, 0.42, "deepseek-v3.2", "2025-09-29", _DEEPSEEK_PRICING_PAGE),
        # The prices DeepSeek's own cost-and-margin disclosure (Open Source Week, day 6) used.
        Prices(0.55, 0.14, 2.19, "deepseek-r1", "2025-01-20", _DEEPSEEK_PRICING_PAGE),
        Prices(0.27, 0.07, 1.10, "deepseek-v3", "2025-02-08", _DEEPSEEK_PRICING_PAGE),
    )
}


def parse_prices(spec: str) -> Prices:
    """A preset name, or three numbers ``in_miss,in_hit,out`` in USD per 1M tokens."""
    if spec in PRESETS:
        return PRESETS[spec]
    parts = [part.strip() for part in spec.split(",")]
    if len(parts) != 3:
        raise ValueError(
            f"--prices must be a preset ({', '.join(PRESETS)}) or 'in_miss,in_hit,out' in USD per 1M tokens, "
            f"got {spec!r}"
        )
    try:
        miss, hit, out = (float(part) for part in parts)
    except ValueError as exc:
        raise ValueError(f"--prices: not a number in {spec!r}") from exc
    return Prices(miss, hit, out)
