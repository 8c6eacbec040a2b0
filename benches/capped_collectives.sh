#!/usr/bin/env bash
# `hivemesh bench collective` beside torch.distributed's gloo backend on a capped link: every
# op, twice each, alternated, inside a network namespace whose loopback is rate-limited with a
# tbf qdisc (one shared bucket for all the processes' traffic, as one switch port would be).
# On plain loopback both are CPU-bound on a small machine (and hivemesh encrypts every byte);
# under a cap both are bound by the link, which is where the comparison is a network's.
#
#   sudo benches/capped_collectives.sh 10gbit 64     # RATE (tc syntax) and MiB
#
# Needs root (ip netns, tc), a release build (cargo build --release) and a Python with torch
# ($PYTHON, default python3). Prints the benches' lines; removes its namespace on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:?usage: $0 RATE MIB (e.g. 10gbit 64)}
mib=${2:?usage: $0 RATE MIB (e.g. 10gbit 64)}
python=${PYTHON:-python3}
hivemesh=target/release/hivemesh
[[ -x $hivemesh ]] || { echo "build first: cargo build --release" >&2; exit 1; }
ns=hivemesh-capped-$$
ip netns add "$ns"
trap 'ip netns del "$ns"' EXIT
ip netns exec "$ns" ip link set lo up
ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 1mb latency 50ms
for op in all-reduce all-gather broadcast reduce-scatter; do
  for _ in 1 2; do
    ip netns exec "$ns" "$hivemesh" bench collective --op "$op" --peers 4 --mib "$mib" --rounds 3 \
      2>/dev/null | grep '^hivemesh_collective'
    ip netns exec "$ns" "$python" benches/gloo_collective.py --op "$op" --peers 4 --mib "$mib" \
      --rounds 3 2>/dev/null | grep '^gloo_collective'
  done
done
