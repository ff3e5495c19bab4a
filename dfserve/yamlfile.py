"""YAML files the user writes (gates, gateway configs, host profiles), read one way: as UTF-8, safely, and strictly.

A mapping that names a key twice is refused: YAML itself keeps the last, so a gate with `rules:` twice would be
judged by whichever came second, unseen. Nesting deep enough to exhaust the parser's recursion is refused too, as
are aliases that expand past `MAX_VALUES` and NUL characters.
Every failure is one `UserError` line naming the file (`where`) and, where the parser knows it, the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dfserve.errors import UserError
from dfserve.regular_files import read_regular


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader`, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: merged keys may be overridden here
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice",
                                                        key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen.add(key)
        return super().construct_mapping(node, deep)


MAX_VALUES = 1_000_000
"""The most values a document may hold once its aliases are expanded: nine levels of nine aliases each (`&a [*a,
*a, ...]`) are a few lines that expand to 387 million, which whatever writes the document out (JSON, argv) tries
to hold."""


def _checked(document: Any, where: str) -> Any:
    """`document`, once its values counted with its aliases expanded are within `MAX_VALUES`, and none of its
    strings holds a NUL (no argument, environment variable or file name can carry one)."""
    stack, count = [document], 0
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{where}: more than {MAX_VALUES:,} values once its aliases are expanded (an alias "
                            "repeated inside itself?)")
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and "\x00" in value:
            raise UserError(f"{where}: {value[:40]!r}: a NUL character (\\0) in a value, which nothing can pass on")
    return document


def parse_yaml(text: str, where: str) -> Any:
    """The document in `text` (read from `where`)."""
    try:
        return _checked(yaml.load(text, Loader=_StrictLoader), where)  # a SafeLoader, stricter
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or type(exc).__name__
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UserError(f"{where}: invalid YAML{at}: {problem}") from None
    except RecursionError:
        raise UserError(f"{where}: invalid YAML: nested too deeply") from None


def read_yaml(path: Path) -> Any:
    """The document in the file at `path`."""
    try:
        text = read_regular(path).decode("utf-8")
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return parse_yaml(text, str(path))
