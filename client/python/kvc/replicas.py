"""Replica sets: the same target forms and rendezvous hashing as the C++ client (kvc/replicas.h).

weight(id, replica) = XXH3_64bits_withSeed(id, XXH3_64bits(replica)); the owner is the replica of
highest weight, equal weights going to the lexicographically smaller address. Every client, in
either language, given the same replica set, picks the same owner for every cache id.
"""

import ctypes
import ctypes.util
import socket

from .errors import KvcError, invalid

import grpc

try:  # Debian: python3-xxhash
    import xxhash as _xxhash

    def _xxh3_64(data, seed=0):
        return _xxhash.xxh3_64_intdigest(data, seed=seed)

except ImportError:  # libxxhash0 comes with grpc's own dependencies on Debian
    _lib = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
    _lib.XXH3_64bits_withSeed.restype = ctypes.c_uint64
    _lib.XXH3_64bits_withSeed.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]

    def _xxh3_64(data, seed=0):
        return _lib.XXH3_64bits_withSeed(bytes(data), len(data), seed)


def _utf8(s):
    return s.encode("utf-8") if isinstance(s, str) else bytes(s)


def rendezvous_weight(cache_id, replica):
    return _xxh3_64(_utf8(cache_id), seed=_xxh3_64(_utf8(replica)))


def rendezvous_owner(cache_id, replicas):
    """Index of the owner of `cache_id` in `replicas` (not empty)."""
    if not replicas:
        raise invalid("replicas: empty")
    best, best_weight = 0, None
    for i, r in enumerate(replicas):
        w = rendezvous_weight(cache_id, r)
        if best_weight is None or w > best_weight or (w == best_weight and r < replicas[best]):
            best, best_weight = i, w
    return best


def _resolve_dns(name_port):
    if name_port.startswith("["):
        close = name_port.find("]")
        if close < 0 or close + 1 >= len(name_port) or name_port[close + 1] != ":":
            raise invalid(f"target: bad address '{name_port}'")
        host, port = name_port[1:close], name_port[close + 2:]
    else:
        colon = name_port.rfind(":")
        if colon < 0:
            raise invalid(f"target: '{name_port}' needs a port (dns:///name:port)")
        host, port = name_port[:colon], name_port[colon + 1:]
    if not host or not port:
        raise invalid(f"target: bad address '{name_port}'")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise KvcError(grpc.StatusCode.UNAVAILABLE, f"target: cannot resolve '{host}': {e}")
    out = set()
    for family, _, _, _, addr in infos:
        if family == socket.AF_INET:
            out.add(f"{addr[0]}:{port}")
        elif family == socket.AF_INET6:
            out.add(f"[{addr[0]}]:{port}")
    if not out:
        raise KvcError(grpc.StatusCode.UNAVAILABLE, f"target: '{host}' has no addresses")
    return sorted(out)


def resolve_target(target):
    """"dns:///name:port" -> every address; "a,b,c" -> the entries sorted; else [target]."""
    t = target.strip()
    if not t:
        raise invalid("target: empty")
    if t.startswith("dns:///"):
        return _resolve_dns(t[7:])
    if t.startswith("dns://"):
        raise invalid(f"target: '{t}': a DNS authority is not supported, use dns:///name:port")
    if "," not in t:
        return [t]
    out = []
    for part in t.split(","):
        entry = part.strip()
        if not entry:
            raise invalid(f"target: empty entry in list '{t}'")
        out.append(entry)
    return sorted(set(out))
