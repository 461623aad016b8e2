"""Starting a service on a port: a port whose owner was just killed is waited for, a listened-on port is not."""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

from agentstream.infra.processes import LOWEST_FREE_PORT, free_port, port_is_free, wait_until_port_is_free


def bound_socket(port: int) -> socket.socket:
    """A socket holding ``port`` the way a killed process's closing sockets do: bound, accepting nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    return sock


def test_a_port_released_within_the_grace_is_free():
    port = free_port()
    holder = bound_socket(port)
    threading.Timer(0.5, holder.close).start()
    started = time.monotonic()
    assert wait_until_port_is_free("127.0.0.1", port, within_s=5.0)
    assert time.monotonic() - started >= 0.4


def test_a_port_still_held_after_the_grace_is_not_free():
    port = free_port()
    with bound_socket(port):
        started = time.monotonic()
        assert not wait_until_port_is_free("127.0.0.1", port, within_s=0.5)
        assert time.monotonic() - started >= 0.5


def test_a_port_with_a_listener_is_taken_at_once():
    port = free_port()
    with bound_socket(port) as listener:
        listener.listen()
        started = time.monotonic()
        assert not wait_until_port_is_free("127.0.0.1", port, within_s=5.0)
        assert time.monotonic() - started < 1.0


def test_free_ports_lie_below_the_ephemeral_range_where_no_client_connection_takes_them():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(LOWEST_FREE_PORT <= port < low for port in ports) and len(ports) > 40
    with bound_socket(port := free_port()):
        assert port_is_free("127.0.0.1", port) is False


def test_after_a_crash_a_listener_still_closing_is_waited_out():
    port = free_port()
    holder = bound_socket(port)
    holder.listen()
    threading.Timer(0.5, holder.close).start()
    started = time.monotonic()
    assert wait_until_port_is_free("127.0.0.1", port, within_s=5.0, after_crash=True)
    assert time.monotonic() - started >= 0.4


def test_a_port_is_handed_out_once_even_when_the_draw_repeats(monkeypatch):
    monkeypatch.setattr(random, "randrange", lambda low, high: 24680)
    first, second = free_port(), free_port()  # two servers built before either binds
    assert first != second
