#!/usr/bin/env bash
# Builds the hivemesh image from prebuilt binaries (no Rust toolchain in the image).
#
# Usage: docker/build.sh [HIVEMESH_BIN JOIN_BIN]
#   With no arguments: `cargo build --release --bin hivemesh --example join`, then
#   target/release/hivemesh and target/release/examples/join.
# Environment:
#   HIVEMESH_IMAGE  the image to build (default hivemesh:latest)
#   HIVEMESH_BASE   the base image (default: hivemesh-base:bookworm if it exists, else
#                   debian:bookworm-slim, which needs a registry)
#   HIVEMESH_STRIP  1 (default): strip debug info from the staged copies (smaller, faster
#                   to send to the engine; the binaries behave the same); 0: copy as is
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
image=${HIVEMESH_IMAGE:-hivemesh:latest}

die() {
  echo "build: $*" >&2
  exit 1
}

case $# in
  0)
    command -v cargo >/dev/null || die "cargo not found; pass the two binaries instead"
    (cd "$repo" && cargo build --release --locked --bin hivemesh --example join)
    target=${CARGO_TARGET_DIR:-$repo/target}
    hivemesh_bin=$target/release/hivemesh
    join_bin=$target/release/examples/join
    ;;
  2)
    hivemesh_bin=$1
    join_bin=$2
    ;;
  *) die "usage: $0 [HIVEMESH_BIN JOIN_BIN]" ;;
esac
for b in "$hivemesh_bin" "$join_bin"; do
  [[ -f $b && -x $b ]] || die "$b: not an executable file"
done

if [[ -n ${HIVEMESH_BASE:-} ]]; then
  base=$HIVEMESH_BASE
elif docker image inspect hivemesh-base:bookworm >/dev/null 2>&1; then
  base=hivemesh-base:bookworm
else
  base=debian:bookworm-slim
fi

context=$(mktemp -d "${TMPDIR:-/tmp}/hivemesh-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
cp "$here/Dockerfile" "$here/entrypoint.sh" "$context/"
cp "$hivemesh_bin" "$context/hivemesh"
cp "$join_bin" "$context/join"
if [[ ${HIVEMESH_STRIP:-1} == 1 ]] && command -v strip >/dev/null; then
  strip --strip-debug "$context/hivemesh" "$context/join"
fi
chmod 0755 "$context/hivemesh" "$context/join" "$context/entrypoint.sh"

# The image is labelled with a digest of what went into it; CI builds it once per run of
# docker/ci.sh (three of them), so an image made from the same files on the same base is kept.
base_id=$(docker image inspect -f '{{.Id}}' "$base" 2>/dev/null || echo "$base")
digest=$( (cd "$context" && sha256sum Dockerfile entrypoint.sh hivemesh join && echo "$base_id") |
  sha256sum | cut -c1-32)
if [[ $(docker image inspect -f '{{index .Config.Labels "hivemesh.context"}}' "$image" 2>/dev/null) == "$digest" ]]; then
  echo "build: $image is up to date (same binaries, entrypoint and base)"
  exit 0
fi

echo "build: $image from $base ($(du -sh "$context" | cut -f1) of context)"
# Quiet on success (the legacy builder's deprecation notice included), everything on failure.
if ! out=$(docker build --build-arg "BASE=$base" --label "hivemesh.context=$digest" \
  --tag "$image" "$context" 2>&1); then
  echo "$out" >&2
  die "docker build failed"
fi
echo "build: built $image ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
