"""Builds the kvc package: generates the gRPC stubs of proto/kvcache/v1/*.proto with grpcio-tools.

The .proto files live at the top of the source tree (../../proto from here), or where
$KVC_PROTO_DIR points (the folder that holds kvcache/v1/). The stubs go into the package as
kvc/_proto/kvcache/v1/ with their imports rewritten to that package, so they never clash with
stubs generated elsewhere (client/python/gen_stubs.sh writes a top-level `kvcache` package for
the Debian-python path). The installed package requires the protobuf runtime that grpcio-tools
generated for (same major version, at least the generator's version) and a matching grpcio.
"""

import os
import pathlib
import re

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTO_FILES = ("kvcache/v1/kvcache.proto", "kvcache/v1/transfer.proto")


def proto_root():
    root = pathlib.Path(os.environ.get("KVC_PROTO_DIR") or HERE.parent.parent / "proto")
    missing = [f for f in PROTO_FILES if not (root / f).is_file()]
    if missing:
        raise SystemExit(
            f"kvc build: {', '.join(missing)} not found under {root}. Build from the kvc source "
            "tree (pip install ./client/python from the repository root keeps ../../proto in "
            "reach) or set KVC_PROTO_DIR to the folder that holds kvcache/v1/*.proto.")
    return root


def generate(out_pkg_dir):
    """Writes kvc/_proto/... under `out_pkg_dir` (the folder that holds the kvc package)."""
    from grpc_tools import protoc
    import grpc_tools
    root = proto_root()
    out = pathlib.Path(out_pkg_dir) / "kvc" / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={out}",
            f"--grpc_python_out={out}"] + [str(root / f) for f in PROTO_FILES]
    if protoc.main(args) != 0:
        raise SystemExit("kvc build: grpc_tools.protoc failed on " + " ".join(PROTO_FILES))
    for d in (out, out / "kvcache", out / "kvcache" / "v1"):
        (d / "__init__.py").touch()
    for f in (out / "kvcache" / "v1").glob("*.py"):
        text = f.read_text()
        fixed = re.sub(r"^from kvcache\.v1 import", "from kvc._proto.kvcache.v1 import", text,
                       flags=re.M)
        if fixed != text:
            f.write_text(fixed)


class BuildPy(build_py):
    def run(self):
        super().run()
        # A normal build writes into build_lib; an editable install (pip install -e) reads the
        # package from the source tree, so the stubs go there (ignored by git).
        generate(HERE if getattr(self, "editable_mode", False) else self.build_lib)


def dependencies():
    from google.protobuf import __version__ as pb_version
    from importlib.metadata import version
    major = int(pb_version.split(".")[0])
    return ["numpy", f"protobuf>={pb_version},<{major + 1}",
            f"grpcio>={version('grpcio-tools').split('.post')[0]}"]


setup(cmdclass={"build_py": BuildPy}, install_requires=dependencies())
