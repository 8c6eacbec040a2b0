#!/usr/bin/env bash
# Builds the base image hivemesh-base:bookworm from Debian packages, for machines that cannot
# pull images from a registry: debootstrap a minimal bookworm root file system (with iproute2,
# iptables and procps, which the NAT test bed needs) and `docker import` it.
#
# Usage: docker/build-base.sh [--force] [IMAGE]     (IMAGE default: $HIVEMESH_BASE or
#                                                    hivemesh-base:bookworm)
# Does nothing if IMAGE exists already (unless --force). The Debian mirror is the one this
# machine's apt uses (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list), or
# $DEBIAN_MIRROR if set. Needs root (debootstrap) and a running Docker engine.
set -euo pipefail

force=0
if [[ ${1:-} == --force ]]; then
  force=1
  shift
fi
image=${1:-${HIVEMESH_BASE:-hivemesh-base:bookworm}}
suite=bookworm
packages=iproute2,iptables,procps,ca-certificates

die() {
  echo "build-base: $*" >&2
  exit 1
}

command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "cannot talk to the Docker engine (is it running? are you root?)"

if [[ $force == 0 ]] && docker image inspect "$image" >/dev/null 2>&1; then
  echo "build-base: $image exists; nothing to do (--force rebuilds it)"
  exit 0
fi
[[ $(id -u) == 0 ]] || die "debootstrap needs root"

# The mirror apt uses for the main suite: the first URIs: of a deb822 stanza whose Suites:
# names the suite, else the first `deb URI suite` line of a one-line-style list.
find_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    awk -v suite="$suite" '
      function flush() {
        if (uris != "" && types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ")) {
          split(uris, u, " "); print u[1]; found = 1; exit
        }
        uris = ""; suites = ""; types = ""
      }
      /^[[:space:]]*$/ { flush(); next }
      /^[[:space:]]*#/ { next }
      tolower($1) == "uris:"   { $1 = ""; uris = $0;   sub(/^ +/, "", uris) }
      tolower($1) == "suites:" { $1 = ""; suites = $0; sub(/^ +/, "", suites) }
      tolower($1) == "types:"  { $1 = ""; types = $0;  sub(/^ +/, "", types) }
      END { if (!found) flush() }
    ' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    # deb [options] URI suite components...
    awk -v suite="$suite" '
      $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
        if ($(i + 1) == suite) { print $i; exit }
      }
    ' "$f"
  done
}

mirror=${DEBIAN_MIRROR:-$(find_mirror | head -n 1)}
[[ -n $mirror ]] || die "no Debian mirror for $suite found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list; set DEBIAN_MIRROR"

if ! command -v debootstrap >/dev/null; then
  echo "build-base: installing debootstrap"
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
    die "apt-get install debootstrap failed"
fi

rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/hivemesh-base.XXXXXX")
mounted=0
cleanup() {
  if [[ $mounted == 1 ]]; then
    umount "$rootfs" || umount -l "$rootfs" || true
  fi
  rm -rf --one-file-system "$rootfs" "$rootfs.log"
}
trap cleanup EXIT
# dpkg syncs every file it unpacks; on a tmpfs that costs nothing (about 2x faster here).
# Not possible everywhere (no privilege to mount): then the plain directory is used.
if mount -t tmpfs -o size=2g,mode=0755 hivemesh-base "$rootfs" 2>/dev/null; then
  mounted=1
fi

SECONDS=0
echo "build-base: debootstrap $suite from $mirror (packages: $packages)"
log=$rootfs.log
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  die "debootstrap failed (log above)"
fi
rm -f "$log"
echo "build-base: debootstrap took ${SECONDS} s"

# Slim it down: downloaded packages, package lists, docs, man pages, translations.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
  "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old

echo "build-base: importing $image"
tar -C "$rootfs" --numeric-owner -c . |
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase --include=$packages $suite" \
    - "$image" >/dev/null || die "docker import failed"
echo "build-base: built $image ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
