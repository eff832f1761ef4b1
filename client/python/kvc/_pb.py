"""The generated stubs (client/python/gen_stubs.sh or the kvc_python_stubs CMake target)."""

try:
    from kvcache.v1 import kvcache_pb2 as pb
    from kvcache.v1 import kvcache_pb2_grpc as pb_grpc  # noqa: F401
except ImportError as e:  # pragma: no cover - a setup error, said plainly
    raise ImportError(
        "kvc: the gRPC stubs are missing; run client/python/gen_stubs.sh build/python and put "
        "build/python on PYTHONPATH (" + str(e) + ")") from e
