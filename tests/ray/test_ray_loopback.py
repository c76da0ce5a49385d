"""A local Ray cluster (the tests' and `placement = "ray"` without an address) stays on loopback:
its node and GCS are registered on 127.0.0.1, actors see 127.0.0.1 as their node IP, and the
GCS cannot be reached on the machine's other interface addresses."""

from __future__ import annotations

import socket

import psutil  # a dependency of Ray


def test_local_ray_cluster_node_and_gcs_are_on_loopback(ray_cluster):
    ray = ray_cluster
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert nodes and {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}, nodes
    gcs_host, gcs_port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    assert gcs_host == "127.0.0.1"
    assert (
        ray.get(ray.remote(num_cpus=0)(ray.util.get_node_ip_address).remote()) == "127.0.0.1"
    )  # what actors rendezvous on
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    for addr in others:  # nothing listens for the GCS beyond loopback
        with socket.socket() as s:
            s.settimeout(2.0)
            assert s.connect_ex((addr, int(gcs_port))) != 0, f"the GCS accepts connections on {addr}"
