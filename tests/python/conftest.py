"""Fixtures: a real kvcd (KVCD_PATH) on an ephemeral loopback port, started per test module."""

import os

import pytest

from kvc.launcher import KvcdProcess


class Kvcd(KvcdProcess):
    def __init__(self, flags=()):
        binary = os.environ.get("KVCD_PATH")
        if not binary:
            pytest.skip("KVCD_PATH is not set (run through ctest)")
        super().__init__(binary, ["--store_bytes=64MiB", "--threads=2", *flags], prefix="kvc_py_")


@pytest.fixture(scope="module")
def kvcd():
    server = Kvcd()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def make_kvcd():
    started = []

    def make(*flags):
        server = Kvcd(flags)
        started.append(server)
        return server
    yield make
    for server in started:
        server.stop()
