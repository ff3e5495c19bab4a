"""What one stream showed, read event by event off the loop (`StreamRead`): chunk times and tokens, the output,
the spec fields and how it failed, if it did. The routes (`loadtest.routes`) feed it their events; SGLang's JSON is
read through `dfserve.sglang` only."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.loadtest.records import ErrorKind

Failure = tuple[ErrorKind, str]


@dataclass
class StreamRead:
    """What one stream showed, however it ended; times are seconds since the run's start."""

    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    verify_ct: int | None = None
    texts: list[str] = field(default_factory=list)
    """The output in the pieces it came in (chat, and native from a server streaming deltas), or the last event's
    whole text (native); of the first choice, with n > 1."""
    choice_texts: dict[int, list[str]] = field(default_factory=dict)
    """With several outputs (n > 1, a batch): the others' pieces, by index (SGLang interleaves their events)."""
    output_tokens: dict[int, int] = field(default_factory=dict)
    """Native: each output's running total, by index (`completion_tokens` is their sum)."""
    verify_cts: dict[int, int] = field(default_factory=dict)
    """Native: each finished output's verify rounds, by index (`verify_ct` is their sum)."""
    incremental: bool = False
    """A native stream whose events carry deltas (`NativeChunk.incremental`, seen once is enough)."""
    finish_reason: str | None = None
    """How the output of lowest index finished, of those that did (`finished`): with several, the last to finish
    depends on timing."""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    simulated: bool = False
    sim_sent: list[float] | None = None
    sim_due: list[float] | None = None
    server_e2e: float | None = None
    usage_seen: bool = False
    spec: sglang.SpecStats | None = None
    """An OpenAI stream's spec details (`sglext`), the last that came."""
    counted: bool = False
    """A count of the output's tokens came (every native event's meta_info; an OpenAI stream's usage, or its spec
    details' accept length): without one, `completion_tokens` counts nothing."""
    done: bool = False
    error_code: int | None = None
    """The status an in-band error carried."""
    failure: Failure | None = None

    @property
    def text(self) -> str:
        if not self.choice_texts:
            return "".join(self.texts)
        return sglang.joined_choices({0: "".join(self.texts)} | {i: "".join(t) for i, t in self.choice_texts.items()})

    def finished(self, index: int, kind: str) -> None:
        """Output `index` says how it finished (the last word of each counts)."""
        self.finish_reasons[index] = kind
        self.finish_reason = self.finish_reasons[min(self.finish_reasons)]

    def native_event(self, data: str, now: float) -> None:
        event = sglang.parse_native_event(data)
        if isinstance(event, sglang.StreamError):
            self._in_band(event)
            return
        meta, index = event.meta, event.index
        self.counted = True
        before = self.output_tokens.get(index, 0)
        delta = meta.completion_tokens - before
        if delta < 0:
            raise ProtocolError(f"completion_tokens went backwards: {before} -> {meta.completion_tokens}")
        if delta:
            self.chunk_times.append(now)
            self.chunk_tokens.append(delta)
            self.output_tokens[index] = meta.completion_tokens
            self.completion_tokens += delta
        self.incremental = self.incremental or event.incremental
        texts = self.choice_texts.setdefault(index, []) if index else self.texts
        if self.incremental:
            texts.append(event.text)
        else:
            texts[:] = [event.text]
        self.prompt_tokens = meta.prompt_tokens
        self.simulated = meta.simulated
        finish = meta.finish_reason
        if finish is None:
            return
        if finish.error is not None:
            self._in_band(finish.error)
            return
        self.finished(index, finish.kind)
        if meta.spec is not None:
            self.verify_cts[index] = meta.spec.verify_ct
            self.verify_ct = sum(self.verify_cts.values())
        self.server_e2e = meta.e2e_latency_s
        if meta.sim_chunk_sent_unix_s is not None:
            self.sim_sent = list(meta.sim_chunk_sent_unix_s)
        if meta.sim_chunk_due_unix_s is not None:
            self.sim_due = list(meta.sim_chunk_due_unix_s)

    def native_end(self, end: sglang.NativeStreamEnd) -> None:
        """A native stream's last event, read alone (`sglang.native_stream_end`): its output and how it ended."""
        self.done = end.done
        if end.error is not None:
            self._in_band(end.error)
            return
        self.incremental = end.incremental
        self.texts = [end.text]
        finish = end.finish_reason
        if finish is not None and finish.error is not None:
            self._in_band(finish.error)
        elif finish is not None:
            self.finish_reason = finish.kind

    def chat_events(self, events: list[str], times: list[float], template: sglang.ChunkTemplate | None) -> None:
        """Runs of content chunks that fit `template` are read without decoding them; every other event is decoded
        whole and may become the template."""
        i = 0
        while i < len(events):
            if self.done:
                raise ProtocolError("an event after [DONE]")
            fitted = template.read(events, i) if template is not None else []
            if fitted:
                self.texts += fitted
                self.chunk_times += compress(times[i : i + len(fitted)], fitted)
                i += len(fitted)
                continue
            data, now = events[i], times[i]
            i += 1
            if data == sglang.DONE:
                self.done = True
                continue
            event = sglang.parse_openai_event(data)
            if isinstance(event, sglang.StreamError):
                self._in_band(event)
                continue
            if template is not None:
                template.learn(data, event)
            if event.text:
                self.chunk_times.append(now)
                (self.choice_texts.setdefault(event.index, []) if event.index else self.texts).append(event.text)
            if event.finish_reason is not None:
                self.finished(event.index, event.finish_reason.kind)
                if event.finish_reason.error is not None:
                    self._in_band(event.finish_reason.error)
            if event.usage is not None:
                self.usage_seen = self.counted = True
                self.prompt_tokens = event.usage.prompt_tokens
                self.completion_tokens = event.usage.completion_tokens
            if event.spec is not None:
                self.verify_ct, self.spec = event.spec.verify_ct, event.spec
                if not self.usage_seen and (tokens := sglang.spec_completion_tokens(event.spec, None)) is not None:
                    self.completion_tokens, self.counted = tokens, True

    def _in_band(self, error: sglang.StreamError) -> None:
        """The first error in band is the stream's failure (SGLang still sends usage and `[DONE]` after it)."""
        if self.failure is None:
            self.failure = ("stream_error", error.message)
            self.error_code = error.code
