"""PromQL building blocks shared by the dashboards and the rules: pure string functions, no I/O.

Counters are named without their `_total` suffix in `dfserve.metrics` (prometheus_client adds it on exposition),
so `counter()` adds it here, once.
"""

from __future__ import annotations

from collections.abc import Sequence

from dfserve import metrics as m

QUANTILES = (0.5, 0.95, 0.99)
GENERATION = f'route=~"{"|".join(m.GENERATION_ROUTES)}"'
"""Matcher of generation requests: a client polling `/v1/models` is not an arm's traffic."""
ERROR_STATUS = f'status!="{m.STATUS_OK}"'
"""Matcher of failed requests in `dfserve_requests_total` (the gateway's and the load tester's alike, see
`dfserve.metrics.REQUEST_LABELS`): HTTP error answers, client give-ups and answers that never completed."""


def counter(name: str) -> str:
    """The exposed series name of a counter family."""
    return f"{name}_total"


def selector(name: str, matchers: Sequence[str] = ()) -> str:
    """`name{m1, m2}`, or the bare name without matchers."""
    return f"{name}{{{', '.join(matchers)}}}" if matchers else name


def by(labels: Sequence[str]) -> str:
    return f"by ({', '.join(labels)}) " if labels else ""


def rate_sum(series: str, window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """Per-second rate of a counter series, summed by `labels`."""
    return f"sum {by(labels)}(rate({selector(series, matchers)}[{window}]))"


def total(series: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """A counter's value summed by `labels`: everything since the process started (or a pushed run's final count)."""
    return f"sum {by(labels)}({selector(series, matchers)})"


def increase_sum(series: str, window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    return f"sum {by(labels)}(increase({selector(series, matchers)}[{window}]))"


def ratio(numerator: str, denominator: str) -> str:
    """`numerator / denominator`; an operand that is itself a ratio is parenthesised (PromQL's `/` binds left)."""
    return f"{_operand(numerator)}\n/\n{_operand(denominator)}"


def error_ratio(window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """Failed requests over finished ones, from the two series that start at 0 (`dfserve.metrics.REQUESTS_FAILED`
    and the 2xx series of `dfserve_requests_total`): the first failure of a kind not seen before is in it. Series by
    series (`>=` and `or` match every label but the status and kind), the larger of that count and the failures read
    from `dfserve_requests_total{status!="2xx"}`: a producer of an earlier version exports no `REQUESTS_FAILED` (a
    gateway pod not yet rolled), and a window across an upgrade in place holds the earlier failures only in the
    kinds' series."""
    requests = counter(m.REQUESTS)
    counted = f"rate({selector(counter(m.REQUESTS_FAILED), matchers)}[{window}])"
    kinds = f"sum without (status, error) (rate({selector(requests, (*matchers, ERROR_STATUS))}[{window}]))"
    failed = f"sum {by(labels)}(\n({counted} >= {kinds})\nor\n{kinds}\nor\n{counted}\n)"
    succeeded = rate_sum(requests, window, labels, (*matchers, f'status="{m.STATUS_OK}"'))
    return ratio(failed, f"{failed}\n+\n{succeeded}")


def _operand(expr: str) -> str:
    return f"(\n{expr}\n)" if "\n" in expr else expr


def quantile(q: float, histogram: str, window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """`q` quantile of a histogram family over `window`, aggregated over everything but `labels`."""
    return f"histogram_quantile({q}, {rate_sum(f'{histogram}_bucket', window, [*labels, 'le'], matchers)})"


def quantile_total(q: float, histogram: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """`q` quantile of every observation a histogram holds (a whole pushed run), aggregated like `quantile`."""
    return f"histogram_quantile({q}, {total(f'{histogram}_bucket', [*labels, 'le'], matchers)})"


def histogram_mean(histogram: str, window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """Mean of the observations of a histogram over `window` (sum / count)."""
    return ratio(rate_sum(f"{histogram}_sum", window, labels, matchers),
                 rate_sum(f"{histogram}_count", window, labels, matchers))


def tokens_per_round(tokens: str, rounds: str, window: str, labels: Sequence[str],
                     matchers: Sequence[str] = ()) -> str:
    """Windowed acceptance length: Σ tokens / Σ verify rounds, the pooled figure (never a mean of ratios); `tokens`
    must count exactly the requests that `rounds` counts."""
    return ratio(rate_sum(counter(tokens), window, labels, matchers),
                 rate_sum(counter(rounds), window, labels, matchers))


def arm_acceptance(window: str, labels: Sequence[str], matchers: Sequence[str] = ()) -> str:
    """Pooled exact acceptance of dfserve's arms, over only the requests that reported verify rounds: every
    request's tokens over those requests' rounds would read too high when streamed chat is mixed in."""
    return tokens_per_round(m.SPEC_OUTPUT_TOKENS, m.SPEC_VERIFY_ROUNDS, window, labels, matchers)
