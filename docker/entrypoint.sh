#!/usr/bin/env bash
# Entrypoint of the hivemesh image: the roles the compose files use, or any command.
#
#   bootstrap [DHT FLAGS]  `hivemesh dht` on this container's IPv4 address, TCP port
#                          $HIVEMESH_PORT (4001); the addresses it prints also go to
#                          $HIVEMESH_SHARED/bootstrap.addrs (a volume the others mount).
#   peer [JOIN FLAGS]      waits (at most $HIVEMESH_WAIT s) for that file and for the bootstrap
#                          to accept TCP, then runs `hivemesh-join --initial-peer <it>
#                          --host <own address> --dump /tmp/hivemesh-vector JOIN FLAGS`. With $HIVEMESH_ROUTER set (a
#                          router's name), the default route goes through that router first.
#   router                 a home router: forwards between the network it shares with the
#                          bootstrap (WAN) and the others, masquerades outgoing connections
#                          behind its WAN address and drops unsolicited inbound ones
#                          ($HIVEMESH_NAT=symmetric: a new port per connection).
#   anything else          run as given.
set -euo pipefail

shared=${HIVEMESH_SHARED:-/shared}
port=${HIVEMESH_PORT:-4001}
wait_s=${HIVEMESH_WAIT:-60}
addrs_file=$shared/bootstrap.addrs

log() { echo "hivemesh-entrypoint ($1): ${*:2}" >&2; }
die() {
  log "$@"
  exit 1
}

# The bootstrap's /ip4/.../tcp/.../p2p/... address, once its file holds a complete line.
bootstrap_addr() {
  local line
  [[ -r $addrs_file ]] || return 1
  # `read` fails on a last line without its newline: only complete lines get here.
  while IFS= read -r line; do
    if [[ $line =~ ^/ip4/[0-9.]+/tcp/[0-9]+/p2p/[[:alnum:]]+$ ]]; then
      echo "$line"
      return 0
    fi
  done <"$addrs_file"
  return 1
}

wait_bootstrap_addr() {
  local deadline=$((SECONDS + wait_s))
  until bootstrap_addr; do
    ((SECONDS < deadline)) || die "$1" "no bootstrap address in $addrs_file after ${wait_s} s"
    sleep 0.2
  done
}

# Field N of `ip -4 route get DEST` (e.g. src, dev, via).
route_field() {
  ip -4 route get "$1" | awk -v key="$2" '{for (i = 1; i < NF; i++) if ($i == key) {print $(i + 1); exit}}'
}

# shellcheck disable=SC2016 # $0 and $1 are the inner shell's arguments
tcp_open() { timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; }

role=${1:-}
case $role in
  bootstrap)
    shift
    own_ip=$(ip -4 -o addr show scope global | awk '{sub(/\/.*/, "", $4); print $4; exit}')
    [[ -n $own_ip ]] || die bootstrap "no IPv4 address"
    mkdir -p "$shared"
    rm -f "$addrs_file"
    log bootstrap "listening on /ip4/$own_ip/tcp/$port"
    # hivemesh becomes PID 1 (it stops cleanly on SIGTERM); tee copies its lines to the file.
    exec hivemesh dht --listen "/ip4/$own_ip/tcp/$port" "$@" > >(tee "$addrs_file")
    ;;
  peer)
    shift
    addr=$(wait_bootstrap_addr peer)
    IFS=/ read -r _ _ boot_ip _ boot_port _ <<<"$addr"
    if [[ -n ${HIVEMESH_ROUTER:-} ]]; then
      deadline=$((SECONDS + wait_s))
      until router_ip=$(getent ahostsv4 "$HIVEMESH_ROUTER" | awk '{print $1; exit}') && [[ -n $router_ip ]]; do
        ((SECONDS < deadline)) || die peer "cannot resolve router $HIVEMESH_ROUTER"
        sleep 0.2
      done
      ip -4 route replace default via "$router_ip" ||
        die peer "cannot set the default route via $router_ip (needs cap_add: NET_ADMIN)"
      log peer "default route via $HIVEMESH_ROUTER ($router_ip)"
    fi
    own_ip=$(route_field "$boot_ip" src)
    [[ -n $own_ip ]] || die peer "no route to the bootstrap at $boot_ip"
    deadline=$((SECONDS + wait_s))
    until tcp_open "$boot_ip" "$boot_port"; do
      ((SECONDS < deadline)) || die peer "cannot connect to the bootstrap at $boot_ip:$boot_port"
      sleep 0.2
    done
    log peer "host $own_ip, bootstrap $addr"
    # The vectors before and after the rounds, for docker/ci.sh's element-wise check.
    exec hivemesh-join --initial-peer "$addr" --host "$own_ip" --dump /tmp/hivemesh-vector "$@"
    ;;
  router)
    shift
    [[ $(cat /proc/sys/net/ipv4/ip_forward) == 1 ]] ||
      die router "IP forwarding is off (compose: sysctls: net.ipv4.ip_forward: 1)"
    addr=$(wait_bootstrap_addr router)
    IFS=/ read -r _ _ boot_ip _ <<<"$addr"
    wan=$(route_field "$boot_ip" dev)
    wan_ip=$(route_field "$boot_ip" src)
    [[ -n $wan ]] || die router "no interface towards the bootstrap at $boot_ip"
    ipt=iptables
    if ! iptables -t nat -S >/dev/null 2>&1 && iptables-legacy -t nat -S >/dev/null 2>&1; then
      ipt=iptables-legacy
    fi
    masquerade=(-j MASQUERADE)
    case ${HIVEMESH_NAT:-} in
      '' | port-preserving) ;;
      symmetric) masquerade+=(--random-fully) ;;
      *) die router "HIVEMESH_NAT=$HIVEMESH_NAT: not port-preserving or symmetric" ;;
    esac
    # Like a home router (and the routers of tests/netns): from the WAN only what answers a
    # connection from inside, to the home (FORWARD) and to the router itself (INPUT).
    nat_rules() {
      "$ipt" -t nat -A POSTROUTING -o "$wan" "${masquerade[@]}" || return 1
      local chain
      for chain in FORWARD INPUT; do
        "$ipt" -A "$chain" -i "$wan" -m state --state ESTABLISHED,RELATED -j ACCEPT || return 1
        "$ipt" -A "$chain" -i "$wan" -j DROP || return 1
      done
    }
    nat_rules || die router "iptables failed (needs cap_add: NET_ADMIN)"
    # The only routes a router needs are its two networks'; a default route via a home
    # network's gateway (the Docker host) would be a way around the WAN.
    if default_dev=$(ip -4 route show default | awk '{for (i = 1; i < NF; i++) if ($i == "dev") print $(i + 1)}') &&
      [[ -n $default_dev && $default_dev != "$wan" ]]; then
      ip -4 route del default || die router "cannot remove the default route via $default_dev"
    fi
    log router "NAT${HIVEMESH_NAT:+ ($HIVEMESH_NAT)}: WAN $wan $wan_ip; inbound from the WAN only for established connections"
    trap 'exit 0' TERM INT
    sleep infinity &
    wait
    ;;
  *)
    exec "$@"
    ;;
esac
