#!/usr/bin/env python3
"""Static checks of deploy/docker/Dockerfile (no container engine needed).

The build works offline but for Debian packages: no `# syntax=` directive (BuildKit would pull a
frontend image) and no download in any RUN (the CUDA toolkit comes with the build image). The
build stage installs what compiling needs with deploy/setup-debian.sh --build-only and runs CI's
CMake steps (Release, no tests); the runtime stage (with the stages it is built FROM) runs kvcd
as a numeric non-root user, exposes its three ports and starts kvcd listening on all interfaces;
a stage runtime-base holds all of that but the binaries (deploy/image/build-image.sh builds it).
With --kvcd=BIN (a kvcd built on Debian 12), every shared library BIN links must come from a
package the runtime stage installs, one of their dependencies, or the base image.

Usage: check_dockerfile.py DOCKERFILE DOCKERIGNORE [--kvcd=BIN]
"""
import json
import re
import subprocess
import sys

# Packages every Debian base image has; kvcd's C and C++ runtime come from these.
BASE_IMAGE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libzstd1", "liblzma5", "libbz2-1.0"}


def instructions(text):
    """[(stage index, INSTRUCTION, arguments)] with line continuations joined."""
    joined = re.sub(r"\\\n", " ", text)
    out, stage = [], -1
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage += 1
        out.append((stage, word, rest.strip()))
    return out


def stage_chain(froms, stage):
    """Stage indices `stage` is built on, itself last: FROM <earlier stage name> inherits."""
    names = {}
    for index, args in froms:
        m = re.search(r"\s+AS\s+(\S+)\s*$", args, re.IGNORECASE)
        if m:
            names[m.group(1).lower()] = index
    chain = [stage]
    while True:
        base = froms[chain[0]][1].split()[0].lower()
        if base not in names or names[base] in chain:
            return chain
        chain.insert(0, names[base])


def package_closure(roots):
    """The installed packages `roots` depend on, transitively (dpkg's view of this machine)."""
    seen, todo = set(), list(roots)
    while todo:
        pkg = todo.pop()
        if pkg in seen:
            continue
        seen.add(pkg)
        res = subprocess.run(["dpkg-query", "-W", "-f", "${Depends},${Pre-Depends}", pkg],
                             capture_output=True, text=True)
        if res.returncode != 0:
            continue
        for alt in res.stdout.split(","):
            for name in alt.split("|"):
                name = re.sub(r"\(.*?\)|:any", "", name).strip()
                if name:
                    todo.append(name)
    return seen


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if len(args) != 2:
        sys.exit(__doc__)
    dockerfile, dockerignore = args
    text = open(dockerfile).read()
    ins = instructions(text)
    problems = []
    froms = [(s, a) for s, w, a in ins if w == "FROM"]
    if len(froms) < 2:
        problems.append("not multi-stage (fewer than two FROM)")
    last = len(froms) - 1
    chain = stage_chain(froms, last) if froms else []
    build = [a for s, w, a in ins if w == "RUN" and s not in chain]
    final = [(w, a) for s, w, a in ins if s in chain]

    if re.search(r"^\s*#\s*syntax\s*=", text, re.IGNORECASE | re.MULTILINE):
        problems.append("has a '# syntax=' directive (BuildKit would pull a frontend image)")
    for s, w, a in ins:
        if w in ("RUN", "ADD") and re.search(r"\b(wget|curl)\b|https?://", a):
            problems.append(f"{w} downloads outside apt (offline builds fail): {a[:60]}...")
    if not any(re.search(r"\s+AS\s+runtime-base\s*$", a, re.IGNORECASE) for _, a in froms):
        problems.append("has no stage runtime-base (deploy/image/build-image.sh runtime uses it)")
    if not any("deploy/setup-debian.sh --build-only" in r for r in build):
        problems.append("build stage does not run deploy/setup-debian.sh --build-only")
    cmake = " ".join(r for r in build if "cmake -S" in r)
    for want in ("-DCMAKE_BUILD_TYPE=Release", "-DKVC_BUILD_TESTS=OFF", "--target kvcd"):
        if want not in cmake:
            problems.append(f"build stage cmake lacks {want}")

    users = [a for w, a in final if w == "USER"]
    if not users or not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", users[-1]):
        problems.append(f"runtime USER must be a numeric non-root uid[:gid], got {users}")
    exposed = set(" ".join(a for w, a in final if w == "EXPOSE").split())
    for port in ("50051", "50052", "9464"):
        if port not in exposed:
            problems.append(f"runtime stage does not EXPOSE {port}")
    entry = [a for w, a in final if w == "ENTRYPOINT"]
    try:
        entry_argv = json.loads(entry[-1]) if entry else []
    except json.JSONDecodeError:
        entry_argv = []
    if not entry_argv or not entry_argv[0].endswith("/kvcd"):
        problems.append(f"ENTRYPOINT must be the exec form of kvcd, got {entry}")
    cmd = " ".join(a for w, a in final if w == "CMD")
    for flag in ("--listen=0.0.0.0:50051", "--health_listen=0.0.0.0:50052",
                 "--metrics_listen=0.0.0.0:9464"):
        if flag not in cmd:
            problems.append(f"CMD lacks {flag}")

    ignored = {l.strip() for l in open(dockerignore) if l.strip() and not l.startswith("#")}
    for want in (".git", "**/build", "**/build-*", "**/node_modules"):
        if want not in ignored:
            problems.append(f"{dockerignore} does not ignore {want}")

    if "kvcd" in opts:
        runtime_pkgs = set()
        for w, a in final:
            if w == "RUN" and "apt-get install" in a:
                install = a.split("apt-get install", 1)[1].split("&&")[0]
                runtime_pkgs |= {t for t in install.split() if not t.startswith("-")}
        have = package_closure(runtime_pkgs) | package_closure(BASE_IMAGE)
        ldd = subprocess.run(["ldd", opts["kvcd"]], capture_output=True, text=True, check=True)
        libs = re.findall(r"=> (/\S+)", ldd.stdout)
        real = subprocess.run(["readlink", "-f", *libs], capture_output=True,
                              text=True).stdout.split()
        owners = {}
        res = subprocess.run(["dpkg", "-S", *libs, *real], capture_output=True, text=True)
        for line in res.stdout.splitlines():
            pkg, _, path = line.partition(": ")
            owners[path.strip()] = pkg.split(":")[0]
        for lib, target in zip(libs, real):
            owner = owners.get(lib) or owners.get(target)
            if owner is None:
                problems.append(f"kvcd links {lib}, which no Debian package provides")
            elif owner not in have:
                problems.append(f"kvcd links {lib} from {owner}, which the runtime stage lacks")

    if problems:
        for p in problems:
            print(f"FAIL: {dockerfile}: {p}")
        return 1
    libs = ", runtime libraries cover kvcd" if "kvcd" in opts else ""
    print(f"ok: {dockerfile}: {len(froms)} stages, runtime USER {users[-1]}, ports "
          f"{' '.join(sorted(exposed))}{libs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
