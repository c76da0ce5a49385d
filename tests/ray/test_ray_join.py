"""Joining a Ray cluster at `run.ray_address` never hangs (issue 25, item 26).

Default run, no Ray processes: an address where nothing listens fails within the probe time
with a `ConfigError` naming `run.ray_address`, the address and what to check (before this fix
`ray.init` retried the GCS every 5 s with no end); a loopback head that listens on loopback
only gets the loopback setting (a plain TCP listener on 127.0.0.1 stands in for its GCS port:
the probe only connects). The real two-node cluster is in `test_ray_join_two_nodes_slow.py`.
"""

from __future__ import annotations

import socket
import time

import pytest

from verst.rollout.errors import ConfigError
from verst.trainer.placement.ray_cluster import LOOPBACK_ENV, connect
from verst.trainer.placement.ray_join import interface_ip, join_settings, split_address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_addresses_are_parsed_or_left_to_ray():
    assert split_address("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert split_address("[::1]:6379") == ("::1", 6379)
    assert split_address("auto") is None and split_address("ray://head:10001") is None


def test_an_unreachable_address_fails_in_bounded_time_naming_it():
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        connect(address, namespace="verst-join-test", init_options={}, probe_s=3.0)
    assert time.monotonic() - started < 20
    message = str(info.value)
    assert "run.ray_address" in message and address in message and "ray status --address" in message


def test_a_loopback_only_head_gets_the_loopback_setting():
    with socket.socket() as head:  # listens on 127.0.0.1 only, like a head started on loopback
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        settings = join_settings(f"127.0.0.1:{port}", probe_s=3.0)
    if interface_ip() is None:
        assert settings == {}  # no interface address: Ray keeps the loopback one anyway
    else:
        assert settings == LOOPBACK_ENV


def test_a_head_on_every_interface_needs_nothing():
    with socket.socket() as head:
        head.bind(("0.0.0.0", 0))
        head.listen()
        assert join_settings(f"127.0.0.1:{head.getsockname()[1]}", probe_s=3.0) == {}
