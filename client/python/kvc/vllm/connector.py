"""KvcConnector: kvc as an out-of-tree vLLM V1 KV connector.

    python -m vllm.entrypoints.openai.api_server --model DIR ... --kv-transfer-config \\
      '{"kv_connector": "KvcConnector", "kv_connector_module_path": "kvc.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"target": "127.0.0.1:50051", "spec": "q8"}}'

vLLM builds one instance per process: role SCHEDULER in the engine core (kvc.vllm.scheduler)
and role WORKER next to the KV tensors (kvc.vllm.worker); they share only the per-step
metadata (kvc.vllm.jobs). The extra config is described in kvc.vllm.config, the request
parameters in kvc.vllm.spec and the whole flow in docs/vllm.md.
"""

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorRole)

from .config import ConnectorConfig
from .model import ModelInfo
from .scheduler import SchedulerSide
from .transfer import Replicas
from .worker import WorkerSide

log = logging.getLogger("vllm.kvc")


class KvcConnector(KVConnectorBase_V1):
    """Prefill instances stream each request's prompt cache to kvcd layer by layer; decode
    instances load it (full length, or K evicted tokens) into vLLM's own paged blocks."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig(tc.kv_connector_extra_config, tc.kv_load_failure_policy)
        self.model = ModelInfo(vllm_config, kv_cache_config, self.cfg.extra)
        self.replicas = Replicas(self.cfg.target, self.cfg.client_options)
        qstats = None
        if self.cfg.query_stats:
            from . import qstats as qs
            m = self.model
            qstats = qs.load(self.cfg.query_stats, num_layers=m.num_layers,
                             num_q_heads=m.num_q_heads, head_dim=m.head_dim,
                             model_fingerprint=m.fingerprint)
        self._sched = self._work = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, self.model, self.replicas, qstats is not None,
                                        can_save=tc.is_kv_producer, can_load=tc.is_kv_consumer)
        else:
            self._work = WorkerSide(self.cfg, self.model, self.replicas, qstats, vllm_config)
        log.info("kvc: KvcConnector %s, role %s, kvcd %s, spec %s, policy %s, load %s, "
                 "evicted %s, model %s", role.name, tc.kv_role, self.cfg.target,
                 self.cfg.default_spec, self.cfg.policy, self.cfg.load, self.cfg.evicted,
                 self.model.fingerprint)

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._work.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if meta.loads:
            self._work.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name):
        if self._work.step_sync:
            self._work.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        meta = self._get_connector_metadata()
        if meta.saves:
            self._work.save_kv_layer(meta, layer_name, kv_layer)

    def wait_for_save(self):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if meta.saves:
                self._work.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids):
        return self._work.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids):
        r = self._work.transfer_results(finished_req_ids)
        return set(r.finished_sending) or None, set(r.finished_recving) or None

    def get_block_ids_with_load_errors(self):
        return self._work.block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._work.worker_meta()

    def shutdown(self):
        if self._work is not None:
            self._work.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
        self.replicas.close()

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._sched.request_finished(request, block_ids)
