#!/usr/bin/env bash
# Build the two base images a DejaVu deployment needs from Debian packages alone, for a Docker host that
# reaches a Debian mirror but no container registry (docs/deployment.md, "Without a registry").
#
#   dejavu-local/python:3.11-bookworm  Debian bookworm (minbase) + python3 + python3-venv: the OS of every
#                                      DejaVu image (build argument OS_IMAGE of base.Dockerfile)
#   dejavu-local/redis:7-bookworm      Debian bookworm (minbase) + redis-server, /data owned by uid 999:
#                                      what compose.yaml runs as Redis (REDIS_IMAGE)
#
# Each is a root file system made by `debootstrap --variant=minbase` and loaded with `docker import`. An
# image whose 'org.dejavu.recipe' label equals this script's SHA-256 is kept, so a repeated run costs
# nothing; the downloaded .deb files stay in DEBOOTSTRAP_CACHE for the next build. Needs root (debootstrap
# and chroot) and debootstrap. The mirror defaults to the first Debian one apt is configured with.
set -euo pipefail

DOCKER=${DOCKER:-docker}
SUITE=bookworm
PYTHON_IMAGE=${LOCAL_PYTHON_IMAGE:-dejavu-local/python:3.11-bookworm}
REDIS_IMAGE=${LOCAL_REDIS_IMAGE:-dejavu-local/redis:7-bookworm}
CACHE=${DEBOOTSTRAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dejavu/debootstrap}
recipe=$(sha256sum "$0" | cut -d' ' -f1)

# The first http(s) Debian mirror among apt's sources (deb822 'URIs:' or one-line 'deb' entries).
default_mirror() {
    grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
        | grep -oE 'https?://[^ ]*/debian/?( |$)' | head -n 1 | tr -d ' ' || true
}
MIRROR=${DEBIAN_MIRROR:-$(default_mirror)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

current() { # IMAGE: true iff it exists and was made by this very script
    [ "$($DOCKER image inspect -f '{{index .Config.Labels "org.dejavu.recipe"}}' "$1" 2>/dev/null)" = "$recipe" ]
}

if current "$PYTHON_IMAGE" && current "$REDIS_IMAGE"; then
    echo "local base images are up to date: $PYTHON_IMAGE $REDIS_IMAGE" >&2
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "local-base.sh: debootstrap needs root; run it with sudo (or pull the public base images)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "local-base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/dejavu-rootfs.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$CACHE"

# rootfs DIR PACKAGES: a minimal bookworm in DIR with PACKAGES, stripped of what an image never reads.
rootfs() {
    local dir=$1 packages=$2
    echo "debootstrap $SUITE ($packages) from $MIRROR" >&2
    debootstrap --variant=minbase --include="$packages" --cache-dir="$CACHE" "$SUITE" "$dir" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
        "$dir"/var/log/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
        "$dir"/tmp/* "$dir"/root/.cache
    # Docker provides these at run time; the host's copies must not leak into the image.
    : >"$dir/etc/resolv.conf"
    : >"$dir/etc/hostname"
}

# import DIR IMAGE CHANGES...: load DIR as IMAGE with the given Dockerfile instructions.
import() {
    local dir=$1 image=$2
    shift 2
    local changes=(--change "LABEL org.dejavu.recipe=$recipe" --change "ENV LANG=C.UTF-8")
    for change in "$@"; do changes+=(--change "$change"); done
    tar -C "$dir" --numeric-owner -cf - . | $DOCKER import "${changes[@]}" - "$image" >/dev/null
    echo "imported $image ($($DOCKER image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
}

if ! current "$PYTHON_IMAGE"; then
    rootfs "$work/python" python3,python3-venv,passwd
    import "$work/python" "$PYTHON_IMAGE" 'CMD ["python3"]'
    rm -rf "$work/python"
fi

if ! current "$REDIS_IMAGE"; then
    rootfs "$work/redis" redis-server
    # The official redis image's uid/gid (999) owns /data, so a new volume mounted there is writable by it.
    sed -i '/^redis:/d' "$work/redis/etc/passwd" "$work/redis/etc/group" "$work/redis/etc/shadow" "$work/redis/etc/gshadow"
    echo 'redis:x:999:999::/data:/usr/sbin/nologin' >>"$work/redis/etc/passwd"
    echo 'redis:x:999:' >>"$work/redis/etc/group"
    mkdir -p "$work/redis/data"
    chown 999:999 "$work/redis/data"
    import "$work/redis" "$REDIS_IMAGE" 'USER 999:999' 'WORKDIR /data' 'VOLUME /data' 'EXPOSE 6379' \
        'CMD ["redis-server"]'
fi
