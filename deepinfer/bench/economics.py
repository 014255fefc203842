"""`bench economics`: what a measured throughput earns and costs per card-hour.

revenue/card-hour = input tokens/card-hour × [(1 − h)·p_miss + h·p_hit] + output tokens/card-hour × p_out
gross margin      = (revenue − cost) / revenue
where h is the prefix-cache hit ratio of input tokens and prices are per 1M tokens. The hit-ratio
table holds the measured throughput fixed and varies h, which isolates the price effect; a cache
hit also saves prefill compute, which shows up only in a throughput measured at that hit ratio.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from deepinfer.bench.prices import Prices
from deepinfer.bench.report import markdown_table, provenance, read_json, write_json

DEFAULT_HIT_RATIOS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
SECONDS_PER_HOUR = 3600.0
PER_MILLION = 1_000_000.0


@dataclass(slots=True)
class CardThroughput:
    """Tokens per second for one card (a measured total divided by the cards that served it)."""

    input_tokens_per_s: float
    output_tokens_per_s: float

    def __post_init__(self) -> None:
        if self.input_tokens_per_s < 0 or self.output_tokens_per_s < 0:
            raise ValueError("token throughputs must be >= 0")


@dataclass(slots=True)
class Economics:
    hit_ratio: float
    input_tokens_per_card_hour: float
    output_tokens_per_card_hour: float
    blended_input_price: float
    revenue_per_card_hour: float
    cost_per_card_hour: float
    gross_profit_per_card_hour: float
    gross_margin: float | None
    cost_per_million_output_tokens: float | None
    cost_per_million_tokens: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def blended_input_price(prices: Prices, hit_ratio: float) -> float:
    """USD per 1M input tokens when a fraction ``hit_ratio`` of them hit the prefix cache."""
    _check_ratio(hit_ratio)
    return (1.0 - hit_ratio) * prices.input_miss + hit_ratio * prices.input_hit


def gross_margin(revenue: float, cost: float) -> float | None:
    """(revenue − cost) / revenue; None when there is no revenue to take a margin of."""
    if revenue <= 0:
        return None
    return (revenue - cost) / revenue


def card_economics(
    throughput: CardThroughput, prices: Prices, hit_ratio: float, card_cost_per_hour: float
) -> Economics:
    if card_cost_per_hour < 0:
        raise ValueError(f"card_cost_per_hour must be >= 0, got {card_cost_per_hour}")
    input_per_hour = throughput.input_tokens_per_s * SECONDS_PER_HOUR
    output_per_hour = throughput.output_tokens_per_s * SECONDS_PER_HOUR
    input_price = blended_input_price(prices, hit_ratio)
    revenue = input_per_hour / PER_MILLION * input_price + output_per_hour / PER_MILLION * prices.output
    total_per_hour = input_per_hour + output_per_hour
    return Economics(
        hit_ratio=hit_ratio,
        input_tokens_per_card_hour=input_per_hour,
        output_tokens_per_card_hour=output_per_hour,
        blended_input_price=input_price,
        revenue_per_card_hour=revenue,
        cost_per_card_hour=card_cost_per_hour,
        gross_profit_per_card_hour=revenue - card_cost_per_hour,
        gross_margin=gross_margin(revenue, card_cost_per_hour),
        cost_per_million_output_tokens=(
            card_cost_per_hour / output_per_hour * PER_MILLION if output_per_hour else None
        ),
        cost_per_million_tokens=card_cost_per_hour / total_per_hour * PER_MILLION if total_per_hour else None,
    )


def hit_ratio_table(
    throughput: CardThroughput,
    prices: Prices,
    card_cost_per_hour: float,
    ratios: Sequence[float] = DEFAULT_HIT_RATIOS,
) -> list[Economics]:
    return [card_economics(throughput, prices, ratio, card_cost_per_hour) for ratio in ratios]


def throughput_from_result(
    result: dict[str, Any], run_index: int | None = None
) -> tuple[CardThroughput, float | None, int]:
    """Per-card throughput and measured hit ratio of one run of a `bench serve` result.

    Without ``run_index`` the run with the highest output throughput is taken (a sweep's best).
    Returns (throughput, hit ratio or None when the server reported none, the run's index).
    """
    runs = result.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError("the result has no 'runs': pass a JSON written by `bench serve --result-json`")
    if run_index is None:
        run_index = max(range(len(runs)), key=lambda i: runs[i]["summary"]["output_throughput"])
    if not 0 <= run_index < len(runs):
        raise ValueError(f"--run-index must be within [0, {len(runs) - 1}], got {run_index}")
    summary = runs[run_index]["summary"]
    cards = int(summary.get("num_cards") or 1)
    throughput = CardThroughput(summary["input_throughput"] / cards, summary["output_throughput"] / cards)
    return throughput, summary.get("prefix_cache_hit_rate"), run_index


def format_economics(headline: Economics, table: Sequence[Economics], prices: Prices) -> str:
    source = f"{prices.name}" + (f", as of {prices.as_of}" if prices.as_of else "")
    lines = [
        f"Prices ({source}), USD per 1M tokens: input miss {prices.input_miss:g}, "
        f"input hit {prices.input_hit:g}, output {prices.output:g}",
        "",
        markdown_table(
            ["metric", "value"],
            [
                ["prefix-cache hit ratio", f"{headline.hit_ratio:.1%}"],
                ["input tokens / card-hour", round(headline.input_tokens_per_card_hour)],
                ["output tokens / card-hour", round(headline.output_tokens_per_card_hour)],
                ["revenue / card-hour (USD)", headline.revenue_per_card_hour],
                ["cost / card-hour (USD)", headline.cost_per_card_hour],
                ["gross profit / card-hour (USD)", headline.gross_profit_per_card_hour],
                ["gross margin", _percent(headline.gross_margin)],
                ["cost per 1M output tokens (USD)", headline.cost_per_million_output_tokens],
                ["cost per 1M tokens, in+out (USD)", headline.cost_per_million_tokens],
            ],
            digits=4,
        ),
        "",
        "Effect of the cache-hit ratio at this throughput:",
        "",
        markdown_table(
            ["hit ratio", "input USD/1M", "revenue USD/card-h", "gross margin"],
            [
                [
                    f"{row.hit_ratio:.0%}",
                    row.blended_input_price,
                    row.revenue_per_card_hour,
                    _percent(row.gross_margin),
                ]
                for row in table
            ],
            digits=4,
        ),
    ]
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"hit ratio must be within [0, 1], got {ratio}")


# -- command line (`deepinfer bench economics`) ----------------------------------------


def add_parser(commands: Any) -> None:
    from deepinfer.bench.prices import PRESETS

    p = commands.add_parser("economics", help="revenue, cost and margin per card-hour")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--result", help="a `bench serve` result JSON")
    source.add_argument("--output-tokens-per-s", type=float, help="per card, instead of a result")
    p.add_argument("--input-tokens-per-s", type=float, default=0.0, help="per card, with the above")
    p.add_argument("--run-index", type=int)
    p.add_argument(
        "--prices", required=True, help=f"preset ({', '.join(PRESETS)}) or in_miss,in_hit,out USD/1M"
    )
    p.add_argument("--card-cost-per-hour", type=float, required=True, help="USD per card-hour")
    p.add_argument("--hit-ratio", type=float, help="override the measured prefix-cache hit ratio")
    p.add_argument("--json-out")


def run(args: argparse.Namespace) -> int:
    from deepinfer.bench.prices import parse_prices

    prices = parse_prices(args.prices)
    if args.result:
        throughput, measured_hit, index = throughput_from_result(read_json(args.result), args.run_index)
        print(f"using run {index} of {args.result}")
    else:
        throughput, measured_hit = CardThroughput(args.input_tokens_per_s, args.output_tokens_per_s), None
    hit = args.hit_ratio if args.hit_ratio is not None else measured_hit
    if hit is None:
        hit = 0.0
        source = "the result reports no cached tokens" if args.result else "no --hit-ratio given"
        print(f"{source}: hit ratio taken as 0")
    headline = card_economics(throughput, prices, hit, args.card_cost_per_hour)
    table = hit_ratio_table(throughput, prices, args.card_cost_per_hour)
    print(format_economics(headline, table, prices))
    if args.json_out:
        write_json(
            args.json_out,
            {
                "benchmark": "economics",
                **provenance(),
                "prices": {
                    "name": prices.name,
                    "as_of": prices.as_of,
                    "input_miss": prices.input_miss,
                    "input_hit": prices.input_hit,
                    "output": prices.output,
                },
                "headline": headline.to_dict(),
                "hit_ratio_table": [row.to_dict() for row in table],
            },
        )
    return 0
