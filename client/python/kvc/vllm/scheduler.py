"""The scheduler side of KvcConnector (vLLM's engine-core process).

Prefill (a request whose kv_transfer_params carry "do_remote_decode"): its prompt minus the last
token (S tokens) is streamed to kvcd while it is computed; each step's SaveJob names the tokens
that step computed, so chunked prefill and local prefix-cache hits both end up sent once.
request_finished asks kvcd (StatCache) whether the cache is stored and returns the
kv_transfer_params the decode side needs; an error there never fails the prefill request.

Decode (kv_transfer_params {"do_remote_prefill": true, "kvc": {...}}): get_num_new_matched_tokens
checks the params (version, model fingerprint, that the prompt is the cached one), asks kvcd
(StatCache, in a background thread: the scheduler is told "ask again" meanwhile) and answers the
tokens to load. On any error: with kv_load_failure_policy "recompute" a full-length request is
recomputed (0 tokens); with "fail", or for an evicted cache (its placeholder prompt cannot be
recomputed), the tokens are claimed and the worker fails the load at once, so vLLM finishes the
request with an error. On an instance that refuses evicted caches (policy "recompute") an
evicted request is held ("ask again") until its client gives up; it allocates nothing.
"""

import concurrent.futures
import logging
import secrets
import threading
import time

from .jobs import KvcConnectorMetadata, LoadJob, SaveJob
from .spec import LoadParams, PARAMS_VERSION, SpecError, parse_spec, prompt_hash, sanitize_id

log = logging.getLogger("kvc.vllm")


class _Save:
    def __init__(self, cache_id, replica, spec, seq_len, phash, last_token, error=None):
        self.cache_id, self.replica, self.spec = cache_id, replica, spec
        self.seq_len, self.prompt_hash, self.last_token = seq_len, phash, last_token
        self.error = error
        self.blocks = []
        self.sent = 0
        self.opened = False
        self.final_sent = seq_len == 0


class _Load:
    def __init__(self, params=None, error=None, mode="full"):
        self.params, self.error, self.mode = params, error, mode
        self.future = None
        self.deadline = None
        self.end = 0          # tokens the cache covers in the request (S or K)
        self.claimed = None   # (end, num_external) once allocated
        self.reported = False


class SchedulerSide:
    def __init__(self, cfg, model, replicas, qstats_available, can_save, can_load):
        self.cfg, self.model, self.replicas = cfg, model, replicas
        self.can_save, self.can_load = can_save, can_load
        self.have_stats = qstats_available
        self.default_spec = parse_spec(cfg.default_spec, have_query_stats=qstats_available)
        self._saves = {}
        self._loads = {}
        self._jobs = []
        self._stat_pool = concurrent.futures.ThreadPoolExecutor(2, "kvc-stat")
        self._lock = threading.Lock()
        self.worker_results = {}

    def shutdown(self):
        self._stat_pool.shutdown(wait=False, cancel_futures=True)

    # ---- prefill --------------------------------------------------------------------------

    def _new_save(self, request):
        params = request.kv_transfer_params or {}
        ids = list(request.prompt_token_ids or ())
        seq_len = max(0, len(ids) - 1)
        phash = prompt_hash(ids[:seq_len])
        last = ids[-1] if ids else 0
        kvc = params.get("kvc") if isinstance(params.get("kvc"), dict) else {}
        try:
            spec = self.default_spec if kvc.get("spec") is None else parse_spec(
                kvc["spec"], have_query_stats=self.have_stats)
        except SpecError as e:
            log.error("kvc: request %s: not saved: %s", request.request_id, e)
            return _Save(None, None, None, seq_len, phash, last, error=f"spec: {e}")
        cache_id = (self.cfg.cache_id_prefix + sanitize_id(request.request_id)[:160] + "-" +
                    secrets.token_hex(6))
        try:
            replica = self.replicas.owner(cache_id)
        except Exception as e:  # a dns:/// target that does not resolve
            log.error("kvc: request %s: not saved: %s", request.request_id, e)
            return _Save(None, None, spec, seq_len, phash, last, error=f"kvcd target: {e}")
        return _Save(cache_id, replica, spec, seq_len, phash, last)

    def _save_step(self, req_id, st, computed, scheduled, out):
        end = min(st.seq_len, computed + scheduled)
        if st.error or st.final_sent or end <= st.sent:
            return
        out.saves.append(SaveJob(req_id, st.cache_id, st.replica, st.spec.config, st.seq_len,
                                 st.sent, end, list(st.blocks), not st.opened,
                                 end == st.seq_len))
        st.opened, st.sent = True, end
        st.final_sent = end == st.seq_len

    def _finished_save(self, request, st):
        base = {"v": PARAMS_VERSION, "seq_len": st.seq_len, "prompt_hash": st.prompt_hash,
                "last_token": st.last_token, "fingerprint": self.model.fingerprint}
        if st.seq_len == 0:
            return {"do_remote_prefill": False, "kvc": {**base, "error": "prompt of one token: "
                                                        "nothing to store"}}
        if st.error is None and not st.final_sent:
            st.error = "the prompt was not fully computed (aborted or preempted)"
        if st.error is None:
            try:
                info = self.replicas.client(st.replica).stat(st.cache_id)
            except Exception as e:
                self.replicas.reset(st.replica, e)
                st.error = f"kvcd has no cache {st.cache_id}: {e}"
        if st.error is not None:
            log.warning("kvc: request %s: %s", request.request_id, st.error)
            return {"do_remote_prefill": True, "kvc": {**base, "cache_id": st.cache_id,
                                                       "error": st.error}}
        kept = set(info.kept_tokens)
        k = info.kept_tokens[0] if len(kept) == 1 else None
        out = {**base, "cache_id": st.cache_id, "replica": st.replica, "spec": st.spec.text,
               "input_bytes": info.input_bytes, "stored_bytes": info.stored_bytes}
        if k is None:
            out["error"] = f"layers keep different token counts {sorted(kept)}"
        else:
            out.update(kept_tokens=k, mode="full" if k == st.seq_len else "evicted")
        return {"do_remote_prefill": True, "kvc": out}

    # ---- decode ---------------------------------------------------------------------------

    def _new_load(self, request):
        params = request.kv_transfer_params
        raw = params.get("kvc") if isinstance(params, dict) else None
        claims_evicted = isinstance(raw, dict) and raw.get("mode") == "evicted"
        try:
            p = LoadParams(params)
        except SpecError as e:
            return _Load(error=f"bad kv_transfer_params: {e}",
                         mode="evicted" if claims_evicted else "full")
        st = _Load(p, mode=p.mode)
        if p.error is not None:
            st.error = f"the prefill side stored no cache: {p.error}"
            return st
        try:
            if p.fingerprint != self.model.fingerprint:
                raise SpecError(f"the cache was made by model {p.fingerprint}, this instance "
                                f"serves {self.model.fingerprint}")
            p.check_prompt(request.prompt_token_ids)
            if p.mode == "evicted":
                if self.cfg.evicted != "accept":
                    raise SpecError("this instance refuses evicted caches (kv_connector_extra_"
                                    "config evicted: refuse, kv_load_failure_policy recompute)")
                if self.model.rope is None:
                    raise SpecError(self.model.rope_error)
            if not p.lossless and not request.cache_salt:
                raise SpecError("a lossy cache must come with a cache_salt, so that vLLM's "
                                "prefix cache never gives its blocks to other requests")
            address = self.replicas.choose(p.replica, p.cache_id)
        except SpecError as e:
            st.error = str(e)
            return st
        except Exception as e:
            st.error = f"kvcd target: {e}"
            return st
        st.address = address
        st.deadline = time.monotonic() + self.cfg.stat_timeout + 1.0
        st.future = self._stat_pool.submit(self.replicas.client(address).stat, p.cache_id)
        return st

    def _check_stat(self, st):
        p = st.params
        try:
            info = st.future.result(timeout=0)
        except Exception as e:
            self.replicas.reset(st.address, e)
            return f"kvcd ({st.address}): {e}"
        s, m = info.shape, self.model
        if (s.num_layers, s.num_kv_heads, s.head_dim) != (m.num_layers, m.num_kv_heads,
                                                           m.head_dim):
            return (f"cache {p.cache_id} has {s.num_layers} layers x {s.num_kv_heads} KV heads x "
                    f"{s.head_dim}, the model {m.num_layers} x {m.num_kv_heads} x {m.head_dim}")
        if s.seq_len != p.seq_len or set(info.kept_tokens) != {p.kept_tokens}:
            return (f"cache {p.cache_id} holds seq_len {s.seq_len}, kept {sorted(set(info.kept_tokens))}"
                    f"; the params say {p.seq_len}, {p.kept_tokens}")
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if not (self.can_load and isinstance(params, dict) and params.get("do_remote_prefill")
                and "kvc" in params):
            return 0, False
        st = self._loads.get(request.request_id)
        if st is None:
            st = self._loads[request.request_id] = self._new_load(request)
        if st.error is None and st.future is not None:
            if not st.future.done():
                if time.monotonic() < st.deadline:
                    return None, False
                st.future.cancel()
                self.replicas.reset(st.address)
                st.error = f"kvcd ({st.address}): no StatCache answer in {self.cfg.stat_timeout:g} s"
            else:
                st.error = self._check_stat(st)
            st.future = None
        n_tokens = request.num_tokens
        if st.error is not None:
            if not st.reported:
                log.error("kvc: request %s: cannot load its cache: %s", request.request_id,
                          st.error)
                st.reported = True
            if st.mode == "evicted" and self.cfg.evicted != "accept":
                return None, False  # cannot fail it and must not recompute placeholders
            if self.cfg.policy == "fail" or st.mode == "evicted":
                end = n_tokens - 1
                if end > num_computed_tokens:
                    st.end = end
                    return end - num_computed_tokens, True  # the worker fails it at once
            return 0, False
        p = st.params
        st.end = p.kept_tokens if p.mode == "evicted" else min(p.seq_len, n_tokens - 1)
        n = st.end - num_computed_tokens
        if n <= 0:
            return 0, False
        sync = (p.load or self.cfg.load) == "sync"
        return n, not sync

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        req_id = request.request_id
        if num_external_tokens > 0 and req_id in self._loads:
            st = self._loads[req_id]
            block_ids = list(blocks.get_block_ids()[0])
            start = st.end - num_external_tokens
            if st.error is not None:
                job = LoadJob(req_id, "", "", st.mode, 0, 0, start, st.end, block_ids,
                              sync=False, fail=st.error)
            else:
                p = st.params
                sync = (p.load or self.cfg.load) == "sync"
                fmt = ("contiguous" if p.mode == "evicted" else "dense" if p.lossless
                       else "packed")
                job = LoadJob(req_id, p.cache_id, st.address, p.mode, p.seq_len, p.kept_tokens,
                              start, st.end, block_ids, sync=sync, fmt=fmt)
            st.claimed = (st.end, num_external_tokens)
            self._jobs.append(job)
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_decode") and \
                req_id not in self._saves and self.can_save:
            self._saves[req_id] = self._new_save(request)

    def build_connector_meta(self, so):
        meta = KvcConnectorMetadata(loads=self._jobs)
        self._jobs = []
        if self._saves:
            for new in so.scheduled_new_reqs:
                st = self._saves.get(new.req_id)
                if st is None:
                    continue
                st.blocks = list(new.block_ids[0])
                self._save_step(new.req_id, st, new.num_computed_tokens,
                                so.num_scheduled_tokens.get(new.req_id, 0), meta)
            cached = so.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                st = self._saves.get(req_id)
                if st is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids:
                    st.blocks = list(new_ids[0]) if new_ids else []
                elif new_ids:
                    st.blocks.extend(new_ids[0])
                self._save_step(req_id, st, cached.num_computed_tokens[i],
                                so.num_scheduled_tokens.get(req_id, 0), meta)
        return meta

    def update_connector_output(self, output):
        wm = getattr(output, "kv_connector_worker_meta", None)
        if wm is not None and getattr(wm, "loads", None):
            for req_id, result in wm.loads.items():
                st = self._loads.get(req_id)
                if st is None:
                    continue  # finished (aborted) before its load was reported
                self.worker_results[req_id] = result
                error = result[3]
                if error and st is not None and st.error is None:
                    # vLLM recomputes a failed full-length load (policy recompute) and asks
                    # again: answer 0 then, never load it a second time.
                    st.error = f"load failed: {error}"
                    st.reported = True

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        out = None
        st = self._saves.pop(req_id, None)
        if st is not None:
            out = self._finished_save(request, st)
        load = self._loads.pop(req_id, None)
        result = self.worker_results.pop(req_id, None)
        if load is not None and result is not None:
            tokens, nbytes, seconds, error = result
            decode = {"loaded_tokens": tokens, "fetched_bytes": nbytes,
                      "load_seconds": round(seconds, 6)}
            if error:
                decode["error"] = error
            out = dict(out or {})
            out["kvc_decode"] = decode
        return False, out
