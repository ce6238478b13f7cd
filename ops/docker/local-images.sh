#!/usr/bin/env bash
# Builds the two local images that ops/docker/Dockerfile.cpu and Dockerfile.prometheus start from,
# for hosts without Docker Hub (the dev/CI machines; docs/operations.md section 10):
#   local/bookworm:base  Debian bookworm (minbase + ca-certificates + this host's extra CA
#                        certificates, so pip and apt work behind a TLS-inspecting proxy), by mmdebstrap
#   local/wheels:cpu     /wheels/torch-<TORCH_VERSION>-cp311-*.whl (CPU build): taken from WHEELS_DIR
#                        when it holds one, else downloaded from TORCH_INDEX_URL
# An image that exists is kept; FORCE=1 rebuilds. Needs root, mmdebstrap and a running dockerd.
# Usage: ops/docker/local-images.sh
set -euo pipefail

DOCKER=${DOCKER:-$(command -v /usr/bin/docker || command -v docker)}
BASE_IMAGE=${BASE_IMAGE:-local/bookworm:base}
WHEELS_IMAGE=${WHEELS_IMAGE:-local/wheels:cpu}
WHEELS_DIR=${WHEELS_DIR:-/opt/wheels}
TORCH_VERSION=${TORCH_VERSION:-2.13.0+cpu}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
FORCE=${FORCE:-0}

"$DOCKER" info >/dev/null 2>&1 || { echo "no Docker daemon answers $DOCKER info" >&2; exit 1; }
have() { [ "$FORCE" != 1 ] && "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

debian_mirror() {
  # The host's own bookworm mirror (deb822 or one-line sources), else deb.debian.org.
  local uri
  uri=$(grep -hoE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
  [ -n "$uri" ] || uri=$(grep -hoE '^deb +\S+' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    2>/dev/null | head -1 | awk '{print $2}')
  echo "${uri:-http://deb.debian.org/debian}"
}

if have "$BASE_IMAGE"; then
  echo "$BASE_IMAGE: present"
else
  command -v mmdebstrap >/dev/null || { echo "needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
  echo "$BASE_IMAGE: building with mmdebstrap from $(debian_mirror)"
  # The host's extra CAs go in before ca-certificates' hook runs (update-ca-certificates picks them up).
  mmdebstrap --variant=minbase --include=ca-certificates \
    --customize-hook='for c in /usr/local/share/ca-certificates/*.crt; do [ -e "$c" ] && cp "$c" "$1/usr/local/share/ca-certificates/"; done; chroot "$1" update-ca-certificates >/dev/null' \
    bookworm - "$(debian_mirror)" | "$DOCKER" import - "$BASE_IMAGE"
fi

if have "$WHEELS_IMAGE"; then
  echo "$WHEELS_IMAGE: present"
else
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  wheel=$(ls "$WHEELS_DIR"/torch-"${TORCH_VERSION}"-cp311-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    ln "$wheel" "$stage/" 2>/dev/null || cp "$wheel" "$stage/"
  else
    echo "$WHEELS_IMAGE: no torch $TORCH_VERSION wheel in $WHEELS_DIR, downloading from $TORCH_INDEX_URL"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --index-url "$TORCH_INDEX_URL" -d "$stage" "torch==$TORCH_VERSION"
  fi
  printf 'FROM scratch\nCOPY *.whl /wheels/\n' > "$stage/Dockerfile"
  "$DOCKER" build -q -t "$WHEELS_IMAGE" "$stage"
  echo "$WHEELS_IMAGE: built from $(ls "$stage"/*.whl | xargs -n1 basename)"
fi
