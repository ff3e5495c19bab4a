"""Acceptance math. Acceptance length counts the bonus token: one request's is ``completion_tokens /
spec_verify_ct``; over many requests it is ``sum(completion_tokens) / sum(spec_verify_ct)``, never the mean of
per-request ratios."""

from __future__ import annotations


def accept_length(completion_tokens: int, verify_ct: int) -> float | None:
    """One request's acceptance length; None when no verify round ran (nothing to divide by)."""
    if verify_ct <= 0:
        return None
    return completion_tokens / verify_ct


def impossible_rounds(completion_tokens: int, verify_ct: int) -> str | None:
    """Why these counts cannot be a request's, if they cannot: every verify round commits a token at least, so more
    rounds than tokens would make an acceptance below 1."""
    if verify_ct <= completion_tokens:
        return None
    return f"spec_verify_ct {verify_ct} is more than completion_tokens {completion_tokens}: each verify round " \
           "commits a token at least"


def estimated_accept_length(completion_tokens: int, content_chunks: int) -> float | None:
    """Tokens per content chunk, for an OpenAI stream without spec details: an estimate, labelled as such. None for
    a request of one token: it ran no verify round (SGLang 0.5.23 then sends no spec details even when asked), so
    there is no acceptance to estimate, and its 1.0 would pull a run's figure down."""
    if completion_tokens <= 1:
        return None
    return accept_length(completion_tokens, content_chunks)
