"""Windowed per-arm acceptance from replicas' SGLang counters: parsing, restarts, the window, the ratio of sums."""

from __future__ import annotations

import math

from dfserve.gateway.scrape import CounterSample, increase, read_counters, windowed_accept_length

EXPOSITION = """# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="qwen",tp_rank="0"} 1200.0
sglang:generation_tokens_total{model_name="qwen",tp_rank="1"} 300.0
# HELP sglang:spec_verify_calls_total Number of speculative verify rounds.
# TYPE sglang:spec_verify_calls_total counter
sglang:spec_verify_calls_total{model_name="qwen",tp_rank="0"} 500.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 3.0
"""


def test_read_counters_sums_label_sets() -> None:
    sample = read_counters(EXPOSITION, 7.0)
    assert sample == CounterSample(7.0, 1500.0, 500.0)
    assert read_counters("# nothing here\n", 0.0) is None


def test_increase_counts_through_a_restart() -> None:
    assert increase([10, 15, 20]) == 10
    assert increase([10, 15, 3, 8]) == 5 + 3 + 5
    assert increase([5]) == 0


def test_windowed_accept_length_is_a_ratio_of_sums_within_the_window() -> None:
    fast = [CounterSample(0, 0, 0), CounterSample(50, 4000, 1000), CounterSample(100, 8000, 2000)]
    slow = [CounterSample(0, 0, 0), CounterSample(50, 100, 100), CounterSample(100, 200, 200)]
    assert windowed_accept_length([fast, slow], 100, 200) == (8000 + 200) / (2000 + 200)
    # Only the last 50 s: the first readings fall out of the window.
    assert windowed_accept_length([fast, slow], 100, 50) == (4000 + 100) / (1000 + 100)
    assert math.isnan(windowed_accept_length([[CounterSample(0, 5, 0)]], 0, 60))
