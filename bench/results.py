"""bench/RESULTS.md: each benchmark owns one block between its markers and replaces only that block."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(section: str, body: str) -> None:
    """Replace the block `<!-- section -->` ... `<!-- /section -->` of RESULTS.md, or append it."""
    begin, end = f"<!-- {section} -->", f"<!-- /{section} -->"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
