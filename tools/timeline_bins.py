#!/usr/bin/env python3
"""Payload rate per link and direction from hivemesh timelines, in 0.25 s bins (Mbit/s).

usage: timeline_bins.py DIR [FROM_S [TO_S]]

DIR holds the per-process files a run wrote with HIVEMESH_TIMELINE=DIR/p{pid}.json. Each
`send`/`receive` span's `payload_bytes` is spread evenly over the span; rows are
"<this node> -> <peer>" (send) and "<this node> <- <peer>" (receive), peers named by the
lane's last word; times are seconds from the first such span in any file. A send span ends
when the socket took the bytes, a receive span when the application read them: neither is
when the bytes crossed the line.
"""
import collections
import glob
import json
import sys

BIN_S = 0.25


def load(path):
    text = open(path).read().rstrip()
    # A file cut short (process killed) lacks its closing bracket.
    text = text.rstrip("]").rstrip().rstrip(",") + "]"
    return json.loads(text)


def spans(directory):
    out = []
    for path in sorted(glob.glob(directory + "/*.json")):
        try:
            events = load(path)
        except ValueError as e:
            print(f"{path}: {e}", file=sys.stderr)
            continue
        lanes = {
            e["tid"]: e["args"]["name"]
            for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
        }
        for e in events:
            kind = e.get("name", "").split(" ")[0]
            if e.get("ph") != "X" or kind not in ("send", "receive"):
                continue
            words = lanes.get(e["tid"], str(e["tid"])).split()
            arrow = "<-" if kind == "receive" else "->"
            key = f"{words[1] if len(words) > 1 else words[0]} {arrow} {words[-1]}"
            size = int(e.get("args", {}).get("payload_bytes", 0) or 0)
            out.append((key, e["ts"] / 1e6, e["dur"] / 1e6, size))
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    found = spans(sys.argv[1])
    if not found:
        sys.exit("no send/receive spans")
    lo = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    hi = float(sys.argv[3]) if len(sys.argv) > 3 else float("inf")
    t0 = min(ts for _, ts, _, _ in found)
    bins = collections.defaultdict(lambda: collections.defaultdict(float))
    for key, ts, dur, size in found:
        start, end = ts - t0, ts - t0 + max(dur, 1e-6)
        k = int(start // BIN_S)
        while k * BIN_S < end:
            overlap = min(end, (k + 1) * BIN_S) - max(start, k * BIN_S)
            bins[key][k] += size * overlap / (end - start)
            k += 1
    last = max(max(b) for b in bins.values())
    ks = range(int(lo / BIN_S), min(last + 1, int(min(hi, 1e9) / BIN_S)))
    width = max(len(k) for k in bins)
    print(" " * width, " ".join(f"{k * BIN_S:5.2f}" for k in ks))
    for key in sorted(bins):
        row = " ".join(f"{bins[key][k] * 8 / BIN_S / 1e6:5.0f}" for k in ks)
        print(key.ljust(width), row)


if __name__ == "__main__":
    main()
