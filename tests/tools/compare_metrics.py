#!/usr/bin/env python3
"""Compares two runs' metrics.jsonl step by step: every key but the wall-clock ones (perf/*,
time) must be present in both and hold the same double (parsed exactly, no tolerance).

Usage: compare_metrics.py OLD/metrics.jsonl NEW/metrics.jsonl
Prints the first differences and "IDENTICAL <steps> steps, <values> values" or
"DIFFER (<count>)"; exits 0 when identical, 1 otherwise."""
import json
import sys


def load(path):
    out = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            out[d["step"]] = {k: v for k, v in d.items() if not k.startswith("perf/") and k != "time"}
    return out


def main():
    a, b = load(sys.argv[1]), load(sys.argv[2])
    bad = 0
    if sorted(a) != sorted(b):
        print("steps differ:", sorted(a), sorted(b))
        bad += 1
    for s in sorted(set(a) & set(b)):
        ka, kb = set(a[s]), set(b[s])
        if ka != kb:
            print("step", s, "keys only in the first:", sorted(ka - kb), "only in the second:", sorted(kb - ka))
            bad += 1
        for k in sorted(ka & kb):
            if a[s][k] != b[s][k]:
                bad += 1
                if bad < 15:
                    print("step", s, k, repr(a[s][k]), repr(b[s][k]))
    values = sum(len(v) for v in a.values())
    print(("IDENTICAL" if bad == 0 else "DIFFER (%d)" % bad) + " %d steps, %d values" % (len(a), values))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
