"""The one exception tree of dfserve, and the one way validation failures become a user-facing line.

Library code raises these; the CLI turns a `UserError` into one line on stderr and a non-zero exit.
Per-request failures (timeouts, HTTP errors) are data in records, never exceptions.
"""

import yaml
from pydantic import ValidationError


class DfserveError(Exception):
    """Base of every error dfserve raises on purpose."""


class UserError(DfserveError):
    """Bad input the user can fix: a flag, a file, a field. The message names it."""


class ProtocolError(DfserveError):
    """A peer sent something that does not follow SGLang's or OpenAI's wire format."""


def describe_invalid(exc: ValidationError, where: str) -> str:
    """One line naming the first bad field of a file or document: `WHERE: a.b.c: what is wrong (and N more)`."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {field}: {first['msg']}{more}"


def describe_invalid_flag(exc: ValidationError) -> str:
    """One line naming the command-line flag behind the first bad field: `--max-running-requests: ...`."""
    first = exc.errors()[0]
    return f"--{str(first['loc'][-1]).replace('_', '-')}: {first['msg']}"


def describe_yaml(exc: yaml.YAMLError, where: str) -> str:
    """One line for a YAML syntax error: `WHERE: invalid YAML at line N: problem`."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: invalid YAML{at}: {problem}"
