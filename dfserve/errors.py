"""The one exception tree of dfserve.

Library code raises these; the CLI turns a `UserError` into one line on stderr and a non-zero exit.
Per-request failures (timeouts, HTTP errors) are data in records, never exceptions.
"""


class DfserveError(Exception):
    """Base of every error dfserve raises on purpose."""


class UserError(DfserveError):
    """Bad input the user can fix: a flag, a file, a field. The message names it."""


class ProtocolError(DfserveError):
    """A peer sent something that does not follow SGLang's or OpenAI's wire format."""
