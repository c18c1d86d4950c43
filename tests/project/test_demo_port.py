"""``make demo`` checks its address before it touches anything: a taken
port, a host that is not this machine's or a malformed address is a clear error naming it
and how to pick another, and the database and the staff login are left as they were."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from binder import models
from gpuplane.management.addrport import ensure_free, parse
from harness.ports import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_taken_port_stops_the_demo_before_anything_changes(taken_port: int) -> None:
    get_user_model().objects.create_user("admin", password="the-old-password")
    with pytest.raises(CommandError) as error:
        call_command("demo", "--serve", "--addrport", f"127.0.0.1:{taken_port}")
    message = str(error.value)
    assert f"port {taken_port} on 127.0.0.1 is already in use" in message
    assert "nothing was changed" in message and "ADDRPORT=127.0.0.1:8001" in message
    # no snapshot loaded, no pass run, the login untouched
    assert not models.Node.objects.exists() and not models.PassRun.objects.exists()
    assert get_user_model().objects.get(username="admin").check_password("the-old-password")


@pytest.mark.parametrize(
    ("addrport", "says"),
    [
        ("127.0.0.1:http", "the port must be a number"),
        ("127.0.0.1:70000", "the port must be a number"),
        ("192.0.2.1:8000", "192.0.2.1 is not an address of this machine"),
        ("no-such-host.invalid:8000", "does not resolve"),
    ],
)
def test_bad_addresses_are_named(addrport: str, says: str) -> None:
    with pytest.raises(CommandError, match=says):
        ensure_free(addrport)


def test_free_addresses_and_the_runserver_forms() -> None:
    assert parse("8000") == ("127.0.0.1", 8000)
    assert parse("[::1]:8000") == ("::1", 8000)
    assert parse("localhost:8001") == ("localhost", 8001)
    ensure_free(f"127.0.0.1:{free_port()}")  # no error
