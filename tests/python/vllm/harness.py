"""Processes for the vLLM tests and benchmark: kvcd (TLS + bearer token), a TCP relay that can
cut or slow a connection, vLLM OpenAI servers with KvcConnector, kvc-pd-proxy; and helpers
(metrics, requests, the tiny 'other model').

Every process is started in its own session and stopped with its whole process group, so
vLLM's engine and worker processes never outlive a test run.
"""

import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cores():
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def vllm_cpu_unsupported():
    """None, or why vLLM's CPU build cannot run on this machine."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((l for l in f if l.startswith("flags")), "").split()
    except OSError:
        return None
    return None if "avx2" in flags else "vLLM's CPU build needs AVX2; this CPU has none"


class Proc:
    """A process in its own session, logging to a file; stop() ends its whole group."""

    def __init__(self, name, argv, log_dir, env=None):
        self.name = name
        self.log_path = os.path.join(log_dir, name + ".log")
        self.log = open(self.log_path, "w+b")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def output(self, tail=6000):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            data = f.read()
        return data[-tail:].decode(errors="replace")

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # children (vLLM's engine and worker) may outlive the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)


def make_tls(directory):
    """CA, server certificate for 127.0.0.1 and a bearer token: (ca, cert, key, tokens, token)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)
    run("req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.pem", "-subj",
        "/CN=kvc-vllm-test-ca")
    with open(os.path.join(directory, "server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kvcd")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", "server.pem", "-extfile", "server.ext")
    token = "vllm-test-" + os.urandom(8).hex()
    with open(os.path.join(directory, "tokens"), "w") as f:
        f.write(f"{token} vllm-tests\n")
    with open(os.path.join(directory, "token"), "w") as f:
        f.write(token + "\n")
    p = lambda n: os.path.join(directory, n)  # noqa: E731
    return p("ca.pem"), p("server.pem"), p("server.key"), p("tokens"), p("token")


class Kvcd:
    """kvcd on a fixed loopback port (so it can be restarted in place), TLS and a token."""

    def __init__(self, binary, log_dir, tls, port=None, store="2GiB"):
        self.binary, self.log_dir, self.tls = binary, log_dir, tls
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.store = store
        self.proc = None
        self.runs = 0

    def start(self):
        self.runs += 1
        flags = []
        if self.tls:
            ca, cert, key, tokens, _ = self.tls
            flags = [f"--tls_cert_file={cert}", f"--tls_key_file={key}",
                     f"--auth_tokens_file={tokens}"]
        self.proc = Proc(f"kvcd{self.runs}", [
            self.binary, f"--listen={self.address}", "--health_listen=",
            f"--metrics_listen=127.0.0.1:{self.metrics_port}", f"--store_bytes={self.store}",
            "--threads=2", *flags], self.log_dir)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError("kvcd exited: " + self.proc.output())
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("kvcd did not listen within 60 s: " + self.proc.output())

    def stop(self):
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def client(self, address=None):
        import kvc
        if not self.tls:
            return kvc.Client(address or self.address, max_attempts=1, timeout=10)
        ca, _, _, _, token_file = self.tls
        with open(token_file) as f:
            token = f.read().strip()
        return kvc.Client(address or self.address, tls=True, ca_file=ca, token=token,
                          max_attempts=1, timeout=10)

    def served_bytes(self):
        return metric(requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                   timeout=5).text, "kvc_served_bytes_total")


class Relay:
    """A TCP relay to 127.0.0.1:target. cut_after(n): after n more bytes from the target, close
    every connection once; throttle(rate): server->client bytes per second (None: off)."""

    def __init__(self, target_port):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns = []
        self._cut = None
        self._rate = None
        self.cuts = 0
        self.down_bytes = 0  # bytes relayed from the target, all connections
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, nbytes):
        with self._lock:
            self._cut = nbytes

    def throttle(self, rate):
        with self._lock:
            self._rate = rate

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True),
                             daemon=True).start()

    def _close_all(self):
        for a, b in self._conns:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._conns = []

    def _pump(self, src, dst, downstream):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if downstream:
                    with self._lock:
                        self.down_bytes += len(data)
                        rate, cut = self._rate, self._cut
                        if cut is not None:
                            if len(data) >= cut:
                                data = data[:cut]
                                self._cut = None
                                self.cuts += 1
                                dst.sendall(data)
                                self._close_all()
                                return
                            self._cut = cut - len(data)
                    if rate:
                        time.sleep(len(data) / rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._closed = True
        self.sock.close()
        with self._lock:
            self._close_all()


def connector_config(role, policy, extra):
    return json.dumps({"kv_connector": "KvcConnector", "kv_connector_module_path": "kvc.vllm",
                       "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": extra})


class Vllm:
    """`python -m vllm.entrypoints.openai.api_server` on one core with KvcConnector."""

    def __init__(self, name, model, core, log_dir, kv_config=None, dtype="float32",
                 extra_args=(), python=sys.executable, cache_gib=1):
        self.name, self.model = name, model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # vLLM leaves IPC sockets and a distributed-init file in $TMPDIR when it is stopped;
        # a short private folder (socket paths are limited to 107 bytes) goes with stop().
        self.tmp = tempfile.mkdtemp(prefix="kvc_vllm_")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=str(core), TMPDIR=self.tmp)
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", "m", "--dtype", dtype, "--enforce-eager",
                "--max-model-len", "4096", "--port", str(self.port), "--host", "127.0.0.1",
                "--disable-uvicorn-access-log", *extra_args]
        if kv_config is not None:
            argv += ["--kv-transfer-config", kv_config]
        self.proc = Proc(name, argv, log_dir, env)
        self.started = time.monotonic()

    def wait_ready(self, timeout=900):
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"vLLM {self.name} exited:\n{self.proc.output()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_seconds = time.monotonic() - self.started
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not ready within {timeout} s:\n"
                           f"{self.proc.output()}")

    def stop(self):
        self.proc.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def metrics(self):
        return requests.get(self.url + "/metrics", timeout=10).text

    def external_tokens(self):
        return metric(self.metrics(), "vllm:prompt_tokens_by_source_total",
                      'source="external_kv_transfer"')

    def wait_idle(self, timeout=120):
        """Waits until no request runs or waits and no KV block is in use (vLLM's gauges);
        returns the last values. Blocks held by the prefix cache count as free in vLLM."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            vals = (metric(m, "vllm:num_requests_running"), metric(m, "vllm:num_requests_waiting"),
                    metric(m, "vllm:kv_cache_usage_perc"))
            if vals == (0, 0, 0) or time.monotonic() > deadline:
                return vals
            time.sleep(0.2)

    def complete(self, body, timeout=300):
        return requests.post(self.url + "/v1/completions", json={"model": "m", **body},
                             timeout=timeout)


def metric(text, name, label=""):
    """The sum of the samples of metric `name` whose labels contain `label`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and label in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def make_tiny_model(directory, tokenizer_dir, seed=0):
    """A 2-layer random Llama sharing SmolLM2's tokenizer: 'another model' for the fingerprint."""
    import shutil
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=100000.0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copy(src, directory)
    return directory
