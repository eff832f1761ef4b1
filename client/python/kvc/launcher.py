"""kvcd as a child process on an ephemeral loopback port: the one launcher of the Python tests,
the side-by-side harness and the benchmark scripts (the C++ tools have client/launcher)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time


class KvcdProcess:
    """Starts `binary` listening on 127.0.0.1:0 with no health or metrics listener, followed by
    `flags` (later flags override earlier ones), and waits up to `start_timeout` seconds for the
    port it writes to --port_file. RuntimeError with kvcd's output when it exits or does not
    answer in time. `address` is "127.0.0.1:PORT", `proc` the Popen, `dir` a temporary folder
    holding kvcd.log; output() is what kvcd printed; stop() (or leaving a `with` block) sends
    SIGTERM and waits up to `stop_timeout` seconds, then kills. stop() removes the folder when
    kvcd exited cleanly (status 0); otherwise it keeps it, says where on stderr, and output()
    still answers."""

    def __init__(self, binary, flags=(), start_timeout=30.0, prefix="kvcd_"):
        if not binary or not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"kvcd binary {binary!r} not found or not executable")
        self.dir = tempfile.mkdtemp(prefix=prefix)
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "kvcd.log"), "w+b")
        self.proc = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--health_listen=", "--metrics_listen=",
             "--port_file=" + port_file, *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while True:
            if os.path.exists(port_file):
                with open(port_file) as f:
                    address = f.read().strip()
                if address:
                    self.address = address
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvcd did not start: " + self.output())
            time.sleep(0.02)

    @property
    def pid(self):
        return self.proc.pid

    def output(self):
        if self.log.closed:
            return self._final_output
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, stop_timeout=30.0):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log.closed:
            return
        self._final_output = self.output()
        self.log.close()
        if self.proc.returncode == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"kvcd (pid {self.proc.pid}) exited with status {self.proc.returncode}; its "
                  f"log is kept in {self.dir}", file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
