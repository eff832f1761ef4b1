"""Fixtures: a real kvcd (KVCD_PATH) on an ephemeral loopback port, started per test module."""

import os
import subprocess
import tempfile
import time

import pytest


class Kvcd:
    def __init__(self, flags=()):
        binary = os.environ.get("KVCD_PATH")
        if not binary:
            pytest.skip("KVCD_PATH is not set (run through ctest)")
        self.dir = tempfile.mkdtemp(prefix="kvc_py_")
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "kvcd.log"), "w+b")
        self.proc = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--health_listen=", "--metrics_listen=",
             "--store_bytes=64MiB", "--threads=2", "--port_file=" + port_file, *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if os.path.exists(port_file) and open(port_file).read().strip():
                self.address = open(port_file).read().strip()
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvcd did not start: " + self.output())
            time.sleep(0.02)

    def output(self):
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
