"""kvc's own Python flow on a Hugging Face model, without vLLM: the reference the evicted mode is
compared with.

transformers computes the prompt's cache (all but the last token, as the prefill instance
stores it), the Python client puts it to kvcd with the spec (query statistics from the same
kvc-qstats file the connector reads), fetches FORMAT_DENSE_CONTIGUOUS with the model's RoPE, and
decodes the prompt's last token at position K, then greedily onwards. decode() does the same
from a cache another producer (vLLM's prefill instance) stored.
"""

import numpy as np
import torch

from kvc.vllm import model as kvc_model
from kvc.vllm import qstats as kvc_qstats


class Flow:
    def __init__(self, model_dir, qstats_path=None, threads=1):
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.set_num_threads(threads)  # the vLLM instances have the cores
        self.cfg = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.rope = kvc_model.rope_spec(self.cfg)
        self.L = self.cfg.num_hidden_layers
        self.stats = None
        if qstats_path:
            fp = kvc_model.fingerprint(self.cfg, model_dir)
            self.stats = kvc_qstats.load(
                qstats_path, num_layers=self.L, num_q_heads=self.cfg.num_attention_heads,
                head_dim=kvc_model.head_dim_of(self.cfg), model_fingerprint=fp)

    @torch.no_grad()
    def run(self, client, cache_id, prompt_ids, spec_config, new_tokens=1):
        """Stores the prompt's cache as `cache_id` with the spec, then decode() from it."""
        S = len(prompt_ids) - 1
        out = self.model(torch.tensor([prompt_ids[:S]]), use_cache=True)
        pkv = out.past_key_values
        layers = []
        expected = spec_config.get("eviction", {}).get("policy") == "expected"
        for l in range(self.L):
            k, v = pkv.layers[l].keys[0].contiguous(), pkv.layers[l].values[0].contiguous()
            if expected:
                layers.append((k, v, None, torch.from_numpy(self.stats.q_stats[l])))
            else:
                layers.append((k, v))
        client.put(cache_id, layers, compression=spec_config,
                   rope=self.rope if expected else None)
        return self.decode(client, cache_id, prompt_ids[-1], new_tokens)

    @torch.no_grad()
    def decode(self, client, cache_id, last_token, new_tokens=1):
        """Fetches the evicted cache `cache_id` (any producer's) as FORMAT_DENSE_CONTIGUOUS with
        the model's RoPE and decodes `last_token` at position K, then greedily onwards:
        (logprobs of the first generated token [V], kept K, greedy token ids, the kept prompt
        positions per layer [Hkv, K])."""
        from transformers import DynamicCache
        data = client.get(cache_id, format="contiguous", rope=self.rope, tensors="torch")
        K = data.layers[0].kept_tokens
        cache = DynamicCache()
        for l, layer in enumerate(data.layers):
            cache.update(torch.as_tensor(layer.k)[None], torch.as_tensor(layer.v)[None], l)
        positions = [np.asarray(layer.positions) for layer in data.layers]
        tok, pos, first, gen = last_token, K, None, []
        for _ in range(new_tokens):
            logits = self.model(torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]),
                                past_key_values=cache, use_cache=True).logits[0, -1]
            lp = torch.log_softmax(logits.double(), dim=-1)
            if first is None:
                first = lp
            tok = int(lp.argmax())
            gen.append(tok)
            pos += 1
        return first, K, gen, positions


def kept_difference(a, b):
    """The fraction of kept (layer, head, position) entries of positions `a` missing from `b`
    (both as decode() returns them)."""
    missing, total = 0, 0
    for la, lb in zip(a, b):
        for ha, hb in zip(la.reshape(la.shape[0], -1), lb.reshape(lb.shape[0], -1)):
            missing += len(set(ha.tolist()) - set(hb.tolist()))
            total += ha.size
    return missing / max(1, total)


def passkey_prompts(tokenizer, count=4, filler_repeats=8):
    """Pass-key prompts (token ids) and their keys: a key in filler text, then the question."""
    rng = np.random.default_rng(7)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    out = []
    for i in range(count):
        key = str(int(rng.integers(10000, 99999)))
        before = filler_repeats * (i + 1) // (count + 1) + 1
        text = (filler * before + f"The pass key is {key}. Remember it. " +
                filler * (filler_repeats - before + 2) +
                "What is the pass key? The pass key is")
        out.append((tokenizer(text, add_special_tokens=False).input_ids, key))
    return out
