#!/usr/bin/env python3
"""kvc's C++ reference transformer against Hugging Face transformers on the same tokens.

  hf_logits_test.py --dump PATH/hf_logits_dump --mode random
  hf_logits_test.py --dump PATH/hf_logits_dump --mode smollm2

random: small LlamaForCausalLM configs generated here (f32, bf16 and f16 weights; GQA, MHA and a
head_dim that is not hidden/heads; tied and untied classifiers; linear and llama3 RoPE scaling;
one file and shards; transformers 5's rope_parameters and the older rope_theta/rope_scaling keys),
written with save_pretrained into a temporary directory.
smollm2: the real SmolLM2-135M-Instruct directory ($KVC_SMOLLM2_DIR, else
${XDG_CACHE_HOME:-~/.cache}/kvc/models/SmolLM2-135M-Instruct).

Both compare the logits of kvc's Forward (every position) and DecodeStep (the first positions,
one token at a time) with transformers' LlamaForCausalLM run in float32 on the same weights (bf16
and f16 weights are upcast exactly), and require max |difference| <= 1e-3 x max |logit|.
Exit 77 with a "SKIPPED: ..." line when torch/transformers or the SmolLM2 directory is missing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

TOLERANCE = 1e-3  # of the logit scale, max |logit|


def skip(reason):
    print(f"SKIPPED: {reason}")
    sys.exit(77)


try:
    import numpy as np
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the project's .venv (deploy/setup-python.sh) has them
    skip(f"hf_logits_test: {e.name or e} is not importable by {sys.executable} "
         "(set -DKVC_VENV_PYTHON or create .venv with deploy/setup-python.sh)")


def kvc_logits(dump, model_dir, tokens, decode):
    """Forward logits [S, V] and DecodeStep logits [decode, V] from hf_logits_dump."""
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = os.path.join(tmp, "tokens.txt")
        out_path = os.path.join(tmp, "logits.f32")
        with open(tok_path, "w") as f:
            f.write(" ".join(str(t) for t in tokens))
        run = subprocess.run([dump, model_dir, tok_path, out_path, str(decode)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"hf_logits_dump failed ({run.returncode}): {run.stderr}")
        vocab, s, n = (int(x) for x in run.stdout.split())
        raw = np.fromfile(out_path, dtype="<f4")
        assert raw.size == (s + n) * vocab, (raw.size, s, n, vocab)
        return raw[: s * vocab].reshape(s, vocab), raw[s * vocab:].reshape(n, vocab)


def hf_logits(model_dir, tokens):
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def compare(name, dump, model_dir, tokens, decode):
    ref = hf_logits(model_dir, tokens)
    fwd, dec = kvc_logits(dump, model_dir, tokens, decode)
    scale = float(np.abs(ref).max())
    d_fwd = float(np.abs(fwd - ref).max())
    d_dec = float(np.abs(dec - ref[:decode]).max()) if decode else 0.0
    ok = d_fwd <= TOLERANCE * scale and d_dec <= TOLERANCE * scale and scale > 0
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(tokens)} tokens, max|logit| {scale:.3f}, "
          f"max|Forward - transformers| {d_fwd:.3g} ({d_fwd / scale:.2e} of scale), "
          f"max|DecodeStep - transformers| over {decode} {d_dec:.3g} ({d_dec / scale:.2e})")
    return ok


# The random configs' common sizes (each case overrides some).
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def random_cases():
    return [
        # name, config overrides, weight dtype, max_shard_size, legacy rope keys, tokens
        ("f32_gqa_tied", dict(tie_word_embeddings=True), torch.float32, None, False, 200),
        ("bf16_untied_wide_heads_llama3",
         dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              tie_word_embeddings=False,
              rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64)),
         torch.bfloat16, None, False, 300),
        ("f16_mha_linear_sharded",
         dict(num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True,
              rope_parameters=dict(rope_type="linear", rope_theta=100000.0, factor=4.0)),
         torch.float16, "100KB", False, 250),
        ("f32_untied_legacy_rope_keys",
         dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="linear", rope_theta=20000.0, factor=2.0)),
         torch.float32, None, True, 150),
    ]


def write_random_model(folder, overrides, dtype, shard, legacy, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**BASE, **overrides})
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # weights large enough that logits span several units
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * 1.5)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    if legacy:  # the keys transformers 4 wrote: rope_theta beside rope_scaling {"type": ...}
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            j = json.load(f)
        rp = j.pop("rope_parameters")
        j["rope_theta"] = rp.pop("rope_theta")
        rp["type"] = rp.pop("rope_type")
        j["rope_scaling"] = rp
        with open(path, "w") as f:
            json.dump(j, f, indent=2)


def run_random(dump):
    ok = True
    rng = np.random.default_rng(7)
    for i, (name, overrides, dtype, shard, legacy, n) in enumerate(random_cases()):
        with tempfile.TemporaryDirectory() as folder:
            write_random_model(folder, overrides, dtype, shard, legacy, seed=100 + i)
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            tokens = [1] + rng.integers(0, BASE["vocab_size"], n - 1).tolist()
            ok &= compare(f"{name} ({len(files)} safetensors file(s))", dump, folder, tokens,
                          decode=min(n, 64))
    return ok


def smollm2_dir():
    env = os.environ.get("KVC_SMOLLM2_DIR")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvc", "models", "SmolLM2-135M-Instruct")


def smollm2_tokens(folder, n):
    """Natural text through the model's own tokenizer when it ships one, else seeded ids."""
    text = ""
    for path in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"):
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text = f.read()
            break
    if text and os.path.exists(os.path.join(folder, "tokenizer.json")):
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        ids = tok(text)["input_ids"]
        if len(ids) >= n:
            return ids[:n], "license text"
    rng = np.random.default_rng(3)
    vocab = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
    return rng.integers(0, vocab, n).tolist(), "random ids"


def run_smollm2(dump):
    folder = smollm2_dir()
    if not os.path.exists(os.path.join(folder, "config.json")):
        skip(f"hf_logits_test: no SmolLM2 directory at {folder} (deploy/setup-python.sh "
             "converts it; or set KVC_SMOLLM2_DIR)")
    tokens, source = smollm2_tokens(folder, 1024)
    return compare(f"SmolLM2 ({source})", dump, folder, tokens, decode=96)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True, help="the hf_logits_dump binary")
    ap.add_argument("--mode", choices=["random", "smollm2"], required=True)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"tolerance {TOLERANCE} x max|logit|")
    ok = run_random(args.dump) if args.mode == "random" else run_smollm2(args.dump)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
