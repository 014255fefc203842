from __future__ import annotations

import pytest

from deepinfer.bench.cli import main
from deepinfer.bench.economics import (
    CardThroughput,
    blended_input_price,
    card_economics,
    gross_margin,
    hit_ratio_table,
    throughput_from_result,
)
from deepinfer.bench.prices import PRESETS, Prices, parse_prices


def test_38_revenue_and_7_cost_per_card_hour_is_82_percent_margin() -> None:
    margin = gross_margin(38.0, 7.0)
    assert margin == pytest.approx(31 / 38)
    assert f"{margin:.0%}" == "82%"


def test_token_throughput_and_prices_reproduce_the_card_hour_example() -> None:
    # 40M input tokens per card-hour, half of them cache hits, and 13.9M output tokens:
    # 20M × $0.50 + 20M × $0.01 + 13.9M × $2.00 = $10 + $0.20 + $27.80 = $38.
    prices = Prices(input_miss=0.50, input_hit=0.01, output=2.00)
    throughput = CardThroughput(input_tokens_per_s=40e6 / 3600, output_tokens_per_s=13.9e6 / 3600)
    economics = card_economics(throughput, prices, hit_ratio=0.5, card_cost_per_hour=7.0)
    assert economics.revenue_per_card_hour == pytest.approx(38.0)
    assert economics.gross_profit_per_card_hour == pytest.approx(31.0)
    assert f"{economics.gross_margin:.0%}" == "82%"
    assert economics.cost_per_million_output_tokens == pytest.approx(7.0 / 13.9)
    assert economics.cost_per_million_tokens == pytest.approx(7.0 / 53.9)


def test_preset_hit_price_is_one_fiftieth_of_a_miss_and_the_table_shows_it() -> None:
    prices = PRESETS["deepseek-v4-flash"]
    assert prices.as_of
    assert prices.input_hit == pytest.approx(prices.input_miss / 50)
    throughput = CardThroughput(input_tokens_per_s=1000.0, output_tokens_per_s=0.0)
    table = {row.hit_ratio: row for row in hit_ratio_table(throughput, prices, card_cost_per_hour=1.0)}
    # Input-only revenue at a 100% hit ratio is 1/50 of the all-miss revenue.
    assert table[1.0].revenue_per_card_hour == pytest.approx(table[0.0].revenue_per_card_hour / 50)
    assert table[0.5].blended_input_price == pytest.approx((prices.input_miss + prices.input_hit) / 2)
    revenues = [table[r].revenue_per_card_hour for r in sorted(table)]
    assert revenues == sorted(revenues, reverse=True)


def test_blended_price_and_bad_inputs() -> None:
    prices = parse_prices("1,0.02,3")
    assert (prices.input_miss, prices.input_hit, prices.output) == (1.0, 0.02, 3.0)
    assert blended_input_price(prices, 0.9) == pytest.approx(0.1 + 0.9 * 0.02)
    with pytest.raises(ValueError, match="hit ratio"):
        blended_input_price(prices, 1.5)
    with pytest.raises(ValueError, match="--prices"):
        parse_prices("nope")
    with pytest.raises(ValueError, match="not a number"):
        parse_prices("1,x,3")
    with pytest.raises(ValueError, match="input_hit"):
        Prices(1.0, -1.0, 1.0)
    assert gross_margin(0.0, 7.0) is None


def test_throughput_from_result_picks_best_run_and_divides_by_cards() -> None:
    def run(out: float, cards: int) -> dict:
        summary = {"input_throughput": 4 * out, "output_throughput": out, "num_cards": cards}
        return {"summary": {**summary, "prefix_cache_hit_rate": 0.25}}

    result = {"runs": [run(10.0, 2), run(30.0, 2), run(20.0, 2)]}
    throughput, hit, index = throughput_from_result(result)
    assert index == 1
    assert throughput.output_tokens_per_s == pytest.approx(15.0)
    assert throughput.input_tokens_per_s == pytest.approx(60.0)
    assert hit == 0.25
    with pytest.raises(ValueError, match="run-index"):
        throughput_from_result(result, 5)
    with pytest.raises(ValueError, match="runs"):
        throughput_from_result({})


def test_economics_command_prints_the_margin(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "economics",
            "--input-tokens-per-s", str(40e6 / 3600),
            "--output-tokens-per-s", str(13.9e6 / 3600),
            "--hit-ratio", "0.5",
            "--prices", "0.5,0.01,2",
            "--card-cost-per-hour", "7",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "| gross margin | 82% |" in out
    assert "| revenue / card-hour (USD) | 38.0000 |" in out


def test_economics_command_rejects_bad_prices(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["economics", "--output-tokens-per-s", "10", "--prices", "1,2", "--card-cost-per-hour", "7"])
    assert code == 2
    assert "--prices" in capsys.readouterr().err
