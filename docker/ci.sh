#!/usr/bin/env bash
# What CI runs: the hivemesh image and a swarm of containers on this machine, no registry needed.
#
# Usage: docker/ci.sh [--nat[=KIND]] [BIN_DIR]
#   BIN_DIR (or $HIVEMESH_BIN_DIR; default target/debug, what `cargo test` builds) holds the
#   already built BIN_DIR/hivemesh and BIN_DIR/examples/join.
#   KIND: port-preserving (a home router; the default, or $HIVEMESH_NAT) or symmetric (a new
#   public port per connection).
#
# Steps: build the base image from Debian packages if missing (build-base.sh), build
# hivemesh:latest from the binaries (build.sh; nothing to do when it holds these binaries
# already), then one compose run:
#   default: compose.yml: a bootstrap and $HIVEMESH_PEERS (4) peers, all public.
#   --nat:   compose.nat.yml: two public peers and two behind NAT routers of KIND. First the
#            test bed itself is checked: nothing on it has a route off the machine; each NATed
#            peer routes through its router, connects out to the bootstrap, the bootstrap sees
#            the connection come from the router's address and cannot connect in (neither to
#            the peer's private address nor to its ports on the router's).
# Either way it passes only if every peer exits 0 after all $HIVEMESH_ROUNDS (3) rounds, each in
# a group of all peers whose parts average every member (stderr: `contributors=N..N
# local_parts=0`), and all end on the same mean: the mean of their starting means, and every
# element of every peer's final vector (copied out of its container: `--dump`) is the
# element-wise mean of the starting vectors (within 1e-4). Each
# peer's mode and reachability must be what its place implies: public peers `mode=node
# reach=public`; behind port-preserving NATs `mode=node reach=punchable` with a hole-punched
# link (`tls/punched`, or `punched/` with --no-punched-tls) in every round; behind symmetric NATs `mode=client reach=private`. A NATed
# peer must never report itself public, and no link may go through a relay.
# Always tears the containers, networks and volume down again, also on failure or Ctrl-C.
#
# Environment: HIVEMESH_PEERS, HIVEMESH_ROUNDS, HIVEMESH_SIZE, HIVEMESH_TIMEOUT,
# HIVEMESH_MATCHMAKING_TIME, HIVEMESH_INTERVAL, RUST_LOG (see the compose files),
# HIVEMESH_CI_WAIT (180: seconds for all peers to finish), HIVEMESH_CI_LOGS (a directory: every
# container's whole log goes there, pass or fail), HIVEMESH_BASE, HIVEMESH_IMAGE.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")

usage() { echo "usage: $0 [--nat[=port-preserving|symmetric]] [BIN_DIR]"; }
nat=0
nat_kind=
while (($#)); do
  case $1 in
    --nat)
      nat=1
      nat_kind=${HIVEMESH_NAT:-port-preserving}
      ;;
    --nat=*)
      nat=1
      nat_kind=${1#--nat=}
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    -*)
      usage >&2
      exit 2
      ;;
    *) break ;;
  esac
  shift
done
(($# <= 1)) || {
  usage >&2
  exit 2
}
case $nat_kind in
  '' | port-preserving | symmetric) ;;
  *)
    echo "$0: unknown NAT kind '$nat_kind' (port-preserving or symmetric)" >&2
    exit 2
    ;;
esac
bin_dir=${1:-${HIVEMESH_BIN_DIR:-target/debug}}
[[ $bin_dir == /* ]] || bin_dir=$repo/$bin_dir

export HIVEMESH_IMAGE=${HIVEMESH_IMAGE:-hivemesh:latest}
export HIVEMESH_BASE=${HIVEMESH_BASE:-hivemesh-base:bookworm}
export HIVEMESH_ROUNDS=${HIVEMESH_ROUNDS:-3}
if ((nat)); then
  compose_file=$here/compose.nat.yml
  project=hivemesh-ci-nat
  peers=4 # two public, two behind NAT routers
  export HIVEMESH_NAT=$nat_kind
  mode=nat/$nat_kind
else
  compose_file=$here/compose.yml
  project=hivemesh-ci
  export HIVEMESH_PEERS=${HIVEMESH_PEERS:-4}
  peers=$HIVEMESH_PEERS
  mode=swarm
fi
rounds=$HIVEMESH_ROUNDS
wait_s=${HIVEMESH_CI_WAIT:-180}
if ((nat)); then
  # The topology checks look at the NATed peers' own listeners, so the peers must still run
  # while they do (about 15 s); rounds back to back are over in a few seconds. Rounds 10 s
  # apart (a training loop's compute between steps) also show that links and NAT mappings
  # hold between rounds.
  export HIVEMESH_INTERVAL=${HIVEMESH_INTERVAL:-10}
fi

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
  local c
  if [[ -n ${HIVEMESH_CI_LOGS:-} ]] && [[ -n $(containers) ]] && mkdir -p "$HIVEMESH_CI_LOGS"; then
    for c in $(containers); do
      docker logs --timestamps "$c" >"$HIVEMESH_CI_LOGS/$(name_of "$c").log" 2>&1 || true
    done
    say "logs in $HIVEMESH_CI_LOGS"
  fi
  if ((status != 0)) && [[ -n $(containers) ]]; then
    echo "ci: logs of the failed run (last 30 lines of each container):" >&2
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
say "${compose_cmd[*]} $("${compose_cmd[@]}" version --short 2>/dev/null || true): $project up ($mode), $peers peers, $rounds rounds"


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
  # From container $1: can a TCP connection to $2:$3 be opened within 2 s (plenty on one host)?
  # shellcheck disable=SC2016 # $0 and $1 are the inner shell's arguments
  connects() { docker exec "$1" timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$2" "$3" 2>/dev/null; }
  cannot_connect() { ! connects "$@"; }
  running() { [[ $(docker inspect -f '{{.State.Running}}' "$1") == true ]]; }
  # Whether ss's list of remote addresses ($1) has one from IP $2.
  has_remote() { grep -qF "$2:" <<<"$1"; }
  lacks_remote() { ! has_remote "$@"; }
  # Route lookups in container $1 for address $2 (nothing is sent): none at all, or via $3.
  no_route() { ! docker exec "$1" ip -4 route get "$2" >/dev/null 2>&1; }
  routes_via() { [[ " $(docker exec "$1" ip -4 route get "$2" 2>/dev/null) " == *" via $3 "* ]]; }
  # A compose network's setting (a Go template over `docker network inspect`).
  network() {
    local id
    id=$(docker network ls -q --filter "label=com.docker.compose.project=$project" \
      --filter "label=com.docker.compose.network=$1")
    [[ -n $id ]] && docker network inspect -f "$2" "$id"
  }
  is_true() { [[ $("$@") == true ]]; }
  masquerades() {
    [[ $(network "home$1" '{{index .Options "com.docker.network.bridge.enable_ip_masquerade"}}') != false ]]
  }
  does_not() { ! "$@"; }
  # Any address off the test bed (only looked up in routing tables, never sent to).
  outside=198.51.100.1
  say "NAT ($nat_kind) topology checks (bootstrap $boot_ip:$boot_port)"
  checks_from=$SECONDS
  # Nothing leaves the machine: the internet is an internal network (no route out of it, no
  # masquerading on the host), the homes' bridges do not masquerade, and the only containers on
  # a home network besides its peer, the routers, drop the default route via the host.
  check "the internet network is internal" is_true network internet '{{.Internal}}'
  for home in 1 2; do
    check "home$home's bridge does not masquerade" does_not masquerades "$home"
  done
  for home in 1 2; do
    check "router$home has no route off the test bed" no_route "$(containers "router$home")" "$outside"
  done
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
    router_lan=$(docker exec "$peer" getent ahostsv4 "router$home" | awk '{print $1; exit}')
    peer_ip=$(docker exec "$peer" sh -c 'ip -4 -o addr show scope global' | awk '{sub(/\/.*/, "", $4); print $4; exit}')
    ports=$(docker exec "$peer" ss -tlnH | awk -v ip="$peer_ip" '{n = split($4, a, ":"); if (a[1] == ip) print a[n]}') || true
    [[ -n $ports ]] || die "peer-nat$home listens on no TCP port of $peer_ip (finished already? see HIVEMESH_INTERVAL)"
    say " home $home: peer-nat$home $peer_ip (listening on TCP ${ports//$'\n'/, }) behind router$home $router_lan / $router_wan"
    check "peer-nat$home routes everything off its home through router$home ($router_lan)" \
      routes_via "$peer" "$outside" "$router_lan"
    check "peer-nat$home routes to the bootstrap through router$home" \
      routes_via "$peer" "$boot_ip" "$router_lan"
    check "peer-nat$home connects out to the bootstrap" connects "$peer" "$boot_ip" "$boot_port"
    # Hold a connection from the peer open and look at it from the bootstrap's side.
    # shellcheck disable=SC2016 # $0 and $1 are the inner shell's arguments
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
    # The attempts that must fail each wait out their timeout: all at once, then their results.
    cannot_connect "$boot" "$peer_ip" "${ports%%$'\n'*}" &
    attempts=("$!")
    for port in $ports; do
      cannot_connect "$boot" "$router_wan" "$port" &
      attempts+=("$!")
    done
    check "the bootstrap cannot connect to peer-nat$home's $peer_ip:${ports%%$'\n'*}" \
      wait "${attempts[0]}"
    i=1
    for port in $ports; do
      check "the bootstrap cannot connect to port $port on router$home's address" \
        wait "${attempts[i++]}"
    done
    # Else the connection checks above proved nothing about the peer's listeners.
    check "peer-nat$home was running all along" running "$peer"
  done
  say "  (checks took $((SECONDS - checks_from)) s)"
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

# `key=value` from a line: the value, or nothing.
field() { sed -n "s/^.* $1=\([^ ]*\).*\$/\1/p" <<<"$2"; }

# Every peer: exit code, its rounds on stdout (`round R: group=G mean=M (S s)`), their detail
# lines on stderr (`round R: mode=... reach=... links=... contributors=... local_parts=...`)
# and its reachability lines, checked against what its place on the test bed implies.
good_peers=0
vectors=$(mktemp -d)
finals=()
initials=()
round_s_max=0
links_seen=()
for c in "${ids[@]}"; do
  name=$(name_of "$c")
  code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
  out=$(docker logs "$c" 2>/dev/null) || true
  err=$(docker logs "$c" 2>&1 >/dev/null) || true
  want_mode=node want_reach=public want_link=
  if [[ $name == peer-nat* ]]; then
    if [[ $nat_kind == symmetric ]]; then
      want_mode=client want_reach=private
    else
      want_reach=punchable want_link=punched
    fi
  fi
  problems=()
  ((code == 0)) || problems+=("exit code $code")
  initial=$(grep -m1 -E '^peer .* joined; ' <<<"$out" | sed -n 's/.* mean=\([^ ]*\).*/\1/p') || true
  [[ -n $initial ]] || problems+=("no 'peer ... joined' line")
  initials+=("${initial:-none}")
  final=none
  say " $name ($want_mode, $want_reach):"
  while IFS= read -r line; do
    [[ -n $line ]] && say "     $line"
  done < <(grep -E '^reachability: ' <<<"$err" || true)
  if [[ $want_reach != public ]] && grep -qE '^reachability: public' <<<"$err"; then
    problems+=("a NATed peer reported itself public")
  fi
  if grep -q 'panicked' <<<"$err"; then
    problems+=("a panic on stderr")
  fi
  for ((r = 1; r <= rounds; r++)); do
    result=$(grep -m1 -E "^round $r: (group|failed)" <<<"$out") || true
    detail=$(grep -m1 -E "^round $r: mode=" <<<"$err") || true
    say "     ${result:-round $r: (no result)}${detail:+ | ${detail#round "$r": }}"
    if [[ $result =~ ^round\ $r:\ group=$peers\ mean=([^ ]+)\ \(([0-9.]+)\ s\) ]]; then
      final=${BASH_REMATCH[1]}
      round_s_max=$(awk -v a="$round_s_max" -v b="${BASH_REMATCH[2]}" 'BEGIN { print (b > a ? b : a) }')
    else
      problems+=("round $r: not averaged in a group of $peers")
      final=none
    fi
    if [[ -z $detail ]]; then
      problems+=("round $r: no detail line on stderr")
      continue
    fi
    got_mode=$(field mode "$detail")
    got_reach=$(field reach "$detail")
    links=$(field links "$detail")
    [[ $got_mode == "$want_mode" ]] || problems+=("round $r: mode=$got_mode, want $want_mode")
    [[ $got_reach == "$want_reach" ]] || problems+=("round $r: reach=$got_reach, want $want_reach")
    [[ $(field contributors "$detail") == "$peers..$peers" ]] ||
      problems+=("round $r: contributors=$(field contributors "$detail"), want $peers..$peers")
    [[ $(field local_parts "$detail") == 0 ]] ||
      problems+=("round $r: local_parts=$(field local_parts "$detail"), want 0")
    [[ ,$links, != *,relayed,* ]] || problems+=("round $r: a relayed link")
    [[ -z $want_link || $links == *"$want_link"* ]] || problems+=("round $r: no $want_link link")
    # Everyone but a client links to every member; a client only to the reducers, directly.
    if [[ $want_mode == client ]]; then
      [[ $links != *punched* ]] || problems+=("round $r: a client with a hole-punched link")
    else
      [[ ,$links, != *,-,* ]] || problems+=("round $r: a member without a link")
    fi
    IFS=, read -ra kinds <<<"$links"
    links_seen+=("${kinds[@]}")
  done
  finals+=("$final")
  for what in initial final; do
    docker cp "$c:/tmp/hivemesh-vector.$what" "$vectors/$name.$what" >/dev/null 2>&1 ||
      problems+=("no $what vector in the container")
  done
  if ((${#problems[@]} == 0)); then
    good_peers=$((good_peers + 1))
  else
    for p in "${problems[@]}"; do say "     FAILED: $p"; done
  fi
done

# One mean for all, and it is the mean of the starting means (each printed to 4 decimals).
distinct=$(printf '%s\n' "${finals[@]}" | sort -u | wc -l)
expected=$(printf '%s\n' "${initials[@]}" | awk '{ s += $1 } END { printf "%.4f", s / NR }')
averaged=0
if ((good_peers == peers && distinct == 1)) &&
  awk -v a="${finals[0]}" -v b="$expected" 'BEGIN { d = a - b; exit !(d < 1e-3 && d > -1e-3) }'; then
  averaged=1
fi
# Element-wise: the largest distance of any peer's final element from the exact mean of the
# starting vectors ("none" if a vector is missing or the lengths differ).
elementwise=$(python3 - "$vectors" <<'PY'
import os, struct, sys
d = sys.argv[1]
def read(path):
    data = open(path, "rb").read()
    return struct.unpack(f"<{len(data) // 4}f", data)
try:
    names = sorted({f.rsplit(".", 1)[0] for f in os.listdir(d)})
    starts = [read(os.path.join(d, n + ".initial")) for n in names]
    exact = [sum(v[i] for v in starts) / len(starts) for i in range(len(starts[0]))]
    worst = 0.0
    for n in names:
        end = read(os.path.join(d, n + ".final"))
        if len(end) != len(exact) or any(len(s) != len(exact) for s in starts):
            raise ValueError("lengths differ")
        worst = max([worst] + [abs(a - b) for a, b in zip(end, exact)])
    print(f"{worst:.3g}")
except (OSError, ValueError, IndexError, struct.error):
    print("none")
PY
) || elementwise=none
rm -rf "$vectors"
if [[ $elementwise == none ]] || ! awk -v d="$elementwise" 'BEGIN { exit !(d < 1e-4) }'; then
  averaged=0
fi
link_kinds=$(printf '%s\n' "${links_seen[@]}" | grep -vx self | sort | uniq -c | awk '{ printf "%s%s:%s", (NR > 1 ? "," : ""), $2, $1 }') || true

summary="docker $mode: peers=$peers rounds=$rounds ok=$good_peers mean=$(printf '%s\n' "${finals[@]}" | sort -u | paste -sd/)"
summary+=" expected=$expected elementwise_max_dev=$elementwise links=${link_kinds:-none} round_s_max=$round_s_max"
((nat)) && summary+=" topology=$( ((topology_ok)) && echo ok || echo FAILED)"
summary+=" base_s=$base_s image_s=$image_s run_s=$run_s"
echo "$summary"

((topology_ok)) || die "the NAT topology is not as intended"
((averaged)) || die "not every peer averaged all rounds with everyone to the same mean ($expected expected; elementwise_max_dev=$elementwise)"
say "PASS"
