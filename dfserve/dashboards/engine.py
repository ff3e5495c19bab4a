"""The "dfserve engine" dashboard: SGLang's own metrics per deployment, under the names SGLang's server emits.

SGLang exports `sglang:`-prefixed names. Prometheus 2.x and 3.x store them unchanged; setups that rewrite them to
`sglang_` (as SGLang's bundled Grafana dashboard expects) build this dashboard with `names="underscore"`.
"""

from __future__ import annotations

from typing import Literal

from dfserve import metrics as m

from .grafana import RATE_INTERVAL, Dashboard, Panel, Row, Target, Variable
from .promql import QUANTILES, counter, quantile, rate_sum, selector, tokens_per_round

NameStyle = Literal["colon", "underscore"]
NAME_STYLES: tuple[NameStyle, ...] = ("colon", "underscore")
W = RATE_INTERVAL
D = m.DEPLOYMENT_LABEL
SCOPE = (f'{D}=~"$deployment"',)


def sglang_name(name: str, style: NameStyle) -> str:
    """A `sglang:` metric name as the Prometheus being queried stores it."""
    return name.replace("sglang:", "sglang_", 1) if style == "underscore" else name


def _gauge(title: str, description: str, name: str, unit: str = "short", width: int = 8) -> Panel:
    return Panel(title, description, (Target(f"sum by ({D}) ({selector(name, SCOPE)})", f"{{{{{D}}}}}"),), unit=unit,
                 width=width)


def _mean_gauge(title: str, description: str, name: str, unit: str = "short", width: int = 8) -> Panel:
    return Panel(title, description, (Target(f"avg by ({D}) ({selector(name, SCOPE)})", f"{{{{{D}}}}}"),), unit=unit,
                 width=width)


def _quantiles(title: str, description: str, histogram: str) -> Panel:
    return Panel(title, description, tuple(
        Target(quantile(q, histogram, W, [D], SCOPE), f"{{{{{D}}}}} p{round(q * 100)}") for q in QUANTILES
    ), unit="s", width=12)


def build(names: NameStyle = "colon") -> Dashboard:
    """The engine dashboard for a Prometheus that stores SGLang's names in `names` style."""

    def n(name: str) -> str:
        return sglang_name(name, names)

    legend = f"{{{{{D}}}}}"
    return Dashboard(
        uid="dfserve-engine" if names == "colon" else "dfserve-engine-underscore",
        title="dfserve engine" if names == "colon" else "dfserve engine (sglang_ names)",
        description="SGLang's own metrics per deployment: load, KV usage, throughput, acceptance, latency.",
        variables=(
            Variable("datasource", "Data source"),
            Variable("deployment", "Deployment", n(m.SGLANG_NUM_RUNNING_REQS), D),
        ),
        rows=(
            Row("Load", (
                _gauge("Running requests", "Requests in the running batch.", n(m.SGLANG_NUM_RUNNING_REQS), width=6),
                _gauge("Queued requests", "Requests waiting for a batch slot.", n(m.SGLANG_NUM_QUEUE_REQS), width=6),
                _mean_gauge("Token usage", "Share of the KV cache in use.", n(m.SGLANG_TOKEN_USAGE), "percentunit", 6),
                _mean_gauge("Prefix cache hit rate", "Share of prompt tokens served from the radix cache.",
                            n(m.SGLANG_CACHE_HIT_RATE), "percentunit", 6),
                Panel("Request rate", "Requests finished per second, and aborted ones.", (
                    Target(rate_sum(counter(n(m.SGLANG_NUM_REQUESTS)), W, [D], SCOPE), legend),
                    Target(rate_sum(counter(n(m.SGLANG_NUM_ABORTED_REQUESTS)), W, [D], SCOPE), f"{legend} aborted"),
                ), unit="reqps"),
                Panel("Token throughput", "Prompt and generated tokens per second, from the counters.", (
                    Target(rate_sum(counter(n(m.SGLANG_PROMPT_TOKENS)), W, [D], SCOPE), f"{legend} prompt"),
                    Target(rate_sum(counter(n(m.SGLANG_GENERATION_TOKENS)), W, [D], SCOPE), f"{legend} generated"),
                )),
                _gauge("Generation throughput (engine)", "The engine's own tokens/s gauge over its last log interval.",
                       n(m.SGLANG_GEN_THROUGHPUT)),
            )),
            Row("Speculative decoding", (
                Panel("Acceptance length (counters)",
                      "Δ generation tokens / Δ verify rounds over the window: the pooled acceptance length.",
                      (Target(tokens_per_round(n(m.SGLANG_GENERATION_TOKENS), n(m.SGLANG_SPEC_VERIFY_CALLS), W, [D],
                                               SCOPE), legend),)),
                _mean_gauge("Acceptance length (engine gauge)",
                            "sglang:spec_accept_length: the engine's average over its last decode-log interval.",
                            n(m.SGLANG_SPEC_ACCEPT_LENGTH)),
                _mean_gauge("Acceptance rate (engine gauge)",
                            "sglang:spec_accept_rate: accepted drafts over proposed drafts, last log interval.",
                            n(m.SGLANG_SPEC_ACCEPT_RATE), "percentunit"),
            )),
            Row("Latency", (
                _quantiles("Time to first token", "p50/p95/p99 per deployment.", n(m.SGLANG_TTFT)),
                _quantiles("Inter-token latency", "p50/p95/p99 per deployment, as the engine measures it.",
                           n(m.SGLANG_ITL)),
                _quantiles("End-to-end latency", "p50/p95/p99 per deployment.", n(m.SGLANG_E2E)),
                _quantiles("Queue time", "p50/p95/p99 per deployment, waiting before prefill.", n(m.SGLANG_QUEUE_TIME)),
            )),
        ),
    )
