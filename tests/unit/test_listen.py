"""Binding a listening socket: a taken port is the one setting the user changes, named by its field."""

from __future__ import annotations

import socket

import pytest

from dfserve.errors import FieldError
from dfserve.listen import bind, ensure_free


def test_a_taken_port_is_a_field_error_that_each_command_words_its_own_way() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(FieldError) as gateway:
            bind("127.0.0.1", port, "admin.")
        with pytest.raises(FieldError) as deploy:
            ensure_free("127.0.0.1", port)
    assert gateway.value.field == "admin.port" and deploy.value.field == "port"
    assert str(gateway.value) == (f"admin.port: 127.0.0.1:{port} is already in use; pick another admin.port or stop "
                                  "that server")
    assert deploy.value.render({"port": "--port"}).startswith(f"--port: 127.0.0.1:{port} is already in use; pick "
                                                              "another --port or")


@pytest.mark.parametrize("host", ["no-such-host.invalid", "192.0.2.1"])
def test_a_host_no_address_of_this_machine_answers_to_is_the_host_field(host: str) -> None:
    """An unknown name, or an address of another machine (TEST-NET-1): the host is the setting to change."""
    with pytest.raises(FieldError) as caught:
        bind(host, 0, "admin.")
    assert caught.value.field == "admin.host" and str(caught.value).startswith(f"admin.host: cannot listen on {host}:0")
