#!/usr/bin/env bash
# Makes the Dockerfile's base image, python:3.11-slim, available to podman, for the container
# tests (tests/deploy/test_container.py, `make container-test`) and `podman build --pull=never`:
#   1. nothing to do if podman already has it;
#   2. else pull it (docker.io/library/python:3.11-slim);
#   3. else (no registry reachable) build a stand-in tagged localhost/python:3.11-slim: a minimal
#      Debian bookworm from debootstrap (this machine's apt mirror) with Debian's Python 3.11,
#      pip and a compiler. Needs root, debootstrap and network access to the apt mirror.
# Idempotent; the stand-in takes a few minutes the first time. Podman itself is not installed
# here: the tests skip without it.
set -euo pipefail
IMAGE=python:3.11-slim

command -v podman >/dev/null || { echo "podman is not installed" >&2; exit 2; }
if podman image exists "$IMAGE" || podman image exists "localhost/$IMAGE"; then
  echo "have $IMAGE"; exit 0
fi
if podman pull -q "docker.io/library/$IMAGE" >/dev/null 2>&1; then
  echo "pulled $IMAGE"; exit 0
fi

echo "no registry: building localhost/$IMAGE from debootstrap" >&2
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$MIRROR" ] || MIRROR=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
ROOT=$(mktemp -d /tmp/base-rootfs.XXXX)
WORK=$(mktemp -d /tmp/base-build.XXXX)
trap 'rm -rf "$ROOT" "$WORK"' EXIT
debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log"
# the host's apt sources and extra CA certificates (a proxy's), so apt and pip work inside
cp /etc/apt/sources.list.d/*.sources "$ROOT/etc/apt/sources.list.d/" 2>/dev/null && rm -f "$ROOT/etc/apt/sources.list" || true
cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$ROOT" update-ca-certificates >/dev/null
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
tar -C "$ROOT" -c . | podman import --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - localhost/debian-base:bookworm >/dev/null
cat > "$WORK/Containerfile" <<'CF'
FROM localhost/debian-base:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev gcc g++ \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
 && ln -sf /usr/bin/python3 /usr/local/bin/python && ln -sf /usr/bin/pip3 /usr/local/bin/pip
CMD ["python3"]
CF
podman build --isolation chroot -q -t "localhost/$IMAGE" "$WORK" >/dev/null
echo "built localhost/$IMAGE"
