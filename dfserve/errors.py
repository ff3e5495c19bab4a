"""The one exception tree of dfserve, and the one way validation failures become a user-facing line.

Library code raises these; the CLI turns a `UserError` into one line on stderr and a non-zero exit.
Per-request failures (timeouts, HTTP errors) are data in records, never exceptions.
"""

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError


class DfserveError(Exception):
    """Base of every error dfserve raises on purpose."""


class UserError(DfserveError):
    """Bad input the user can fix: a flag, a file, a field. The message names it."""


class FieldError(UserError):
    """A `UserError` about one input, named by its field (`drafter`, `target_config`), never by a flag: each command
    maps fields to its own flags (`flags_for`). `{other}` in the message names a second field the same way."""

    def __init__(self, field: str, message: str, other: str | None = None) -> None:
        self.field = field
        self.message = message
        self.other = other
        super().__init__(self.render({}))

    def render(self, flags: Mapping[str, str]) -> str:
        text = self.message if self.other is None else self.message.replace("{other}", flags.get(self.other, self.other))
        return f"{flags.get(self.field, self.field)}: {text}"


@contextlib.contextmanager
def flags_for(flags: Mapping[str, str]) -> Iterator[None]:
    """Inside, a `FieldError` about one of `flags`' fields becomes one line naming the flag: `--drafter: ...`."""
    try:
        yield
    except FieldError as exc:
        if exc.field not in flags:
            raise
        raise UserError(exc.render(flags)) from None


def command_flags(command: Any) -> dict[str, str]:
    """A click command's option names mapped to their flags (`target_config` -> `--target-config`)."""
    return {param.name: max(param.opts, key=len) for param in command.params
            if param.name and any(opt.startswith("--") for opt in param.opts)}


class ProtocolError(DfserveError):
    """A peer sent something that does not follow SGLang's or OpenAI's wire format."""


def describe_invalid(exc: ValidationError, where: str) -> str:
    """One line naming the first bad field of a file or document: `WHERE: a.b.c: what is wrong (and N more)`."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {field}: {first['msg'].removeprefix('Value error, ')}{more}"


def invalid_field(exc: ValidationError) -> FieldError:
    """The first bad field of a model built from a command's options, as a `FieldError` on the field's own name
    (the last part of its location, as options are named), which `flags_for` words as the flag."""
    first = exc.errors()[0]
    return FieldError(str(first["loc"][-1]) if first["loc"] else "(top level)", first["msg"].removeprefix("Value error, "))


class Untrusted(UserError):
    """Data a verdict should not rest on as it is (runs that differ, a run that is incomplete): refused unless the
    caller asks to judge it anyway, and then stamped so in the verdict. The CLI names its own way to ask."""
