"""Output text: a deterministic function of the prompt and the sampling parameters, never of the drafter.

Speculative decoding is lossless, so a baseline and a candidate engine must return the same text for the same
prompt at temperature 0; the simulator guarantees it by deriving every output token from a hash of the prompt and
the parameters that shape sampling (only the prompt at temperature 0, where sampling is greedy). The `lossy` fault
breaks that on purpose for a chosen fraction of prompts, as a buggy drafter would.

Tokens are real Qwen3 token ids whose text is a code fragment, so counts and ids look like the real model's.
`max_new_tokens`, stop strings, stop token ids, `ignore_eos` and `finish_reason` behave like SGLang's.
"""

from __future__ import annotations

import hashlib
import lzma
import math
import random
from dataclasses import dataclass, field
from importlib import resources

from dfserve.errors import FieldError, UserError
from dfserve.sglang import FinishReason

# Candidate output pieces; those that are not a single Qwen3 token are dropped when the vocabulary loads.
_PIECES = (
    "def", " def", " return", " if", " else", " elif", " for", " in", " while", " not", " and", " or", " is",
    " None", " True", " False", " import", " from", " class", " self", " lambda", " yield", " with", " as",
    " range", " len", " list", " dict", " int", " str", " sorted", " sum", " max", " min", " enumerate", " zip",
    " result", " value", " values", " numbers", " count", " index", " key", " item", " items", " total",
    " x", " y", " i", " j", " n", " s", "(", ")", "[", "]", ":", ",", ".", " =", " ==", " +", " -", " *",
    " <", " >", " +=", " 0", " 1", " 2", "0", "1", "\n", "\n    ", "\n        ", "\n\n", "    ", " #",
    " the", " a", " of", " to", " list", " string", " number", " check", " each", " element", "_", "append",
)
EOS_TOKEN = "<|im_end|>"


TOKENIZER = "qwen3-tokenizer.json.xz"
"""Qwen3's tokenizer.json (Apache-2.0, Qwen team), shipped xz-compressed in `data/` so that an install by pip alone
serves; `data/README.md` says where it came from and its checksum."""


def _tokenizer_json() -> str:
    return lzma.decompress(resources.files(__package__).joinpath("data", TOKENIZER).read_bytes()).decode()


@dataclass(frozen=True)
class Vocabulary:
    """Prompt token counting and the pieces outputs are made of."""

    pieces: tuple[tuple[int, str], ...]
    eos_id: int
    _tokenizer: object = field(repr=False, compare=False)

    @classmethod
    def load(cls) -> Vocabulary:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(_tokenizer_json())
        pieces = []
        for text in _PIECES:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == 1:
                pieces.append((ids[0], text))
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        if eos_id is None or len(pieces) < 32:
            raise UserError(f"tokenizer: {TOKENIZER} is not a Qwen3 tokenizer")
        return cls(pieces=tuple(pieces), eos_id=eos_id, _tokenizer=tokenizer)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    def count_releasing_gil(self, text: str) -> int:
        """`count` for a thread: the tokenizer's batch call releases the GIL while it works (its single call holds
        it), so the event loop goes on serving meanwhile."""
        return len(self._tokenizer.encode_batch([text], add_special_tokens=False)[0])  # type: ignore[attr-defined]


def render_chat(messages: list[tuple[str, str]]) -> str:
    """Qwen3's chat template, reduced to what counts tokens: each turn, then the assistant's opening."""
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return f"{turns}<|im_start|>assistant\n"


@dataclass(frozen=True)
class Limits:
    """Where SGLang stops a request, besides the model's own end of sequence."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False


def _seed(*parts: str) -> int:
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8, person=b"output").digest()
    return int.from_bytes(digest, "big")


class TextModel:
    """Starts one deterministic output stream per request."""

    def __init__(self, vocabulary: Vocabulary, lossy_fraction: float = 0.0, median_tokens: int = 180) -> None:
        if not 0.0 <= lossy_fraction <= 1.0:
            raise FieldError("lossy_fraction", f"{lossy_fraction} is outside [0, 1]")
        self.vocabulary = vocabulary
        self.lossy_fraction = lossy_fraction
        self.median_tokens = median_tokens

    def is_lossy(self, prompt: str, sampling_key: str) -> bool:
        return _seed("lossy", prompt, sampling_key) / 2**64 < self.lossy_fraction

    def start(self, prompt: str, sampling_key: str, limits: Limits) -> OutputStream:
        """`sampling_key` names the sampling parameters that change tokens ("" at temperature 0)."""
        rng = random.Random(_seed("tokens", prompt, sampling_key))
        natural = max(4, min(8192, int(self.median_tokens * math.exp(rng.gauss(0.0, 0.6)))))
        diverge_at = None
        if self.is_lossy(prompt, sampling_key):
            diverge_at = 1 + _seed("diverge", prompt, sampling_key) % 8
        return OutputStream(self.vocabulary, rng, natural, limits, diverge_at, _seed("lossy-tokens", prompt))


class OutputStream:
    """One request's tokens, produced on demand a round at a time."""

    def __init__(
        self, vocabulary: Vocabulary, rng: random.Random, natural_tokens: int, limits: Limits,
        diverge_at: int | None, lossy_seed: int,
    ) -> None:
        self._vocabulary = vocabulary
        self._rng = rng
        self._natural = natural_tokens
        self._limits = limits
        self._diverge_at = diverge_at
        self._lossy_seed = lossy_seed
        self._holdback = max((len(s) for s in limits.stop), default=1) - 1
        self.ids: list[int] = []
        self._text = ""
        self.finish: FinishReason | None = None

    @property
    def text(self) -> str:
        """Text a client may see now: stop strings are trimmed at the end, and a possible stop prefix held back."""
        if self.finish is not None or not self._holdback:
            return self._text
        return self._text[: max(0, len(self._text) - self._holdback)]

    def first_token(self) -> None:
        """The token sampled at prefill; `max_new_tokens: 0` finishes without one, as SGLang does."""
        if self._limits.max_new_tokens == 0:
            self.finish = FinishReason(kind="length", length=0)
        else:
            self.take(1)

    def take(self, n: int) -> int:
        """Generate up to `n` more tokens; returns how many were produced before the request finished."""
        produced = 0
        while produced < n and self.finish is None:
            self._next_token()
            produced += 1
        return produced

    def _next_token(self) -> None:
        position = len(self.ids)
        if self._diverge_at is not None and position == self._diverge_at:
            self._rng = random.Random(self._lossy_seed)
        limits = self._limits
        if position + 1 >= self._natural and not limits.ignore_eos:
            self.ids.append(self._vocabulary.eos_id)
            self.finish = FinishReason(kind="stop", matched=self._vocabulary.eos_id)
            return
        token_id, piece = self._rng.choice(self._vocabulary.pieces)
        self.ids.append(token_id)
        if token_id in limits.stop_token_ids:
            self.finish = FinishReason(kind="stop", matched=token_id)
            return
        before = len(self._text)
        self._text += piece
        for stop in limits.stop:
            at = self._text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                if not limits.no_stop_trim:
                    self._text = self._text[:at]
                self.finish = FinishReason(kind="stop", matched=stop)
                return
        if len(self.ids) >= limits.max_new_tokens:
            self.finish = FinishReason(kind="length", length=len(self.ids))
