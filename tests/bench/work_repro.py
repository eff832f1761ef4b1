"""The bounded-work reproducers (docs/reliability.md) as a client-side measurement, so that any
kvcd binary can be measured, including ones older than the tests' flags and metrics.

    PYTHONPATH=client/python:build/python python3 tests/bench/work_repro.py KVCD [new] [SCENARIO...]

KVCD: the kvcd binary. "new": the binary knows --work_flops_per_byte (the memory scenario then
also runs with a budget generous enough to compute every hostile shape). Scenarios: horizon,
memory, sigterm_and_deadline, fairness (default: all of these), and speed (the engine's compress
seconds for a few specs, with --compress_nice=0 on a new kvcd). Needs the Python client's dependencies
(grpcio, protobuf, numpy). Prints one block per scenario; nothing is asserted.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

import kvc  # noqa: E402  (PYTHONPATH: client/python and the generated stubs)
from kvc.launcher import KvcdProcess

BIN = sys.argv[1]
NEW = "new" in sys.argv[2:]
MiB = 1 << 20


def start(*flags):
    k = KvcdProcess(BIN, ["--backend=cpu", "--threads=2", *flags], start_timeout=120,
                    prefix="kvc_work_repro_")
    return k.proc, k.address, k.log


def cpu(pid):
    s = open(f"/proc/{pid}/stat").read()
    f = s[s.rfind(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def cores(pid, seconds):
    c0, t0 = cpu(pid), time.time()
    time.sleep(seconds)
    return (cpu(pid) - c0) / (time.time() - t0)


def status(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def term(p, drain_limit=40):
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=drain_limit)
        return f"exited after {time.time() - t0:.2f} s"
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return f"still running {drain_limit} s after SIGTERM (SIGKILLed)"


rng = np.random.default_rng(0)
ROPE = {"theta": 10000, "style": "ROPE_HALF_SPLIT"}


def arr(shape, dtype=np.float16):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def victim_trip(c, victim):
    t0 = time.time()
    c.put("victim", victim, overwrite=True)
    got = c.get("victim", format="dense")
    assert got.layers[0].k.shape[1] == 4096
    return time.time() - t0


VICTIM = [(arr((4, 4096, 128)), arr((4, 4096, 128)), None)]


def horizon():
    print("== horizon 2^30 (2 layers, ~68 KB)")
    p, addr, log = start()
    layers = [(arr((1, 512, 16)), arr((1, 512, 16)), arr((1, 64, 16))) for _ in range(2)]
    comp = {"eviction": {"policy": "expected", "keep_ratio": 0.5, "horizon": 1 << 30}}
    with kvc.Client(addr, stream_timeout=20) as c:
        t0 = time.time()
        try:
            c.put("horizon", layers, compression=comp, rope=ROPE)
            print(f"  put: OK after {time.time() - t0:.2f} s")
        except kvc.KvcError as e:
            print(f"  put: {e.code.name} after {time.time() - t0:.2f} s: {e.details}")
        print(f"  kvcd cores over the next 3 s: {cores(p.pid, 3):.2f}")
        with kvc.Client(addr, stream_timeout=20) as v:
            try:
                print(f"  victim plain put + DENSE get: {victim_trip(v, VICTIM):.3f} s")
            except kvc.KvcError as e:
                print(f"  victim: {e.code.name}: {e.details}")
    print("  SIGTERM:", term(p))


def memory():
    print("== hostile expected-attention memory")
    base = ["--store_bytes=64MiB", "--staging_bytes=66MiB", "--max_cache_bytes=33MiB",
            "--buffer_pool_bytes=32MiB", "--stream_idle_seconds=120"]
    cases = [("cov4096", 4096, 256, 1, 1), ("cov8192a", 8192, 256, 1, 1),
             ("cov8192b", 8192, 256, 1, 1), ("wide", 16384, 8, 16384, 2)]
    for generous in ([False, True] if NEW else [False]):
        flags = base + (["--work_flops_per_byte=131072"] if generous else [])
        p, addr, log = start(*flags)
        results = {}

        def one(name, hq, d, s, nl):
            layers = [(arr((1, s, d)), arr((1, s, d)), arr((hq, 1, d))) for _ in range(nl)]
            with kvc.Client(addr, stream_timeout=600) as c:
                t0 = time.time()
                try:
                    c.put(name, layers, compression={"eviction": {"policy": "expected",
                                                                  "keep_ratio": 0.5}}, rope=ROPE)
                    results[name] = f"OK in {time.time() - t0:.1f} s"
                except kvc.KvcError as e:
                    results[name] = f"{e.code.name}: {e.details[:160]}"
        ts = [threading.Thread(target=one, args=c) for c in cases]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        with kvc.Client(addr) as c:
            for name, *_ in cases:
                try:
                    c.delete(name)
                except kvc.KvcError:
                    pass
        time.sleep(1)
        label = "generous budget" if generous else "default flags"
        print(f"  [{label}] VmHWM {status(p.pid, 'VmHWM') / MiB:.0f} MiB, VmRSS after deletes "
              f"{status(p.pid, 'VmRSS') / MiB:.0f} MiB (bound 64+66+32+128 = 290 MiB)")
        for k, v in results.items():
            print(f"    {k}: {v}")
        term(p)


HEAVY = None


def heavy_layers():
    global HEAVY
    if HEAVY is None:
        HEAVY = [(arr((2, 16384, 128)), arr((2, 16384, 128)), arr((16, 16384, 128)))]
    return HEAVY


KEYFORMER = {"eviction": {"policy": "keyformer", "keep_ratio": 0.5}}


def sigterm_and_deadline():
    print("== heavy spec (keyformer W = S = 16384): client deadline, then SIGTERM")
    p, addr, log = start("--store_bytes=1GiB", "--drain_seconds=1", "--stream_idle_seconds=120")
    with kvc.Client(addr, stream_timeout=4) as c:
        try:
            c.put("late", heavy_layers(), compression=KEYFORMER, overwrite=True)
            print("  put: OK (finished within its 4 s deadline)")
        except kvc.KvcError as e:
            print(f"  put: {e.code.name}")
    print(f"  kvcd cores over the 3 s after the client's deadline: {cores(p.pid, 3):.2f}")
    # Another one whose client waits, then SIGTERM.
    done = {}

    def waiter():
        with kvc.Client(addr, stream_timeout=120) as c:
            try:
                c.put("waiting", heavy_layers(), compression=KEYFORMER, overwrite=True)
                done["s"] = "OK"
            except kvc.KvcError as e:
                done["s"] = e.code.name
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(4)
    print("  SIGTERM (drain 1 s):", term(p))
    t.join()
    print("  waiting client got:", done.get("s"))


def fairness():
    print("== fairness: plain put + DENSE get of 8 MiB, idle vs 2 heavy uploads compressing")
    p, addr, log = start("--store_bytes=1GiB", "--stream_idle_seconds=120")
    with kvc.Client(addr, stream_timeout=60) as v:
        victim_trip(v, VICTIM)
        idle = sorted(victim_trip(v, VICTIM) for _ in range(9))[4]
        stop = [False]

        def load(i):
            with kvc.Client(addr, stream_timeout=600) as c:
                while not stop[0]:
                    try:
                        c.put(f"heavy{i}", heavy_layers(), compression=KEYFORMER, overwrite=True)
                    except kvc.KvcError:
                        pass
        ts = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(2)]
        for t in ts:
            t.start()
        time.sleep(6)
        loaded = []
        for _ in range(9):
            try:
                loaded.append(victim_trip(v, VICTIM))
            except kvc.KvcError as e:
                loaded.append(float("inf"))
                print(f"  victim: {e.code.name}: {e.details[:100]}")
        loaded = sorted(loaded)[4]
        print(f"  median idle {idle * 1e3:.1f} ms, loaded {loaded * 1e3:.1f} ms "
              f"({loaded / idle:.2f}x)")
        stop[0] = True
    print("  SIGTERM:", term(p, 20))


def speed():
    print("== engine speed: compress seconds of one layer (Hkv 8, Hq 32, D 128, S 8192, fp16), "
          "median of 5")
    p, addr, log = start("--store_bytes=1GiB", *(["--compress_nice=0"] if NEW else []))
    specs = [("snapkv W=64", 64, {"eviction": {"policy": "snapkv", "keep_ratio": 0.25}}),
             ("expected W=64", 64, {"eviction": {"policy": "expected", "keep_ratio": 0.25}}),
             ("keyformer W=S", 8192, {"eviction": {"policy": "keyformer", "keep_ratio": 0.25}}),
             ("snapkv+think+q4", 64, {"eviction": {"policy": "snapkv", "keep_ratio": 0.25},
                                      "channels": {"key_policy": "think", "key_lambda": 0.5},
                                      "quant": {"bits": 4}})]
    with kvc.Client(addr, stream_timeout=600) as c:
        for name, w, comp in specs:
            layers = [(arr((8, 8192, 128)), arr((8, 8192, 128)), arr((32, w, 128)))]
            times = []
            for _ in range(5):
                r = c.put("speed", layers, compression=comp, rope=ROPE, overwrite=True)
                times.append(r.compress.total_seconds)
            print(f"  {name}: {sorted(times)[2] * 1e3:.1f} ms")
    term(p)


SCENARIOS = {"speed": speed, "horizon": horizon, "memory": memory, "sigterm_and_deadline": sigterm_and_deadline,
             "fairness": fairness}
ARGS = [a for a in sys.argv[2:] if a != "new" and a != "old"]
for name in ARGS or [n for n in SCENARIOS if n != "speed"]:
    SCENARIOS[name]()
