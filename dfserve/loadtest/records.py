"""One `RequestRecord` per request (a line of requests.jsonl) and the pure functions that derive figures from it.

The client records raw timestamps only (`time.perf_counter()` seconds since the run's start, taken as bytes
arrive); TTFT, ITL, TPOT, E2E and acceptance are derived here, so every figure has one definition:

- TTFT = first token-bearing chunk - request sent;  E2E = stream end - request sent;
- TPOT = (last token chunk - first token chunk) / (completion tokens - 1);
- ITL per chunk: one sample per gap between token-bearing chunks;
- ITL per token: each gap divided over the tokens the later chunk carried, one sample per token (a chunk of a
  speculative round carries several tokens, so the two differ; both are reported, by name);
- acceptance: exact (`completion_tokens / spec_verify_ct` from meta_info), estimated (tokens per content chunk,
  streamed chat) or unknown.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dfserve.errors import UserError
from dfserve.runs import read_jsonl
from dfserve.sglang import Api, accept_length, estimated_accept_length, impossible_rounds, printable

ErrorKind = Literal["connect", "timeout", "http_status", "stream_error", "protocol", "disconnect", "cancelled"]
"""`stream_error`: SGLang answered HTTP 200, then reported an error in band (an error event, or an abort as the
finish reason); `error_code` holds the status it carried (none after `/abort_request`)."""
Acceptance = Literal["exact", "estimated", "unknown"]


class RequestRecord(BaseModel):
    """Raw observations of one request; times are seconds since the run's start on `time.perf_counter()`."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = 1
    arm: str
    route: Api | None = Field(None, description="the API it was sent on (native, chat, completions); None in "
                              "records written before records carried it")
    index: int = Field(description="position in the schedule; equal indexes of two arms replayed the same task")
    task_id: str
    warmup: bool = False
    scheduled_s: float | None = Field(None, description="when the schedule wanted it sent; None in closed loop")
    dispatched_s: float = Field(description="when it got a concurrency slot (wait = dispatched - scheduled)")
    sent_s: float | None = Field(None, description="just before the request bytes were written")
    first_token_s: float | None = None
    end_s: float | None = Field(None, description="stream finished, failed or was cancelled")
    chunk_times_s: list[float] = Field(default_factory=list, description="arrival of each token-bearing chunk")
    chunk_tokens: list[int] | None = Field(None, description="tokens each chunk added; None when not visible")
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    spec_verify_ct: int | None = None
    acceptance: Acceptance = "unknown"
    finish_reason: str | None = None
    output_sha256: str | None = None
    temperature: float | None = Field(None, description="the request's own sampling temperature (a shadow run's "
                                      "live requests, a replayed capture's); None: the run's `sampling`")
    http_status: int | None = None
    error_kind: ErrorKind | None = None
    error_message: str | None = None
    error_code: int | None = Field(None, description="status an in-band error carried (http_status stays 200)")
    simulated: bool = False
    client_bound: bool = Field(False, description="a shadow pair whose primary the gateway could read only as fast "
                               "as its client took it (back-pressure): its chunk times and end are the client's, not "
                               "the engine's, so neither record of the pair is timed")
    server_e2e_latency_s: float | None = Field(None, description="meta_info e2e_latency: the server's own view")
    sim_chunk_sent_unix_s: list[float] | None = Field(
        None, description="simulator only: wall-clock send time of each chunk, to measure this client's error")
    sim_chunk_due_unix_s: list[float] | None = Field(
        None, description="simulator only: when its model scheduled each chunk (the last minus e2e = its arrival)")

    @field_validator("finish_reason", "error_message")
    @classmethod
    def _server_text(cls, text: str | None) -> str | None:
        """A server's words, kept as a record can hold them: one lone surrogate in an error message must not lose
        the run's records."""
        return printable(text) if text is not None else None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def cancelled(self) -> bool:
        """Cancelled by the tester when it was stopped (Ctrl-C): not answered, and not a failure of the arm."""
        return self.error_kind == "cancelled"


def output_sha256(text: str) -> str:
    """The output's hash, of its UTF-8; a lone surrogate (a JSON escape a server may send alone) is hashed as its
    code point rather than failing the record."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def ttft_s(r: RequestRecord) -> float | None:
    if r.sent_s is None or r.first_token_s is None:
        return None
    return r.first_token_s - r.sent_s


def e2e_s(r: RequestRecord) -> float | None:
    if not r.ok or r.sent_s is None or r.end_s is None or r.client_bound:
        return None
    return r.end_s - r.sent_s


def wait_s(r: RequestRecord) -> float:
    """Time a due request waited for a concurrency slot (open loop with a cap); 0 in closed loop."""
    return 0.0 if r.scheduled_s is None else max(0.0, r.dispatched_s - r.scheduled_s)


def tpot_s(r: RequestRecord) -> float | None:
    if (not r.ok or r.completion_tokens is None or r.completion_tokens < 2 or len(r.chunk_times_s) < 2
            or r.client_bound):
        return None
    return (r.chunk_times_s[-1] - r.chunk_times_s[0]) / (r.completion_tokens - 1)


def itl_per_chunk_s(r: RequestRecord) -> list[float]:
    if r.client_bound:
        return []
    times = r.chunk_times_s
    return [later - earlier for earlier, later in pairwise(times)]


def read_with_next(r: RequestRecord) -> list[bool]:
    """For each token chunk but the last: whether it reached the tester in one read with the next, so carries the
    next one's date (the server sent them together, or the tester left it unread until the next arrived)."""
    return [later == earlier for earlier, later in pairwise(r.chunk_times_s)]


def itl_per_token_s(r: RequestRecord) -> list[float]:
    """Each gap split evenly over the tokens of the chunk that ended it; empty when per-chunk tokens are unknown."""
    if r.chunk_tokens is None or len(r.chunk_tokens) != len(r.chunk_times_s) or r.client_bound:
        return []
    samples: list[float] = []
    for gap, tokens in zip(itl_per_chunk_s(r), r.chunk_tokens[1:], strict=True):
        samples.extend([gap / tokens] * tokens)
    return samples


def impossible(r: RequestRecord) -> str | None:
    """Why no recorder wrote `r`, if none could: a time that is no finite number, a count below 0, or an exact
    acceptance with more verify rounds than tokens (each commits one at least). The server's own e2e figure is its
    word, not a measurement: left out."""
    times = (r.dispatched_s, r.scheduled_s, r.sent_s, r.first_token_s, r.end_s, *r.chunk_times_s)
    if not all(math.isfinite(at) for at in times if at is not None):
        return "a time that is not a finite number"
    if any(count is not None and count < 0 for count in (r.prompt_tokens, r.completion_tokens, r.spec_verify_ct,
                                                          *(r.chunk_tokens or ()))):
        return "a count below 0"
    if r.ok and r.acceptance == "exact" and r.completion_tokens is not None and r.spec_verify_ct is not None:
        return impossible_rounds(r.completion_tokens, r.spec_verify_ct)
    return None


def impossible_records(records: Iterable[RequestRecord]) -> list[str]:
    """One line for the first record no recorder wrote, with how many more there are."""
    found = [(r.index, why) for r in records if (why := impossible(r)) is not None]
    return [f"index {found[0][0]}: {found[0][1]}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
            ] if found else []


COPIED_SHARE = 0.5
"""The share of pairs whose candidate record is timed as its baseline's, to the microsecond from its send to each
chunk, beyond which the candidate's records are a copy of the baseline's: two servers' answers never take the same
times."""


def copied(base: Sequence[RequestRecord], cand: Sequence[RequestRecord]) -> bool:
    """The candidate's records are the baseline's (relabelled, or a copy of the run, its clock moved or not): a run
    judged against itself. Times are taken from each request's send, so that moving every time alike hides
    nothing."""
    def timing(r: RequestRecord) -> tuple[object, ...]:
        sent = r.sent_s if r.sent_s is not None else r.dispatched_s
        since = [round(at - sent, 6) if at is not None else None for at in (r.first_token_s, r.end_s)]
        return *since, tuple(round(at - sent, 6) for at in r.chunk_times_s)

    same = sum(timing(b) == timing(c) for b, c in zip(base, cand, strict=True) if b.end_s is not None)
    return same > COPIED_SHARE * len(base)


def request_accept_length(r: RequestRecord) -> float | None:
    """Exact from meta_info or estimated from chunks, as `r.acceptance` says; None when unknown."""
    if not r.ok or r.completion_tokens is None or r.acceptance == "unknown":
        return None
    if r.acceptance == "exact":
        return None if r.spec_verify_ct is None else accept_length(r.completion_tokens, r.spec_verify_ct)
    return estimated_accept_length(r.completion_tokens, len(r.chunk_times_s))


def verify_rounds(r: RequestRecord) -> int | None:
    """Verify rounds of a finished request: exact from meta_info, else the count of token-bearing chunks."""
    if not r.ok or r.acceptance == "unknown":
        return None
    return r.spec_verify_ct if r.acceptance == "exact" else len(r.chunk_times_s)


def round_tokens(r: RequestRecord) -> list[int]:
    """Tokens accepted per verify round (bonus included), from native chunk deltas; the prefill token is dropped.

    Only where the chunks are the rounds: one chunk for the prefill token, then one per verify round, as many as
    `spec_verify_ct` says. A client that falls behind gets only SGLang's latest state (``_stream_one_response``), so
    one chunk can carry several rounds; such a request's rounds are not visible one by one and it adds none."""
    if not r.ok or r.chunk_tokens is None or r.acceptance != "exact" or r.spec_verify_ct is None:
        return []
    if len(r.chunk_tokens) != r.spec_verify_ct + 1:
        return []
    return r.chunk_tokens[1:]


def measured_records(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The records that count: warm-up excluded."""
    return [r for r in records if not r.warmup]


def check_same_request(pairs: Iterable[tuple[RequestRecord, RequestRecord]]) -> None:
    """Both sides of one request were sent on one route at one temperature (a shadow mirror is a copy of its
    request, a task has one body): records that disagree were edited, and could take a pair out of losslessness or
    pair a chat answer with a native one."""
    for base, cand in pairs:
        for field in ("temperature", "route"):
            if getattr(base, field) != getattr(cand, field):
                raise UserError(f"request {base.index}: arm {base.arm} records {field} {getattr(base, field)}, arm "
                                f"{cand.arm} {getattr(cand, field)}; records of one request that disagree are never "
                                "judged")


def read_records(path: Path) -> Iterator[RequestRecord]:
    """Read requests.jsonl; a torn last line (a crash mid-write) is skipped, anything else malformed is an error."""
    return read_jsonl(path, RequestRecord, "a request record")
