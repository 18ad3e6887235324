#!/usr/bin/env python3
"""Held-out greedy accuracy of arithmetic models by problem kind, for docs/training.md ("Why the
warm start stops at 30%").  A kind is the operator and the digit counts of the longer and the
shorter operand: "+31" is a 3-digit number plus a 1-digit one.  Each model answers the first N
problems of the validation file with `rlflow generate --greedy` (max_new_tokens 6, as the
default recipe); an answer counts when it equals the reference exactly, which is what the
`numeric` rule gives for these integer answers.

  python3 tests/tools/arith_skills.py [--val data/arith3d/val.jsonl] [--n 500] MODEL_DIR...
(from the repository root, after the build: it runs ./build/rlflow)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def kind(prompt):
    m = re.match(r"^(\d+)([+-])(\d+)=$", prompt)
    if not m:
        sys.exit("arith_skills: %r is not an a+b= or a-b= prompt" % prompt)
    a, op, b = m.groups()
    return "%s%d%d" % (op, max(len(a), len(b)), min(len(a), len(b)))


def answers(rlflow, model, prompts_file, n):
    out = subprocess.run([rlflow, "generate", "--model", model, "--prompts-file", prompts_file,
                          "--greedy", "--max-new-tokens", "6"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("arith_skills: rlflow generate --model %s failed: %s" % (model, out.stderr.strip()))
    lines = out.stdout.split("\n")[:n]
    if len(lines) != n:
        sys.exit("arith_skills: %s: %d answers for %d prompts" % (model, len(lines), n))
    return [l.strip() for l in lines]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--val", default="data/arith3d/val.jsonl")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--rlflow", default="./build/rlflow")
    p.add_argument("models", nargs="+")
    a = p.parse_args()
    with open(a.val) as f:
        val = [json.loads(l) for l in f if l.strip()][:a.n]
    kinds = sorted(set(kind(v["prompt"]) for v in val))
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as t:
        for v in val:
            t.write(json.dumps({"prompt": v["prompt"]}) + "\n")
    try:
        print("| model | " + " | ".join(kinds) + " | all |")
        print("|---" * (len(kinds) + 2) + "|")
        print("| problems | " + " | ".join(str(sum(kind(v["prompt"]) == k for v in val)) for k in kinds)
              + " | %d |" % len(val))
        for m in a.models:
            got = answers(a.rlflow, m, t.name, len(val))
            ok = [got[i] == val[i]["answer"] for i in range(len(val))]
            row = []
            for k in kinds:
                idx = [i for i, v in enumerate(val) if kind(v["prompt"]) == k]
                row.append("%.2f" % (sum(ok[i] for i in idx) / len(idx)))
            print("| %s | %s | %.3f |" % (m, " | ".join(row), sum(ok) / len(ok)))
    finally:
        os.unlink(t.name)


if __name__ == "__main__":
    main()
