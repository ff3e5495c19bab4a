"""What a capture folder holds: segments of `CaptureRecord` lines (JSONL) and a `manifest.json` that lists them.

A segment is listed in the manifest only once it is closed, with its line count, size and sha256, so a reader
knows which segments exist and refuses one that was truncated or edited; `complete` is set when the writer closed
the capture. The policy the capture was written under is recorded with it.

    capture/
      manifest.json            CaptureManifest
      segment-000001.jsonl     CaptureRecord per line, in arrival order
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dfserve.runs import fields_sha256
from dfserve.sglang import Api

MANIFEST = "manifest.json"
SEGMENT_PREFIX = "segment-"
CREDENTIAL_WORDS = ("auth", "token", "key", "secret", "cookie", "session", "jwt", "oidc", "password", "credential",
                    "signature")
"""A header whose name holds one of these is never written, whatever the policy says: `Authorization`, `Cookie`,
`X-Api-Key` and the tokens proxies add (oauth2-proxy's `X-Forwarded-Access-Token`, an AWS load balancer's
`X-Amzn-Oidc-Accesstoken`, LiteLLM's and Portkey's keys). A header name that only looks like one is lost too:
captured headers are provenance, never replayed."""


def is_credential(name: str) -> bool:
    """Whether a header (its name lower-cased) may carry a credential (`CREDENTIAL_WORDS`)."""
    return any(word in name for word in CREDENTIAL_WORDS)

Redact = Literal["keep", "drop", "hash"]


def segment_name(number: int) -> str:
    return f"{SEGMENT_PREFIX}{number:06d}.jsonl"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CapturePolicy(_Model):
    """How a capture is taken: what share of requests, what is kept of each, and how much disk it may use (the
    gateway's `capture:` block). Strict, as the rest of the gateway's file: `fraction: "0.5"` is a mistake, not a
    number to guess at; paths and lists still come as YAML has them."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dir: Path = Field(strict=False, description="the capture folder; created, never reused")
    fraction: float = Field(1.0, gt=0, le=1, description="share of requests captured (seeded, deterministic)")
    seed: int = Field(0, description="seeds the sampling: the same seed and arrivals capture the same requests")
    redact: Redact = Field("keep", description="keep the body; drop `drop_fields`; or hash the user text (such a "
                           "capture cannot be replayed)")
    drop_fields: tuple[str, ...] = Field((), strict=False, description="redact: drop — body fields removed "
                                         "(dotted paths: `sampling_params.seed`)")
    drop_headers: tuple[str, ...] = Field((), strict=False, description="headers not written, beside the "
                                          "credentials (Authorization, Cookie, X-Api-Key, Proxy-Authorization), "
                                          "never written")
    max_bytes: int = Field(1 << 30, ge=4096, description="bytes on disk the segments may take in all")
    max_segments: int = Field(16, ge=1, description="segments at most; each holds up to max_bytes / max_segments")
    queue_size: int = Field(4096, ge=1, description="exchanges waiting for the capture's thread before new ones are "
                            "dropped (counted as dropped_queue_full)")

    @model_validator(mode="after")
    def _check(self) -> CapturePolicy:
        if self.redact == "drop" and not self.drop_fields:
            raise ValueError("redact: drop needs drop_fields")
        if self.redact != "drop" and self.drop_fields:
            raise ValueError("drop_fields: only with redact: drop")
        if any(not part for name in self.drop_fields for part in name.split(".")):
            raise ValueError("drop_fields: an empty field name")
        return self

    @property
    def segment_bytes(self) -> int:
        return self.max_bytes // self.max_segments


class CaptureRecord(_Model):
    """One captured request, as the client sent it (less what the policy removed)."""

    schema_version: Literal[1] = 1
    seq: int = Field(ge=0, description="order of arrival among the captured requests")
    route: Api
    path: str
    arrival_unix_s: float = Field(description="wall clock at arrival: provenance only")
    offset_s: float = Field(ge=0, allow_inf_nan=False,
                            description="seconds from the capture's start to arrival (monotonic clock)")
    sampling: dict[str, Any] = Field(description="the sampling settings the body set, as it set them")
    headers: tuple[tuple[str, str], ...] = Field(description="headers as sent, less credentials and drop_headers")
    body: dict[str, Any] = Field(description="the JSON body, less what the policy dropped or hashed")
    redaction: Redact = Field(description="the policy the body was kept under")
    redacted: tuple[str, ...] = Field((), description="body fields dropped or replaced by their sha256")
    replayable: bool = Field(description="false when user text was hashed: the prompt is gone")


class SegmentInfo(_Model):
    name: str
    records: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str


class CaptureCounts(_Model):
    """What happened to every request the writer was shown."""

    observed: int = 0
    sampled_out: int = 0
    not_a_route: int = Field(0, description="a path other than /generate, /v1/chat/completions, /v1/completions")
    unreadable: int = Field(0, description="a body that is not a JSON object")
    written: int = 0
    dropped_queue_full: int = Field(0, description="client requests the capture's thread could not take in time "
                                    "(its queue was full), dropped before sampling: with a fraction below 1, more "
                                    "than would have been written")
    dropped_write_error: int = Field(0, description="lost to a write that failed (the capture stopped there)")
    dropped_over_bound: int = Field(0, description="after the capture reached max_bytes or max_segments, requests "
                                    "that arrived after the last one it holds")
    dropped_after_error: int = Field(0, description="after a failed write stopped the capture, requests that "
                                     "arrived after the last one it holds")
    dropped_in_window: int = Field(0, description="after the capture stopped, requests that had arrived before the "
                                   "last one it holds (still running when it stopped): its window ends at the first "
                                   "of them (`CaptureManifest.lost_from_offset_s`)")
    dropped_too_large: int = Field(0, description="one record larger than a segment")


class CaptureManifest(_Model):
    schema_version: Literal[1] = 1
    kind: Literal["capture"] = "capture"
    started_unix_s: float
    policy: CapturePolicy
    segments: tuple[SegmentInfo, ...] = ()
    complete: bool = Field(False, description="the writer closed the capture; until then it may still grow")
    stopped: str | None = Field(None, description="why capture stopped before it was closed (a bound, an error)")
    counts: CaptureCounts = CaptureCounts()
    lost_from_offset_s: float | None = Field(None, ge=0, allow_inf_nan=False, description=(
        "the arrival of the first request lost from the window once the capture stopped (`dropped_in_window`): it "
        "holds every request that arrived before, and a replay takes those only"))
    manifest_sha256: str | None = Field(None, description="sha256 of this manifest's other fields (`sealed`): a count "
                                        "of lost requests edited away, or a window lengthened, shows")

    def sealed(self) -> CaptureManifest:
        return self.model_copy(update={"manifest_sha256": fields_sha256(self, "manifest_sha256")})

    def unsealed(self) -> str | None:
        """Why its fields are not as the writer left them; None when they are."""
        if self.manifest_sha256 is None:
            return "holds no sha256 of its own fields (written by an older dfserve, or edited)"
        if self.manifest_sha256 != fields_sha256(self, "manifest_sha256"):
            return "is not as its writer left it (its fields' sha256 is not the one it holds): edited"
        return None
