#!/usr/bin/env python3
"""Puts bench_model's and torch_side_by_side.py's JSON lines side by side as a Markdown table.

  python3 bench/side_by_side_table.py FILE...

Each FILE holds JSON lines of either program (several runs may be concatenated: the best figure
of each (bench, impl, config, precision, batch) is kept, as the machine is shared). Lines of
bench_model have no "impl" and count as "rlflow". Prints, per config and precision: rlflow's
tokens/s (and GB/s for adamw), its fraction of the hardware peak of the same run, each PyTorch
figure and rlflow's speed-up over it.
"""
import json
import os
import sys


def key(r):
    return (r.get("config", "small"), r.get("precision", "fp32"), r["bench"], r.get("batch"))


def load(paths):
    best, hw = {}, {}
    for p in paths:
        if not os.path.exists(p):
            print(f"side_by_side_table: {p}: no such file", file=sys.stderr)
            continue
        for line in open(p):
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            b = r["bench"]
            if b in ("matmul_peak", "matmul_from_memory", "sgemm_peak", "memcpy", "machine", "op", "model_memory",
                     "peak_refresh"):
                hw.setdefault(b + str(r.get("dtype", "")), r)
                continue
            if "error" in r or b == "attention":  # attention: per pass, no PyTorch line beside it
                continue
            impl = r.get("impl", "rlflow-frozen" if r.get("weights") == "frozen-bf16" else "rlflow")
            if b == "adamw":
                impl = "rlflow" if impl == "rlflow" else "torch"
            k = key(r) + (impl,)
            speed = r.get("tokens_per_s", r.get("gb_per_s", 0))
            old = best.get(k)
            if old is None or speed > old.get("tokens_per_s", old.get("gb_per_s", 0)):
                best[k] = r
    return best, hw


def fmt_row(best, k):
    rl = best.get(k + ("rlflow",))
    if not rl or rl.get("tokens_per_s", rl.get("gb_per_s")) is None:  # a line with no speed of its own
        return None
    unit = "GB/s" if k[2] == "adamw" else "tok/s"
    speed = lambda r: r.get("tokens_per_s", r.get("gb_per_s"))
    frac = rl.get("fraction_of_read_bw") if k[2] == "decode" and k[3] == 1 else \
        rl.get("fraction_of_copy_bw", rl.get("fraction_of_peak"))
    cells = [f"{k[0]} {k[1]}", k[2] + (f" b{k[3]}" if k[3] else ""),
             f"{speed(rl):.3g} {unit}", f"{frac:.2f}" if frac is not None else "-"]
    for impl in ("torch_eager", "torch_compile", "hf_generate", "torch"):
        t = best.get(k + (impl,))
        cells.append(f"{speed(t):.3g} ({speed(rl) / speed(t):.2f}x)" if t else "-")
    return "| " + " | ".join(cells) + " |"


def main():
    best, hw = load(sys.argv[1:])
    print("| config | bench | rlflow | of hw | torch eager (x) | torch.compile (x) | HF generate (x) | torch AdamW (x) |")
    print("|---|---|---|---|---|---|---|---|")
    for k in sorted({k[:4] for k in best}, key=lambda k: (k[0], k[1], k[2], k[3] or 0)):
        row = fmt_row(best, k)
        if row:
            print(row)


if __name__ == "__main__":
    main()
