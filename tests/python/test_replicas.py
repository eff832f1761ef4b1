"""The Python client picks the same replica as the C++ client for every cache id."""

import os
import random
import string
import subprocess

import pytest

import kvc

ALPHABET = string.ascii_letters + string.digits + "._:/-"


def cpp_owners(target, ids):
    tool = os.environ.get("KVC_REPLICA_OWNER")
    if not tool:
        pytest.skip("KVC_REPLICA_OWNER is not set (run through ctest)")
    out = subprocess.run([tool, target], input="\n".join(ids) + "\n", capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return [line.split(" ", 1)[1] for line in out]


@pytest.mark.parametrize("target", [
    "10.0.0.1:50051,10.0.0.2:50051,10.0.0.3:50051",
    "kvcd-0.kvcd:50051, kvcd-1.kvcd:50051,kvcd-2.kvcd:50051,kvcd-3.kvcd:50051,kvcd-4.kvcd:50051",
    "[::1]:1,127.0.0.1:2",
])
def test_same_owner_as_cpp(target):
    rng = random.Random(7)
    # Every XXH3 length class: 1-3, 4-8, 9-16, 17-128, 129-240 and longer ids.
    ids = ["".join(rng.choice(ALPHABET) for _ in range(rng.choice(
        [1, 2, 3, 5, 8, 12, 16, 17, 64, 128, 129, 200, 240, 241, 256])))
        for _ in range(3000)]
    ids += [f"req-{i}" for i in range(1000)]
    c = kvc.Client(target)
    ours = [c.replicas[c.replica_for(i)] for i in ids]
    theirs = cpp_owners(target, ids)
    assert len(theirs) == len(ids)
    mismatches = [(i, a, b) for i, a, b in zip(ids, ours, theirs) if a != b]
    assert not mismatches, mismatches[:5]
    assert len(set(ours)) == len(c.replicas)  # every replica owns some ids


def test_caches_live_on_their_owner(make_kvcd):
    servers = [make_kvcd(), make_kvcd()]
    target = ",".join(s.address for s in servers)
    ids = [f"py/rep/{i}" for i in range(12)]
    owners = cpp_owners(target, ids)
    import numpy as np
    layer = tuple(np.ones(shape, np.float32) for shape in ((1, 8, 16), (1, 8, 16), (1, 0, 16)))
    with kvc.Client(target) as c:
        for i in ids:
            c.put(i, [layer])
        assert [x.cache_id for x in c.list("py/rep/")] == sorted(ids)
    for s in servers:
        with kvc.Client(s.address) as single:
            held = {x.cache_id for x in single.list("py/rep/")}
        assert held == {i for i, o in zip(ids, owners) if o == s.address}
