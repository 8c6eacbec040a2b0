#!/usr/bin/env bash
# What CI runs: the hivemesh image and a swarm of containers on this machine, no registry needed.
#
# Usage: docker/ci.sh [--nat] [BIN_DIR]
#   BIN_DIR (or $HIVEMESH_BIN_DIR; default target/debug, what `cargo test` builds) holds the
#   already built BIN_DIR/hivemesh and BIN_DIR/examples/join.
#
# Steps: build the base image from Debian packages if missing (build-base.sh), build
# hivemesh:latest from the binaries (build.sh), then
#   default: compose.yml: a bootstrap and $HIVEMESH_PEERS (4) peers in one group average for
#            $HIVEMESH_ROUNDS (3) rounds; passes if every peer exits 0 after printing all its
#            rounds, each with group=$HIVEMESH_PEERS, and all final means are equal.
#   --nat:   compose.nat.yml: two public peers and two behind NAT routers. Passes if the
#            topology is right: each NATed peer connects out to the bootstrap, the bootstrap
#            sees the connection come from the router's address, and cannot connect in to
#            the NATed peer (neither its private address nor its ports on the router's).
#            The peers' rounds are reported; they decide the result only with
#            HIVEMESH_NAT_STRICT=1 (once hivemesh traverses NATs): then as the default mode.
# Always tears the containers, networks and volume down again, also on failure or Ctrl-C.
#
# Environment: HIVEMESH_PEERS, HIVEMESH_ROUNDS, HIVEMESH_SIZE, HIVEMESH_TIMEOUT,
# HIVEMESH_MATCHMAKING_TIME (see the compose files), HIVEMESH_CI_WAIT (180: seconds for all
# peers to finish), HIVEMESH_NAT_STRICT, HIVEMESH_BASE, HIVEMESH_IMAGE.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")

nat=0
if [[ ${1:-} == --nat ]]; then
  nat=1
  shift
fi
(($# <= 1)) || {
  echo "usage: $0 [--nat] [BIN_DIR]" >&2
  exit 2
}
bin_dir=${1:-${HIVEMESH_BIN_DIR:-target/debug}}
[[ $bin_dir == /* ]] || bin_dir=$repo/$bin_dir

export HIVEMESH_IMAGE=${HIVEMESH_IMAGE:-hivemesh:latest}
export HIVEMESH_BASE=${HIVEMESH_BASE:-hivemesh-base:bookworm}
export HIVEMESH_ROUNDS=${HIVEMESH_ROUNDS:-3}
if ((nat)); then
  compose_file=$here/compose.nat.yml
  project=hivemesh-ci-nat
  peers=4 # two public, two behind NAT routers
else
  compose_file=$here/compose.yml
  project=hivemesh-ci
  export HIVEMESH_PEERS=${HIVEMESH_PEERS:-4}
  peers=$HIVEMESH_PEERS
fi
rounds=$HIVEMESH_ROUNDS
wait_s=${HIVEMESH_CI_WAIT:-180}

say() { echo "ci: $*"; }
die() {
  echo "ci: FAIL: $*" >&2
  exit 1
}

for b in "$bin_dir/hivemesh" "$bin_dir/examples/join"; do
  [[ -x $b ]] || die "$b is missing; build it first (cargo build --bin hivemesh --example join), or pass BIN_DIR"
done

# `docker compose` (v2) if it works, else docker-compose (v1), else install docker-compose.
if docker compose version >/dev/null 2>&1; then
  compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null && docker-compose version >/dev/null 2>&1; then
  compose_cmd=(docker-compose)
else
  say "installing docker-compose"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }; then
    die "neither docker compose nor docker-compose, and installing docker-compose failed"
  fi
  compose_cmd=(docker-compose)
fi
compose=("${compose_cmd[@]}" --file "$compose_file" --project-name "$project")

# Containers of this project (all states), optionally of one service.
containers() {
  local filter=(--filter "label=com.docker.compose.project=$project")
  [[ -n ${1:-} ]] && filter+=(--filter "label=com.docker.compose.service=$1")
  docker ps -aq "${filter[@]}"
}
# service-number, the same under compose v1 and v2.
name_of() {
  docker inspect -f '{{index .Config.Labels "com.docker.compose.service"}}-{{index .Config.Labels "com.docker.compose.container-number"}}' "$1"
}

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if ((status != 0)) && [[ -n $(containers) ]]; then
    echo "ci: logs of the failed run (last 30 lines of each container):" >&2
    local c
    for c in $(containers); do
      docker logs --tail 30 "$c" 2>&1 | sed "s/^/  $(name_of "$c")| /" >&2 || true
    done
  fi
  SECONDS=0
  "${compose[@]}" down --volumes --remove-orphans --timeout 2 >/dev/null 2>&1 ||
    echo "ci: compose down failed" >&2
  local left
  left="$(containers)$(docker network ls -q --filter "label=com.docker.compose.project=$project")"
  left+=$(docker volume ls -q --filter "label=com.docker.compose.project=$project")
  if [[ -n $left ]]; then
    echo "ci: FAIL: teardown left containers, networks or volumes of $project behind" >&2
    status=1
  else
    say "torn down in ${SECONDS} s"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'echo "ci: FAIL: line $LINENO: $BASH_COMMAND" >&2' ERR
trap 'exit 130' INT
trap 'exit 143' TERM

SECONDS=0
"$here/build-base.sh" "$HIVEMESH_BASE"
base_s=$SECONDS
SECONDS=0
"$here/build.sh" "$bin_dir/hivemesh" "$bin_dir/examples/join"
image_s=$SECONDS

# Leftovers of an interrupted run would share the volume and names.
"${compose[@]}" down --volumes --remove-orphans --timeout 2 >/dev/null 2>&1 || true
SECONDS=0
up=("${compose[@]}" up --detach)
((nat)) || up+=(--scale "peer=$peers")
if ! out=$("${up[@]}" 2>&1); then
  echo "$out" >&2
  die "compose up failed"
fi
say "${compose_cmd[*]} $("${compose_cmd[@]}" version --short 2>/dev/null || true): $project up, $peers peers, $rounds rounds"

# The `round R: ...` lines a peer printed on stdout.
peer_rounds() { docker logs "$1" 2>/dev/null | grep -E '^round [0-9]+: ' || true; }

topology_ok=1
if ((nat)); then
  boot=$(containers bootstrap)
  boot_ip=$(docker exec "$boot" sh -c 'ip -4 -o addr show scope global' | awk '{sub(/\/.*/, "", $4); print $4; exit}')
  boot_port=4001
  check() {
    local what=$1
    shift
    if "$@"; then
      say "  ok: $what"
    else
      say "  FAILED: $what"
      topology_ok=0
    fi
  }
  # From container $1: can a TCP connection to $2:$3 be opened within 3 s?
  # shellcheck disable=SC2016 # $0 and $1 are the inner shell's arguments
  connects() { docker exec "$1" timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$2" "$3" 2>/dev/null; }
  cannot_connect() { ! connects "$@"; }
  # Whether ss's list of remote addresses ($1) has one from IP $2.
  has_remote() { grep -qF "$2:" <<<"$1"; }
  lacks_remote() { ! has_remote "$@"; }
  say "NAT topology checks (bootstrap $boot_ip:$boot_port)"
  for home in 1 2; do
    peer=$(containers "peer-nat$home")
    router=$(containers "router$home")
    # Wait (bounded) until the peer runs the example: its route and listeners are set up.
    deadline=$((SECONDS + 60))
    until docker logs "$peer" 2>/dev/null | grep -q '^peer .* joined'; do
      ((SECONDS < deadline)) || die "peer-nat$home did not join within 60 s"
      sleep 0.5
    done
    router_wan=$(docker exec "$router" ip -4 route get "$boot_ip" | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}')
    peer_ip=$(docker exec "$peer" sh -c 'ip -4 -o addr show scope global' | awk '{sub(/\/.*/, "", $4); print $4; exit}')
    ports=$(docker exec "$peer" ss -tlnH | awk -v ip="$peer_ip" '{n = split($4, a, ":"); if (a[1] == ip) print a[n]}')
    [[ -n $ports ]] || die "peer-nat$home listens on no TCP port of $peer_ip"
    say " home $home: peer-nat$home $peer_ip (listening on TCP ${ports//$'\n'/, }) behind router$home $router_wan"
    check "peer-nat$home connects out to the bootstrap" connects "$peer" "$boot_ip" "$boot_port"
    # Hold a connection from the peer open and look at it from the bootstrap's side.
    docker exec "$peer" timeout 4 bash -c 'exec 3<>"/dev/tcp/$0/$1"; sleep 3' "$boot_ip" "$boot_port" &
    held=$!
    sleep 1
    seen=$(docker exec "$boot" ss -tnH state established "( sport = :$boot_port )" | awk '{print $NF}')
    wait "$held" || true
    say "   the bootstrap's TCP peers: $(echo "$seen" | tr '\n' ' ')"
    check "the bootstrap sees a connection from router$home's address $router_wan" \
      has_remote "$seen" "$router_wan"
    check "the bootstrap sees none from peer-nat$home's own address $peer_ip" \
      lacks_remote "$seen" "$peer_ip"
    check "the bootstrap cannot connect to peer-nat$home's $peer_ip:${ports%%$'\n'*}" \
      cannot_connect "$boot" "$peer_ip" "${ports%%$'\n'*}"
    for port in $ports; do
      check "the bootstrap cannot connect to port $port on router$home's address" \
        cannot_connect "$boot" "$router_wan" "$port"
    done
  done
  # No use waiting for the rounds if the test bed itself is wrong.
  ((topology_ok)) || die "the NAT topology is not as intended"
fi

# The peers' containers, in the order of their names.
mapfile -t ids < <(
  for c in $(containers peer-public1) $(containers peer-public2) $(containers peer-nat1) \
    $(containers peer-nat2) $(containers peer); do
    echo "$(name_of "$c") $c"
  done | sort -V | cut -d' ' -f2
)
((${#ids[@]} == peers)) || die "expected $peers peer containers, found ${#ids[@]}"
if ! timeout "$((wait_s > SECONDS ? wait_s - SECONDS : 1))" docker wait "${ids[@]}" >/dev/null; then
  die "peers still running after ${wait_s} s"
fi
run_s=$SECONDS

# Every peer: exit code and rounds. ok: exit 0, all rounds, each in a group of all peers.
ok=0
finals=()
for c in "${ids[@]}"; do
  name=$(name_of "$c")
  code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
  lines=$(peer_rounds "$c")
  good=$(grep -cE "^round [0-9]+: group=$peers mean=" <<<"$lines" || true)
  final=$(grep -E '^round [0-9]+: group=' <<<"$lines" | tail -n 1 | sed -n 's/.* mean=\([^ ]*\).*/\1/p' || true)
  say " $name: exit $code, $good/$rounds rounds in groups of $peers, final mean ${final:-none}"
  [[ -z $lines ]] || while IFS= read -r line; do echo "     $line"; done <<<"$lines"
  if [[ $code == 0 && $good == "$rounds" ]]; then
    ok=$((ok + 1))
  fi
  finals+=("${final:-none}")
done
distinct=$(printf '%s\n' "${finals[@]}" | sort -u | wc -l)
averaged=0
if ((ok == peers && distinct == 1)); then
  averaged=1
fi

mode=swarm
((nat)) && mode=nat
summary="docker $mode: peers=$peers rounds=$rounds ok=$ok mean=$(printf '%s\n' "${finals[@]}" | sort -u | paste -sd/)"
((nat)) && summary+=" topology=$( ((topology_ok)) && echo ok || echo FAILED)"
summary+=" base_s=$base_s image_s=$image_s run_s=$run_s"
echo "$summary"

if ((nat)); then
  ((topology_ok)) || die "the NAT topology is not as intended"
  if [[ ${HIVEMESH_NAT_STRICT:-0} == 1 ]]; then
    ((averaged)) || die "not every peer averaged all rounds to the same mean"
  elif ((!averaged)); then
    say "NAT peers did not all average (expected until hivemesh traverses NATs; HIVEMESH_NAT_STRICT=1 makes this fail)"
  fi
else
  ((averaged)) || die "not every peer averaged all rounds to the same mean"
fi
say "PASS"
