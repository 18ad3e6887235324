#!/usr/bin/env python3
"""Builds the small tokenizer.json files under tests/data/tokenizer/ and their golden
expectations with Hugging Face `tokenizers` (the reference implementation our C tokenizer
must match token for token). Run from the repository root:

    python3 tests/tools/make_tokenizer_golden.py        # everything
    python3 tests/tools/make_tokenizer_golden.py edge   # only the edge-case files

The C test (tests/test_tokenizer.c) reads only the committed outputs; it never needs Python.

Golden format (<name>.golden.txt), one case per line, five tab-separated fields, each a hex
string ("." when empty) so that any bytes (NUL, tabs, newlines) survive:
    text_hex  ids(add_special=False)  ids(add_special=True)  decode(ids_special)_hex
    decode(ids_special, skip_special_tokens=True)_hex
where ids are space-separated decimals and ids_special are the add_special=True ids.
"""
import json
import os
import sys

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tokenizer")

QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what we'll do, isn't it?",
    "Hello world! Hello there, hello again. Don't stop; we're here and they've gone.",
    "def main(argc, argv):\n    return sum(x**2 for x in range(10))  # squares\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "你好，世界！今天天气很好。我们一起学习机器学习和强化学习。",
    "日本語のテキストも少し入れます。こんにちは世界。",
    "안녕하세요 세계. Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया",
    "Emoji: 🙂👍🏽🎉🔥 and flags 🇫🇷 plus café, naïve, façade, résumé, Ångström.",
    "Numbers 1234567 3.14159 1,000,000 2024-06-01 0x1F 42 7 99 100 12345",
    "Whitespace   runs\n\n\tand tabs\t\tand  double  spaces   and trailing   ",
    "The answer is 42. The answer is 42. The answer is 42. Let me think step by step.",
    "User: what is 2+2?\nAssistant: 2+2 = 4.\nUser: thanks!\n",
] * 4

GOLDEN_TEXTS = [
    "",
    "Hello world",
    "hello",
    " Hello",
    "   leading spaces",
    "trailing spaces   ",
    "你好，世界",
    "🙂👍🏽",
    "1234567",
    "a   b\n\n\tc  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<s>[INST] hi [/INST]</s>",
    "x<|endoftext|>y<|im_end|><|im_end|>",
    "<|im_start|partial <unk> </s",
    "cafe\u0301 vs caf\u00e9",            # NFC composes e + combining acute
    "\u212b \u2126 A\u030a",             # Angstrom/Ohm signs, A + ring: NFC changes them
    "\u1100\u1161\u11a8",                # conjoining jamo -> NFC precomposed Hangul
    "q\u0307\u0323 \u1e0b\u0323",        # combining marks reordered by NFC
    "nul\u0000inside",
    "\ufffd \uffff \U0010ffff \U0001f600",
    "don't I'LL we'Re THEY'VE it'S",
    "\r\n\r\n  \r\n",
    "x" * 300,
    "     ",
    "\u00a0nbsp\u3000ideographic\u2003em",
    "zebra zebra",
    "\uff21\uff42\uff43 fullwidth",
    "مرحبا بالعالم",
    "नमस्ते",
    "def f(x):\n    return x**2  # sq\n",
    "3.14159 1,000,000",
    "\u017f's \u212a",
    "tab\tsep\tvalues\n",
    "\ttext <tool_call> after",
]


def byte_level(tok, regex, ignore_merges, specials, bos=None):
    """Configures `tok` like Qwen2 (regex=QWEN2_RE, NFC) or Llama-3 (LLAMA3_RE)."""
    if regex == QWEN2_RE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)


def make_qwen2():
    tok = Tokenizer(models.BPE())
    byte_level(tok, QWEN2_RE, False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    # A non-special added token, as Qwen2.5 has for <tool_call>: decoded even with skip_special.
    tok.add_tokens([AddedToken("<tool_call>", normalized=False, special=False)])
    j = json.loads(tok.to_str())
    # Qwen2's file stores merges as "a b" strings; keep that legacy form here.
    j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
    return j


def make_llama3():
    tok = Tokenizer(models.BPE(ignore_merges=True))
    byte_level(tok, LLAMA3_RE, True,
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"], bos="<|begin_of_text|>")
    j = json.loads(tok.to_str())
    # Vocab entries with no merge path: only ignore_merges can emit them whole.
    n = max(j["model"]["vocab"].values()) + 1
    for w in ["\u0120zebra", "zebra", "\u0120leading"]:
        if w not in j["model"]["vocab"]:
            j["model"]["vocab"][w] = n
            n += 1
    for t in j["added_tokens"]:
        t["id"] = j["model"]["vocab"].get(t["content"], t["id"])
    return j


def make_gpt2():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return json.loads(tok.to_str())


def sp_vocab(normalize):
    """Trains a SentencePiece-style BPE and lays its vocab out like Llama-2's:
    <unk>=0, <s>=1, </s>=2, <0x00>..<0xFF>=3..258, then the learned pieces."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalize
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\u2581[^\u2581]*|[^\u2581]+"), "isolated")
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=2)
    tok.train_from_iterator(CORPUS, trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [" ".join(m) if isinstance(m, list) else m for m in learned["merges"]]
    return vocab, merges


def sp_tokenizer(vocab, merges, legacy):
    model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                       unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ["<unk>", "<s>", "</s>"]])
    if legacy:  # Llama-2: Prepend + Replace normalizer, no pre-tokenizer
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:  # Mistral-style newer conversion: Metaspace pre-tokenizer and decoder
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                     split=False)
        tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="\u2581",
                                                            prepend_scheme="first", split=False),
                                         decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def make_sentencepiece():
    norm = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    vocab, merges = sp_vocab(norm)
    llama2 = json.loads(sp_tokenizer(vocab, merges, True).to_str())
    mistral = json.loads(sp_tokenizer(vocab, merges, False).to_str())
    return llama2, mistral


def make_llama3_layout():
    """Llama-3's real layout: model.vocab holds only the BPE pieces (ids 0..N-1) and the
    special tokens are added tokens from N on, outside the vocab; the BOS template names
    <|begin_of_text|> = N (128000 in Meta's files)."""
    j = make_llama3()
    specials = [t["content"] for t in j["added_tokens"]]
    pieces = sorted((i, w) for w, i in j["model"]["vocab"].items() if w not in specials)
    j["model"]["vocab"] = {w: k for k, (_, w) in enumerate(pieces)}
    n = len(pieces)
    for k, t in enumerate(j["added_tokens"]):
        t["id"] = n + k
    bos = j["post_processor"]["processors"][1]["special_tokens"]["<|begin_of_text|>"]
    bos["ids"] = [n]
    return j


def make_split_base():
    """A small byte-level BPE whose pre-tokenizer the Split variants replace. Trained with no
    word split, so merges cross ". " and each behavior's pieces give different ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS + SPLIT_TEXTS * 3 + ["one. two. There. end. Hi. x. "] * 20,
                            trainer)
    return json.loads(tok.to_str())


SPLIT_BEHAVIORS = ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]

# A literal with regex metacharacters: as a regex ". " would match any character + space.
SPLIT_TEXTS = GOLDEN_TEXTS + [
    "Hi. There. .. . x. ", "a. b.c. . ", ". . . ", "end. ", "x  y. z", ". ",
    "f(a+b) (a+b)(a+b) a+b (a+bb)", "\u00e9. \u00e9.  \u3002. ",
]


def make_split_variants():
    """(name, tokenizer.json) for Split with a String pattern: every behavior, both inverts,
    a literal full of regex metacharacters, and the empty pattern (HF: no match)."""
    base = make_split_base()
    out = []
    for beh in SPLIT_BEHAVIORS:
        for inv in (False, True):
            j = json.loads(json.dumps(base))
            j["pre_tokenizer"] = json.loads(pre_tokenizers.Sequence([
                pre_tokenizers.Split(". ", beh, invert=inv),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]).__getstate__())
            out.append(("split_%s%s" % (beh, "_invert" if inv else ""), j))
    for name, pat, beh, inv in [("split_meta", "(a+b)", "isolated", False),
                                ("split_empty_invert", "", "removed", True)]:
        j = json.loads(json.dumps(base))
        j["pre_tokenizer"] = json.loads(pre_tokenizers.Sequence([
            pre_tokenizers.Split(pat, beh, invert=inv),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]).__getstate__())
        out.append((name, j))
    return out


def make_sparse():
    """Ids far apart: {"a": 0, "b": 1000000000}. HF loads it; the C loader must not size
    tables by the largest id (16 GB here)."""
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 1000000001, "content": "<s>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True}],
            "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {"a": 0, "b": 1000000000}, "merges": []}}


SPARSE_TEXTS = GOLDEN_TEXTS + ["abba", "a", "b", "b<s>a", "<s>", "xyz ab"]


def hexs(b):
    return b.hex() if b else "."


def ids_s(ids):
    return " ".join(map(str, ids)) if ids else "."


def write_golden(name, j, texts=GOLDEN_TEXTS):
    text = json.dumps(j, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
        f.write(text)
    tok = Tokenizer.from_str(text)
    with open(os.path.join(OUT, name + ".golden.txt"), "w") as f:
        for s in texts:
            a = tok.encode(s, add_special_tokens=False).ids
            b = tok.encode(s, add_special_tokens=True).ids
            d = tok.decode(b, skip_special_tokens=False).encode()
            k = tok.decode(b, skip_special_tokens=True).encode()
            f.write("\t".join([hexs(s.encode()), ids_s(a), ids_s(b), hexs(d), hexs(k)]) + "\n")
    print(f"{name}: {len(text)} bytes, vocab {tok.get_vocab_size()}")


def write_config_dir(name, j, config):
    """A model directory: tokenizer.json + tokenizer_config.json. The C test checks how the
    config's bos/eos tokens and explicit add_bos_token/add_eos_token apply (they rebuild the
    template as transformers' update_post_processor does: [bos] $A [eos])."""
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(j, ensure_ascii=False, separators=(",", ":")))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def main():
    os.makedirs(OUT, exist_ok=True)
    # `edge` rebuilds only the edge-case files below, leaving the five trained tokenizers
    # (and their goldens) as committed.
    if sys.argv[1:] != ["edge"]:
        write_main()
    write_golden("llama3_layout", make_llama3_layout())
    for name, j in make_split_variants():
        write_golden(name, j, SPLIT_TEXTS)
    write_golden("sparse", make_sparse(), SPARSE_TEXTS)
    return 0


def write_main():
    write_golden("qwen2", make_qwen2())
    write_golden("llama3", make_llama3())
    write_golden("gpt2", make_gpt2())
    llama2, mistral = make_sentencepiece()
    write_golden("llama2", llama2)
    write_golden("mistral", mistral)
    write_config_dir("llama2_dir", llama2, {
        "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": True,
        "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                                   "normalized": False, "rstrip": False, "single_word": False},
        "unk_token": "<unk>", "legacy": True, "chat_template": "{{ messages }}"})
    write_config_dir("qwen2_dir", make_qwen2(), {
        "tokenizer_class": "Qwen2TokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_prefix_space": False})
    # Error cases for the loader.
    bad = make_gpt2()
    bad["model"]["type"] = "Unigram"
    with open(os.path.join(OUT, "unigram.json"), "w") as f:
        json.dump(bad, f, separators=(",", ":"))
    with open(os.path.join(OUT, "malformed.json"), "w") as f:
        f.write('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0,}')


if __name__ == "__main__":
    sys.exit(main())
