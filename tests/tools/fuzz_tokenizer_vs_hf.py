#!/usr/bin/env python3
"""Throwaway-style differential fuzz: random Unicode strings through HF `tokenizers` and
through rlflow's C tokenizer (tests/tools/tokenizer_fuzz_driver.c, built as its header says,
given as argv[1]), over the test tokenizers and
a few variants that switch on less common options. Prints the mismatch count; exit 1 if any.

    python3 tests/tools/fuzz_tokenizer_vs_hf.py /path/to/driver [n_strings] [seed]
"""
import json
import os
import random
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tokenizer")

RANGES = [(0x20, 0x7E), (0x09, 0x0D), (0xA0, 0xFF), (0x100, 0x17F), (0x300, 0x36F),
          (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF), (0x660, 0x669), (0x900, 0x97F),
          (0x1100, 0x11FF), (0xAC00, 0xD7A3), (0x3040, 0x30FF), (0x4E00, 0x4E80), (0x3000, 0x3003),
          (0x2000, 0x206F), (0xFF00, 0xFFEF), (0x1F300, 0x1F6FF), (0x1F900, 0x1F9FF),
          (0x1F3FB, 0x1F3FF), (0x2150, 0x218B), (0x00B2, 0x00BE), (0xFE00, 0xFE0F),
          (0x0085, 0x0085), (0x1680, 0x1680), (0x180E, 0x180E), (0x200B, 0x200D),
          (0x2028, 0x2029), (0x1D400, 0x1D7FF), (0xE000, 0xE010), (0xFFF0, 0xFFFF),
          (0x10FFF0, 0x10FFFF), (0x0, 0x1F)]
SNIPPETS = ["'s", "'LL", "'re", " 've", "\u017f", "\r\n", "  ", "\n\n", "\t", "<|im_start|>",
            "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|begin_of_text|>",
            "<|eot_id|>", "<tool_call>", "<|im_", "hello", " world", "123456", "\u2581",
            " \u2581x", "e\u0301", "\U0001f44d\U0001f3fd", "\u200d", "zebra", " zebra", "ab",
            "a b", "  leading"]


def rand_char(r):
    if r.random() < 0.05:
        c = r.randrange(0x110000)
        while 0xD800 <= c <= 0xDFFF:
            c = r.randrange(0x110000)
        return chr(c)
    lo, hi = r.choice(RANGES)
    return chr(r.randint(lo, hi))


def rand_string(r):
    out = []
    for _ in range(r.randint(0, 24)):
        x = r.random()
        if x < 0.3:
            out.append(r.choice(SNIPPETS))
        elif x < 0.6:
            out.append("".join(r.choice("abcdefghijklmnopqrstuvwxyz ABC.,!?0123456789")
                               for _ in range(r.randint(1, 8))))
        else:
            out.append(rand_char(r))
    return "".join(out)


def variants():
    """(name, tokenizer.json text): the test files plus option variants."""
    out = []
    for name in ["gpt2", "qwen2", "llama3", "llama2", "mistral", "llama3_layout",
                 "split_merged_with_next", "split_merged_with_previous_invert",
                 "split_contiguous", "split_removed", "split_meta", "sparse"]:
        with open(os.path.join(DATA, name + ".json"), encoding="utf-8") as f:
            out.append((name, f.read()))
    j = json.loads(dict(out)["gpt2"])
    j["pre_tokenizer"]["add_prefix_space"] = True
    j["added_tokens"].append({"id": 600, "content": "ab", "single_word": True, "lstrip": True,
                              "rstrip": True, "normalized": False, "special": False})
    j["added_tokens"].append({"id": 601, "content": "a b", "single_word": False, "lstrip": False,
                              "rstrip": True, "normalized": True, "special": False})
    out.append(("gpt2-prefix-space+flags", json.dumps(j)))
    j = json.loads(dict(out)["mistral"])
    j["pre_tokenizer"]["split"] = True
    j["pre_tokenizer"]["prepend_scheme"] = "always"
    j["decoder"]["decoders"][0]["prepend_scheme"] = "always"
    j["added_tokens"][1]["lstrip"] = True
    j["added_tokens"][2]["rstrip"] = True
    out.append(("mistral-split-always+strip", json.dumps(j)))
    j = json.loads(dict(out)["qwen2"])
    j["normalizer"] = {"type": "NFKC"}
    j["added_tokens"].append({"id": 701, "content": "\uff21b", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": True,
                              "special": True})
    out.append(("qwen2-nfkc+normalized-special", json.dumps(j)))
    j = json.loads(dict(out)["split_merged_with_next"])
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"String": "\u00e9\\s"}
    j["pre_tokenizer"]["pretokenizers"][0]["invert"] = True
    out.append(("split-string-utf8-backslash", json.dumps(j)))
    return out


def main():
    driver = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    total_bad = 0
    for name, text in variants():
        r = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1234)
        strings = [rand_string(r) for _ in range(n)]
        tok = Tokenizer.from_str(text)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "tokenizer.json")
            inp = os.path.join(d, "in.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            with open(inp, "w") as f:
                for s in strings:
                    f.write((s.encode().hex() or ".") + "\n")
            got = subprocess.run([driver, path, inp], capture_output=True, check=True,
                                 text=True).stdout.split("\n")
        bad = 0
        for s, g in zip(strings, got):
            ids = tok.encode(s).ids
            want = "\t".join([" ".join(map(str, ids)) or ".",
                              tok.decode(ids, skip_special_tokens=False).encode().hex() or ".",
                              tok.decode(ids, skip_special_tokens=True).encode().hex() or "."])
            if g != want:
                bad += 1
                if bad <= 3:
                    print(f"  {name}: {s!r}\n    got  {g[:200]}\n    want {want[:200]}")
        print(f"{name}: {len(strings)} strings, {bad} mismatches")
        total_bad += bad
    print(f"total mismatches: {total_bad}")
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
