"""The kvpress environment (.venv-kvpress) as the fidelity harness relies on it, checked for real:
kvc imports (pip-installed), and kvpress's presses compress SmolLM2's cache through their forward
hooks with this environment's transformers: every layer keeps the budgeted number of tokens, the
decoding step after the compressed prefill gives finite logits, and the full cache answers a
pass-key question greedily.

Run by ctest with the kvpress venv's Python (tests/testing/venv_run.sh). Exit 77 with
"SKIPPED: ..." only when the SmolLM2 directory is missing (deploy/setup-python.sh makes it).
"""

import importlib.metadata
import sys


def main():
    import kvc
    from kvc.models import smollm2
    assert importlib.metadata.version("kvc") and kvc.Client

    model_dir = smollm2.default_dir()
    if not model_dir.exists():
        print(f"SKIPPED: python_kvpress_venv_test: no SmolLM2 directory at {model_dir} "
              "(deploy/setup-python.sh)")
        sys.exit(77)
    problems = smollm2.check_dir(model_dir)
    assert not problems, f"{model_dir}: " + "; ".join(problems)

    import torch
    import transformers
    transformers.logging.disable_progress_bar()
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    import kvpress  # noqa: F401  (patches the attention functions for head-wise presses)
    from kvpress import (ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress,
                         StreamingLLMPress)

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. "
    text = filler * 6 + "The pass key is 48213. Remember it. " + filler * 6
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    n = ids.shape[1]
    question = tok(" What is the pass key? The pass key is", return_tensors="pt",
                   add_special_tokens=False).input_ids

    with torch.no_grad():
        prompt = torch.cat([ids, question], dim=1)
        full = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                              do_sample=False)
    answer = tok.decode(full[0, n + question.shape[1]:])
    assert "48213" in answer.replace(" ", ""), f"full cache answered {answer!r}"

    ratio = 0.5
    want = int(n * (1 - ratio))  # kvpress: n_kept = int(q_len * (1 - compression_ratio))
    for press in (StreamingLLMPress(compression_ratio=ratio), KnormPress(compression_ratio=ratio),
                  SnapKVPress(compression_ratio=ratio), KeyDiffPress(compression_ratio=ratio),
                  ExpectedAttentionPress(compression_ratio=ratio)):
        name = type(press).__name__
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            model(ids, past_key_values=cache)
        lengths = {cache.layers[i].keys.shape[2] for i in range(model.config.num_hidden_layers)}
        assert lengths == {want}, f"{name}: kept {sorted(lengths)} tokens per layer, want {want}"
        with torch.no_grad():
            step = model(question, past_key_values=cache).logits
        assert torch.isfinite(step).all(), f"{name}: non-finite logits after compression"
    print(f"python_kvpress_venv_test: kvpress {importlib.metadata.version('kvpress')}, "
          f"transformers {transformers.__version__}: {n} tokens -> {want} per layer with 5 "
          f"presses; full cache answered {answer!r}")


if __name__ == "__main__":
    main()
