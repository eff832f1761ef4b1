"""kvc rows: the path users take. A real kvcd (started here on an ephemeral loopback port), the
kvc Python client, one PutCache per document and row (per layer K, V, the observation queries
Q_obs of the last W positions where the spec reads them (for `kvzip`, the S queries of the
reconstruction pass, recon.py), query statistics where it asks for them), then GetCache as DENSE (kept keys at their original positions, per-head positions, -1 for
padding) or CONTIGUOUS (keys turned back so the kept tokens sit in slots 0..K-1, decoding
continues at position K), and the cache is decoded in the transformers model.

Row names: `kvc:SPEC[|w=W][|fmt=contiguous]`, SPEC a kvc spec string (docs/usage.md). A keep
ratio `POLICY:R` is sent as the budget int(S * (1 - (1 - R))), the token count kvpress keeps
(compute_n_kept), so kvc and kvpress rows of one ratio keep the same number of tokens.
"""

import os

import torch

import kvc
from kvc import spec as kvc_spec
from kvc.launcher import KvcdProcess
from kvc.recon import add_passes

from .model import RowCache, queries, query_stats, rope_spec


def exit_on_sigterm():
    """Turn SIGTERM into SystemExit, so `with Kvcd(...)` stops the kvcd it started when the
    harness is terminated (the default action would leave kvcd running)."""
    import signal
    import sys
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class Kvcd(KvcdProcess):
    """kvcd on 127.0.0.1:0 with a client; stop() (or the context manager) ends both."""

    def __init__(self, binary, store="4GiB", threads=1):
        if not binary or not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"kvcd binary {binary!r} not found (build target kvcd; "
                                    "--kvcd or KVCD_PATH)")
        super().__init__(binary, [f"--store_bytes={store}", f"--threads={threads}",
                                  "--max_message_bytes=64MiB", "--max_chunk_bytes=32MiB"],
                         start_timeout=60, prefix="kvc_sbs_")
        self.client = kvc.Client(self.address, max_chunk_bytes=32 << 20,
                                 max_message_bytes=64 << 20, timeout=120, stream_timeout=600)

    def stop(self, stop_timeout=30.0):
        if getattr(self, "client", None):
            self.client.close()
        super().stop(stop_timeout)


class Remote:
    """A client of a kvcd started elsewhere (worker processes share the harness's kvcd)."""

    def __init__(self, address):
        self.address = address
        self.client = kvc.Client(address, max_chunk_bytes=32 << 20, max_message_bytes=64 << 20,
                                 timeout=120, stream_timeout=600)


def parse_row(name):
    """(spec string, options) of `kvc:SPEC|k=v...`."""
    body = name[len("kvc:"):] if name.startswith("kvc:") else name
    spec, *opts = body.split("|")
    options = {}
    for o in opts:
        k, _, v = o.partition("=")
        options[k] = v
    return spec, options


def budget_for(S, keep):
    """Tokens a head keeps of S at keep ratio `keep`: kvpress's compute_n_kept of the press
    built with compression_ratio = 1 - keep, in the same floating point (int(1000 * 0.1) is 100
    but int(1000 * (1 - 0.9)) is 99)."""
    return max(1, int(S * (1.0 - (1.0 - keep))))


def config_for(spec, S):
    """The CompressionConfig dict of a spec for a context of S tokens (keep ratio -> budget)."""
    cfg = kvc_spec.parse(spec)
    ev = cfg.get("eviction")
    if ev and "keep_ratio" in ev:
        ev["budget"] = budget_for(S, ev.pop("keep_ratio"))
    return cfg


_COUNTER = [0]


class Uploads:
    """What the kvc rows of one scenario upload, made once and shared by every row: per layer
    K and V in the upload dtype ([Hkv, S, D], contiguous), Q_obs of the last W positions and the
    query statistics (kvpress's: every position after the first `skip`)."""

    def __init__(self, shadow, layers_in, dtype, recon=None):
        self.shadow, self.layers_in, self.dtype = shadow, layers_in, dtype
        self.recon = recon  # recon.Reconstruction: kvzip rows' Q_obs
        self.kv = [(x.keys[0].to(dtype).contiguous(), x.values[0].to(dtype).contiguous())
                   for x in layers_in]
        self._q, self._stats = {}, {}

    def q_obs(self, W):
        if W not in self._q:
            with torch.no_grad():
                self._q[W] = [queries(self.shadow.model.layers[i].self_attn, x, W)[1]
                              .to(self.dtype).contiguous() for i, x in enumerate(self.layers_in)]
        return self._q[W]

    def recon_q(self):
        """kvzip rows' Q_obs: the reconstruction passes' queries (all of them: W = S + 9 with
        SmolLM2 for a context of one chunk), in the upload dtype."""
        if self.recon is None:
            raise ValueError("kvzip rows need the reconstruction pass (recon.Reconstruction)")
        if "recon" not in self._q:
            self._q["recon"] = [q.to(self.dtype).contiguous() for q in self.recon.q_obs]
        return self._q["recon"]

    def recon_lse(self):
        """kvzip rows' q_stats with stats=1: each reconstruction row's log-mass [Hq, W]."""
        if self.recon is None:
            raise ValueError("kvzip rows need the reconstruction pass (recon.Reconstruction)")
        return [x.float().contiguous() for x in self.recon.lse]

    def q_stats(self, skip):
        if skip not in self._stats:
            with torch.no_grad():
                self._stats[skip] = [query_stats(self.shadow.model.layers[i].self_attn, x, skip)
                                     for i, x in enumerate(self.layers_in)]
        return self._stats[skip]


def compress(server, name, uploads, window, fmt="dense"):
    """RowCache of kvc row `name` through kvcd, from the scenario's Uploads; the response's
    stored and input bytes ride along (stored_bytes, input_bytes)."""
    spec, opts = parse_row(name)
    W = int(opts.get("w", window))
    fmt = opts.get("fmt", fmt)
    layers_in = uploads.layers_in
    S = layers_in[0].keys.shape[2]
    if opts.get("passes") == "1":
        # kvzip normalised per reconstruction pass (the sinks and the pass's chunk), as
        # KVzipPress does: the spec names each pass's rows (kvc.recon.add_passes).
        if uploads.recon is None:
            raise ValueError("|passes=1 needs the reconstruction pass (a kvzip row)")
        counts = [n if opts.get("rows") != "context" else end - start
                  for start, end, n in uploads.recon.pass_spans]
        spec = add_passes(spec, counts, uploads.recon.chunk)
    cfg = config_for(spec, S)
    ev = cfg.get("eviction", {})
    # kvzip's rows: every row of the reconstruction pass, or with `|rows=context` its last S
    # (the copied context tokens only, W = S: what kvc sent before kvcd took W > S for kvzip).
    def recon_rows(xs):
        return xs if opts.get("rows") != "context" else [x[:, -S:].contiguous() for x in xs]

    if ev.get("policy") == "kvzip":
        q = recon_rows(uploads.recon_q())
    elif kvc_spec.needs_queries(cfg):
        q = uploads.q_obs(W)
    else:
        q = [None] * len(layers_in)
    if not ev.get("query_stats"):
        st = None
    elif ev.get("policy") == "kvzip":
        st = recon_rows(uploads.recon_lse())
    else:
        st = uploads.q_stats(int(opts.get("skip", 4)))
    layers = [(k, v, q[i]) if st is None else (k, v, q[i], st[i])
              for i, (k, v) in enumerate(uploads.kv)]
    rope = rope_spec(uploads.shadow.config)
    _COUNTER[0] += 1
    cid = f"sbs-{os.getpid()}-{_COUNTER[0]}"
    c = server.client
    resp = c.put(cid, layers, compression=cfg, rope=rope)
    try:
        data = c.get(cid, format="contiguous" if fmt == "contiguous" else "dense",
                     rope=rope if fmt == "contiguous" else None, tensors="torch")
    finally:
        c.delete(cid)
    out, positions = [], []
    for layer in data.layers:
        p = torch.as_tensor(layer.positions).long()
        out.append((torch.as_tensor(layer.k).to(uploads.layers_in[0].keys.dtype),
                    torch.as_tensor(layer.v).to(uploads.layers_in[0].keys.dtype), p >= 0))
        positions.append(p)
    row = RowCache(out)
    row.positions = positions
    row.shift = S - out[0][0].shape[1] if fmt == "contiguous" else 0
    row.stored_bytes = resp.stored_bytes
    row.input_bytes = resp.input_bytes
    return row


def stored_fraction_fp16(server, name, shadow, layers_in, window, recon=None):
    """Bytes kvcd stores for this row with an fp16 upload, over the fp16 K + V bytes (the
    kvpress keep-1.0 cache in fp16)."""
    row = compress(server, name, Uploads(shadow, layers_in, torch.float16, recon), window)
    return row.stored_bytes / row.input_bytes
