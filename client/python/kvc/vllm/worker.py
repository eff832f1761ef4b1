"""The worker side of KvcConnector (vLLM's worker process, next to the paged KV tensors).

Saving: save_kv_layer runs right after each layer's attention; for every SaveJob of the step it
gathers the job's tokens of that layer from vLLM's blocks (PagedLayout) and queues them on the
request's PutCache stream, so kvcd receives and compresses layer l while the model computes
l + 1. wait_for_save (once per step, after the forward pass) closes the streams whose prompt is
complete and waits, up to save_timeout, for kvcd's answer; a failure is logged and never fails
the request.

Loading: start_load_kv starts one background GetCache stream per LoadJob; each layer is written
into the request's own blocks through vLLM's cache update as soon as it arrives. A "sync" job
(loaded during the request's own forward pass) is waited for layer by layer in
wait_for_layer_load and any failure is reported as that request's blocks in
get_block_ids_with_load_errors; an "async" job (the request waits outside the batch) is reported
through get_transfer_results, failures as failed_recving. Writes happen under a per-load lock
that cancellation takes, so once a load is reported (done, failed, timed out or its request
aborted) nothing writes into those blocks again: no other request's blocks are ever touched.
"""

import concurrent.futures
import copy
import logging
import threading
import time

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from .._pb import pb
from .. import _common
from ..errors import KvcError
from .jobs import KvcWorkerMetadata
from .layout import PagedLayout, slots_for
from .packed import unpack_layer
from .spec import SpecError
from .transfer import Upload

log = logging.getLogger("vllm.kvc")

_WIRE_DTYPE = {torch.float32: pb.DTYPE_F32, torch.float16: pb.DTYPE_F16,
               torch.bfloat16: pb.DTYPE_BF16}


def _bytes(t):
    """A memoryview of a CPU tensor's bytes (keeps the tensor alive)."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy().data


class _Load:
    def __init__(self, job, num_layers, deadline):
        self.job = job
        self.events = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.cancelled = False
        self.error = None
        self.stream = None
        self.bytes = 0
        self.tokens = 0
        self.t0 = time.monotonic()
        self.deadline = deadline

    def fail(self, reason):
        """Stops the load; after this returns nothing writes into the job's blocks."""
        with self.lock:
            self.cancelled = True
            if self.error is None:
                self.error = reason
        stream = self.stream
        if stream is not None:
            stream.close()
        for e in self.events:
            e.set()

    def result(self):
        return (self.tokens, self.bytes, time.monotonic() - self.t0, self.error)


class WorkerSide:
    def __init__(self, cfg, model, replicas, qstats, vllm_config):
        self.cfg, self.model, self.replicas, self.qstats = cfg, model, replicas, qstats
        self.vllm_config = vllm_config
        self.manager_block_size = vllm_config.cache_config.block_size
        self.kv, self.layouts, self.index = {}, {}, {}
        self.names = list(model.layer_names)
        self.uploads = {}       # req_id -> [Upload, layers given their extra tensors]
        self.loads = {}         # req_id -> _Load (async ones until reported)
        self.step_sync = []     # this step's sync loads
        self.results = {}       # req_id -> result tuple, for the scheduler
        self.pool = concurrent.futures.ThreadPoolExecutor(4, "kvc-load")
        self.stats = {"saved_bytes": 0, "saved": 0, "save_failures": 0, "loaded_bytes": 0,
                      "loads": 0, "load_failures": 0, "save_seconds": 0.0}

    # ---- registration -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.names)
        learned = {}
        for i, name in enumerate(self.names):
            if name not in kv_caches or name not in layers:
                raise SpecError(f"KvcConnector: no KV cache or attention layer named {name}")
            t, layer = kv_caches[name], layers[name]
            if t.device.type != "cpu":
                raise SpecError(f"KvcConnector: layer {name} is on {t.device}; this connector "
                                f"moves CPU caches (GPU-direct transfer is left for later)")
            key = (t.dtype, getattr(layer, "isa", None), tuple(t.shape[1:]), t.stride(),
                   type(layer.impl))
            if key not in learned:
                learned[key] = PagedLayout(layer, t, self.model.num_kv_heads,
                                           self.model.head_dim)
            lay = copy.copy(learned[key])
            lay.layer, lay.impl = layer, layer.impl
            self.kv[name], self.layouts[name], self.index[name] = t, lay, i
        first = self.layouts[self.names[0]]
        self.dtype = first.dtype
        log.info("kvc: %d layers, backend %s, isa %s, %s, kernel block %d, manager block %d",
                 len(self.names), first.backend_name, first.isa, self.dtype, first.block_size,
                 self.manager_block_size)

    # ---- saving -----------------------------------------------------------------------------

    def _open(self, job):
        m = self.model
        think = job.spec.get("channels", {}).get("key_policy") == "think"
        h = pb.PutCacheHeader(cache_id=job.cache_id, dtype=_WIRE_DTYPE[self.dtype],
                              layout=pb.LAYOUT_NHD, ttl_seconds=self.cfg.ttl_seconds)
        h.shape.CopyFrom(pb.ModelShape(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                                       num_q_heads=m.num_q_heads, head_dim=m.head_dim,
                                       seq_len=job.seq_len, obs_window=1 if think else 0))
        h.compression.CopyFrom(_common.message(pb.CompressionConfig, job.spec, "spec"))
        if h.compression.eviction.policy == "expected":
            h.compression.eviction.query_stats = True
            if m.rope is None:
                raise SpecError(m.rope_error)
            h.rope.CopyFrom(_common.message(pb.RopeSpec, m.rope, "rope"))
        if (think or h.compression.eviction.query_stats) and self.qstats is None:
            raise SpecError("the spec needs query statistics and none are configured")
        up = Upload(self.replicas, job.replica, h,
                    self.cfg.client_options.get("max_chunk_bytes", 4 << 20),
                    self.cfg.stream_timeout)
        return [up, set(), think, h.compression.eviction.query_stats]

    def save_kv_layer(self, meta, layer_name, kv_layer):
        l = self.index.get(layer_name)
        if l is None:
            return
        H, D = self.model.num_kv_heads, self.model.head_dim
        esz = torch.finfo(self.dtype).bits // 8
        for job in meta.saves:
            entry = self.uploads.get(job.req_id)
            if entry is None:
                if not job.first:
                    continue  # its stream already failed to open
                try:
                    entry = self.uploads[job.req_id] = self._open(job)
                except Exception as e:
                    log.error("kvc: request %s: cannot upload its cache: %s", job.req_id, e)
                    self.stats["save_failures"] += 1
                    self.uploads[job.req_id] = None
                    continue
            up, extras_sent, think, stats = entry
            if up.done():
                continue  # failed: finish() reports it
            slots = slots_for(job.block_ids, self.manager_block_size, job.start, job.end)
            k, v = self.layouts[layer_name].gather(kv_layer, slots)
            off = job.start * H * D * esz
            # The layer's queries before its keys and values: kvcd can then score the layer
            # while its V is still arriving.
            if l not in extras_sent:
                extras_sent.add(l)
                if think:
                    q = torch.from_numpy(self.qstats.think_rows(l, H)).to(self.dtype)
                    up.send(l, pb.TENSOR_Q_OBS, 0, _bytes(q))
                if stats:
                    up.send(l, pb.TENSOR_Q_STATS, 0, _bytes(torch.from_numpy(
                        self.qstats.q_stats[l])))
            up.send(l, pb.TENSOR_K, off, _bytes(k))
            up.send(l, pb.TENSOR_V, off, _bytes(v))

    def wait_for_save(self, meta):
        for job in meta.saves:
            if not job.final:
                continue
            entry = self.uploads.pop(job.req_id, None)
            if entry is None:
                continue
            up = entry[0]
            t0 = time.monotonic()
            try:
                resp = up.finish(self.cfg.save_timeout)
                self.stats["saved"] += 1
                self.stats["saved_bytes"] += up.bytes_sent
                self.stats["save_seconds"] += time.monotonic() - up.started
                log.debug("kvc: %s stored: %d -> %d bytes, waited %.3f s", job.cache_id,
                          resp.input_bytes, resp.stored_bytes, time.monotonic() - t0)
            except Exception as e:
                self.stats["save_failures"] += 1
                self.replicas.reset(job.replica, e)
                log.error("kvc: request %s: cache %s not stored: %s", job.req_id, job.cache_id,
                          e)

    # ---- loading ----------------------------------------------------------------------------

    def start_load_kv(self, meta):
        now = time.monotonic()
        for job in meta.loads:
            run = _Load(job, len(self.names), now + self.cfg.load_timeout)
            if job.sync:
                self.step_sync.append(run)
            else:
                self.loads[job.req_id] = run
            if job.fail is not None:
                run.fail(job.fail)
                run.done.set()
            else:
                self.pool.submit(self._load, run)

    def _load(self, run):
        job = run.job
        try:
            client = self.replicas.client(job.replica)
            if job.fmt == "contiguous":
                stream = client.get_stream(job.cache_id, format="contiguous",
                                           rope=self.model.rope, tensors="torch")
            else:
                stream = client.get_stream(job.cache_id, format=job.fmt, tensors="torch")
            run.stream = stream
            if run.cancelled:
                stream.close()
                return
            s = stream.info.shape
            if s.num_layers != len(self.names) or s.seq_len != job.seq_len:
                raise SpecError(f"cache {job.cache_id}: {s.num_layers} layers, seq_len "
                                f"{s.seq_len}; expected {len(self.names)}, {job.seq_len}")
            slots = slots_for(job.block_ids, self.manager_block_size, job.start, job.end)
            count = 0
            storage = None  # the last layer's token-major k, v: reused by the next one
            for layer in stream:
                if layer.kept_tokens != job.kept_tokens:
                    raise SpecError(f"cache {job.cache_id} layer {layer.layer}: "
                                    f"{layer.kept_tokens} tokens, expected {job.kept_tokens}")
                name = self.names[layer.layer]
                if job.fmt == "packed":
                    try:
                        lk, lv, _ = unpack_layer(layer.packed, out=storage,
                                                 tokens=job.kept_tokens)
                    except ValueError as e:
                        raise SpecError(f"cache {job.cache_id} layer {layer.layer}: {e}") from None
                    storage = (lk.transpose(0, 1), lv.transpose(0, 1))
                    run.bytes += len(layer.packed)
                else:
                    lk, lv = torch.as_tensor(layer.k), torch.as_tensor(layer.v)
                    run.bytes += layer.k.nbytes + layer.v.nbytes + layer.positions.nbytes
                k = lk[:, job.start:job.end].transpose(0, 1)
                v = lv[:, job.start:job.end].transpose(0, 1)
                with run.lock:
                    if run.cancelled:
                        return
                    self.layouts[name].write(self.kv[name], slots, k, v)
                run.events[layer.layer].set()
                count += 1
            if count != len(self.names):
                raise SpecError(f"cache {job.cache_id}: {count} of {len(self.names)} layers")
            run.tokens = job.end - job.start
        except Exception as e:
            self.replicas.reset(job.replica, e)
            known = isinstance(e, (KvcError, SpecError))
            run.fail(str(e) if known else f"{type(e).__name__}: {e}")
        finally:
            run.done.set()
            for e in run.events:
                e.set()

    def wait_for_layer_load(self, layer_name):
        l = self.index.get(layer_name)
        if l is None:
            return
        for run in self.step_sync:
            if not run.events[l].wait(max(0.0, run.deadline - time.monotonic())):
                run.fail(f"layer {l} did not arrive within {self.cfg.load_timeout:g} s")

    def _record(self, run):
        if run.error:
            self.stats["load_failures"] += 1
            log.error("kvc: request %s: load of %s failed: %s", run.job.req_id,
                      run.job.cache_id or "(none)", run.error)
        else:
            self.stats["loads"] += 1
            self.stats["loaded_bytes"] += run.bytes
        self.results[run.job.req_id] = run.result()

    def block_ids_with_load_errors(self):
        bad = set()
        for run in self.step_sync:
            if not run.done.wait(max(0.0, run.deadline - time.monotonic())):
                run.fail(f"not loaded within {self.cfg.load_timeout:g} s")
            if run.error:
                j = run.job
                first = j.start // self.manager_block_size
                last = (j.end - 1) // self.manager_block_size
                bad.update(j.block_ids[first:last + 1])
            self._record(run)
        self.step_sync = []
        return bad

    def transfer_results(self, finished_req_ids):
        for req_id in finished_req_ids:
            entry = self.uploads.pop(req_id, None)
            if entry:
                entry[0].cancel()
                log.warning("kvc: request %s finished before its prompt was stored; upload "
                            "cancelled", req_id)
            run = self.loads.get(req_id)
            if run is not None and not run.done.is_set():
                run.fail("request finished (aborted) while its cache was loading")
        done, failed = set(), set()
        now = time.monotonic()
        for req_id, run in list(self.loads.items()):
            if not run.done.is_set() and now > run.deadline:
                run.fail(f"not loaded within {self.cfg.load_timeout:g} s")
            if run.done.is_set() or run.cancelled:
                done.add(req_id)
                if run.error:
                    failed.add(req_id)
                self._record(run)
                del self.loads[req_id]
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=done,
                                          failed_recving=failed)

    def worker_meta(self):
        if not self.results:
            return None
        out, self.results = self.results, {}
        return KvcWorkerMetadata(out)

    def shutdown(self):
        for entry in self.uploads.values():
            if entry:
                entry[0].cancel()
        for run in list(self.loads.values()) + self.step_sync:
            run.fail("shutting down")
        self.pool.shutdown(wait=False, cancel_futures=True)
