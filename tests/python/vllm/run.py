"""ctest entry of the vLLM tests: exit 77 with "SKIPPED: <test>: <why>" when they cannot run here,
else pytest on the given files (in this directory)."""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def reason(needs_servers):
    import harness
    why = harness.vllm_cpu_unsupported()
    if why:
        return why
    try:
        import vllm  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        return f"vLLM does not import in this environment: {e}"
    if not os.environ.get("KVCD_PATH"):
        return "KVCD_PATH is not set (run through ctest)"
    if needs_servers:
        from kvc.models import smollm2
        if not os.path.isdir(smollm2.default_dir()):
            return f"no SmolLM2 model directory at {smollm2.default_dir()} (run kvc-smollm2)"
        if not shutil.which("openssl"):
            return "the openssl command-line tool is not on PATH"
    return None


def main():
    name, files = sys.argv[1], sys.argv[2:]
    why = reason(any(f.startswith("test_pd_") for f in files))
    if why:
        print(f"SKIPPED: {name}: {why}")
        return 77
    import pytest
    if os.environ.get("KVC_VLLM_RESULTS"):  # this run's measured lines only
        open(os.environ["KVC_VLLM_RESULTS"], "w").close()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    return pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "--durations=15", *files])


if __name__ == "__main__":
    sys.exit(main())
