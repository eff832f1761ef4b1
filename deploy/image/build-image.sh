#!/usr/bin/env bash
# Builds kvc's container images with podman, from Debian packages alone: no container registry
# is needed. The base image is made locally (mmdebstrap or debootstrap) from the Debian mirror
# the host's apt uses, imported under the name the Dockerfile uses, and cached (podman storage
# and a tarball under $KVC_IMAGE_CACHE) so later runs on the same machine reuse it.
#
#   build-image.sh base                   make (or reuse) the Debian 12 base image
#   build-image.sh full [TAG] [ARGS...]   deploy/docker/Dockerfile, as documented in OPERATIONS.md
#                                         (default TAG kvcd:0.1.0; ARGS go to `podman build`,
#                                         e.g. --build-arg BUILD_IMAGE=... for CUDA)
#   build-image.sh runtime BUILD_DIR [TAG]
#                                         the Dockerfile's runtime stage around an already built
#                                         BUILD_DIR/service/kvcd and client/kvcctl/kvcctl
#                                         (default TAG localhost/kvcd-runtime:dev)
#
# Podman runs with deploy/image/containers.conf and storage.conf (CONTAINERS_CONF,
# CONTAINERS_STORAGE_CONF), not the host's /etc/containers. Needs root, podman, runc and
# mmdebstrap or debootstrap (Debian: apt-get install podman runc mmdebstrap). Environment:
#   KVC_IMAGE_CACHE  base image tarball cache (default /var/cache/kvc-image)
#   DEBIAN_MIRROR    Debian mirror for the base and apt in the images (default: the host's)
#   DEBIAN_IMAGE     base image name (default docker.io/library/debian:bookworm; the runtime
#                    stage uses ${DEBIAN_IMAGE}-slim, which is tagged on the same image)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export CONTAINERS_CONF=$HERE/containers.conf
export CONTAINERS_STORAGE_CONF=$HERE/storage.conf
CACHE=${KVC_IMAGE_CACHE:-/var/cache/kvc-image}
DEBIAN_IMAGE=${DEBIAN_IMAGE:-docker.io/library/debian:bookworm}
SUITE=bookworm

say() { echo "build-image: $*" >&2; }
die() { say "$*"; exit 1; }

# The first deb.debian.org-style mirror in the host's apt sources, else deb.debian.org.
host_mirror() {
  local uri
  uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
          /etc/apt/sources.list.d/*.sources |
        grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n1 | tr -d ' ')
  echo "${uri:-http://deb.debian.org/debian}"
}

image_exists() { podman image exists "$1" 2>/dev/null; }

# base: a minbase Debian 12 (mmdebstrap, about twice as fast, or else debootstrap), with the
# updates and security suites enabled as in Debian's own images, apt lists, documentation and
# locales removed as in Debian's slim images; imported as $DEBIAN_IMAGE and $DEBIAN_IMAGE-slim.
make_base() {
  if image_exists "$DEBIAN_IMAGE" && image_exists "$DEBIAN_IMAGE-slim"; then
    say "base image $DEBIAN_IMAGE is present"
    return
  fi
  local tarball=$CACHE/debian-$SUITE-minbase.tar
  if [[ ! -s $tarball ]]; then
    local tool
    tool=$(command -v mmdebstrap || command -v debootstrap) ||
      die "neither mmdebstrap nor debootstrap is installed (apt-get install mmdebstrap)"
    local mirror=${DEBIAN_MIRROR:-$(host_mirror)}
    local security=${mirror%/debian*}/debian-security
    local dir
    mkdir -p "$CACHE"
    dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$dir"; trap - RETURN' RETURN
    say "$(basename "$tool") --variant=minbase $SUITE from $mirror (minutes)"
    local t0=$SECONDS
    local opts=(--variant=minbase)
    # mmdebstrap merges /usr itself with this hook; without it, it installs usrmerge and perl.
    if [[ $tool == *mmdebstrap && -d /usr/share/mmdebstrap/hooks/merged-usr ]]; then
      opts+=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
    fi
    "$tool" "${opts[@]}" "$SUITE" "$dir" "$mirror" >"$CACHE/bootstrap.log" 2>&1 ||
      die "$(basename "$tool") failed; see $CACHE/bootstrap.log"
    cat >"$dir/etc/apt/sources.list" <<EOF
deb $mirror $SUITE main
deb $mirror $SUITE-updates main
deb $security $SUITE-security main
EOF
    # Keep images small: no apt caches, no documentation (as Debian's slim images).
    cat >"$dir/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT::Install-Recommends "false";
EOF
    cat >"$dir/etc/dpkg/dpkg.cfg.d/docker-excludes" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin \
      "$dir"/var/cache/apt/archives/*.deb "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
      "$dir"/usr/share/locale/*
    find "$dir"/usr/share/doc -mindepth 2 ! -name copyright ! -type d -delete
    tar --numeric-owner -C "$dir" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    say "$(basename "$tool") took $((SECONDS - t0)) s; cached $tarball"
  fi
  podman import --quiet "$tarball" "$DEBIAN_IMAGE" >/dev/null
  podman tag "$DEBIAN_IMAGE" "$DEBIAN_IMAGE-slim"
  say "imported $tarball as $DEBIAN_IMAGE and $DEBIAN_IMAGE-slim"
}

build() {
  local t0=$SECONDS
  # --pull=never: the base comes from local storage, never from a registry. Docker's image
  # format, because OCI images cannot carry the Dockerfile's SHELL (bash with pipefail).
  podman build --pull=never --format docker "$@"
  say "podman build took $((SECONDS - t0)) s"
}

cmd=${1:-}
shift || true
case $cmd in
  base)
    make_base
    ;;
  full)
    tag=${1:-kvcd:0.1.0}
    shift || true
    make_base
    build -f "$ROOT/deploy/docker/Dockerfile" \
      --ignorefile "$ROOT/deploy/docker/Dockerfile.dockerignore" \
      --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" -t "$tag" "$@" "$ROOT"
    say "$tag: $(podman image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
    ;;
  runtime)
    [[ $# -ge 1 ]] || die "usage: $0 runtime BUILD_DIR [TAG]"
    bdir=$(cd "$1" && pwd)
    tag=${2:-localhost/kvcd-runtime:dev}
    for bin in service/kvcd client/kvcctl/kvcctl; do
      [[ -x $bdir/$bin ]] || die "$bdir/$bin is not built"
    done
    make_base
    ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' EXIT
    # The runtime stage needs no build context; the binaries get a context of their own.
    build -f "$ROOT/deploy/docker/Dockerfile" --target runtime-base \
      --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" -t localhost/kvcd-runtime-base:dev "$ctx"
    cp "$bdir/service/kvcd" "$bdir/client/kvcctl/kvcctl" "$ctx/"
    build -f "$HERE/prebuilt.Containerfile" \
      --build-arg RUNTIME_BASE=localhost/kvcd-runtime-base:dev -t "$tag" "$ctx"
    say "$tag: $(podman image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
