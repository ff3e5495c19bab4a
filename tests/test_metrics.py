"""The `dfserve_requests_total` label convention shared by the gateway and the load tester."""

from __future__ import annotations

import pytest

from dfserve import metrics as m


@pytest.mark.parametrize(("http_status", "error", "labels"), [
    (200, None, ("2xx", "")),
    (500, None, ("5xx", "http_status")),
    (500, "http_status", ("5xx", "http_status")),
    (503, "no_replica", ("5xx", "no_replica")),
    (429, "overloaded", ("4xx", "overloaded")),
    (200, "stream_cut", ("error", "stream_cut")),
    (200, "protocol", ("error", "protocol")),
    (None, "connect", ("error", "connect")),
    (0, None, ("error", "no_status")),
    (200, "client_disconnect", ("499", "client_disconnect")),
    (None, "cancelled", ("499", "cancelled")),
])
def test_request_labels(http_status: int | None, error: str | None, labels: tuple[str, str]) -> None:
    assert m.request_labels(http_status, error) == labels
    assert (labels[0] == m.STATUS_OK) == (labels[1] == ""), "an empty error label means success and only that"
