#!/usr/bin/env python3
"""Cross-checks rlflow's safetensors reader and writer against the Python library, by hand.

Not part of ctest (the project never needs Python to build or test). Run:

    python3 tests/tools/check_safetensors.py write DIR     # Python writes DIR/py, DIR/py_sharded
    RF_ST_INTEROP_DIR=DIR build-st/test_safetensors         # C reads those, writes DIR/c_*
    python3 tests/tools/check_safetensors.py check DIR     # Python loads the C files

"check" requires, for every C file: values equal to the reference formula rounded by numpy
(f16: numpy's round-to-nearest-even; bf16: RNE on the bit pattern), and the file bytes equal
to what safetensors writes for the same tensors with metadata {"format": "pt"}. For the sharded
directory it also requires the shard split and model.safetensors.index.json to be exactly
what huggingface_hub + transformers' save_pretrained produce.
Needs: numpy, safetensors, huggingface_hub (torch is not needed).
"""
import json
import os
import sys

import numpy as np
import safetensors
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors.numpy import load_file, save, save_file

# Keep in step with interop_* in tests/test_safetensors.c.
NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight",
         "special", "lm_head.weight"]
SHAPES = [(7, 5), (4, 6), (5,), (10,), (3, 5)]
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, float.fromhex("0x1.018p0"),
                    float.fromhex("0x1.002p0"), 65520.0, float.fromhex("0x3p-25"),
                    -float.fromhex("0x1p-20")], dtype=np.float32)


def value(k):
    n = int(np.prod(SHAPES[k]))
    if k == 3:
        return SPECIAL.copy()
    i = np.arange(n)
    return ((((i * 37 + k * 11) % 101) - 50).astype(np.float32) / np.float32(7.0)).reshape(SHAPES[k])


def to_bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def serialize_mixed(tensors):
    """tensors: {name: (dtype string, numpy array of the stored bits)} -> bytes."""
    specs = {n: safetensors.TensorSpec(dtype=d, shape=list(a.shape), data_ptr=a.ctypes.data,
                                       data_len=a.nbytes) for n, (d, a) in tensors.items()}
    return bytes(safetensors.serialize(specs, metadata={"format": "pt"}))


def cmd_write(root):
    os.makedirs(os.path.join(root, "py"), exist_ok=True)
    mixed = {}
    for k, name in enumerate(NAMES):
        v = value(k)
        if k % 3 == 0:
            mixed[name] = ("float32", v)
        elif k % 3 == 1:
            mixed[name] = ("bfloat16", to_bf16_bits(v))
        else:
            mixed[name] = ("float16", v.astype(np.float16))
    with open(os.path.join(root, "py", "model.safetensors"), "wb") as f:
        f.write(serialize_mixed(mixed))
    out = os.path.join(root, "py_sharded")
    os.makedirs(out, exist_ok=True)
    sd = {name: value(k) for k, name in enumerate(NAMES)}
    write_sharded(sd, out, 100)
    print(f"wrote {root}/py and {root}/py_sharded")


def hf_split(sd, max_shard):
    return split_state_dict_into_shards_factory(sd, get_storage_id=lambda t: None,
                                                get_storage_size=lambda t: t.nbytes,
                                                filename_pattern="model{suffix}.safetensors",
                                                max_shard_size=max_shard)


def index_text(sd, split):
    """transformers' save_pretrained index: total_parameters + the split's metadata."""
    index = {"metadata": {"total_parameters": int(sum(v.size for v in sd.values())),
                          **split.metadata},
             "weight_map": split.tensor_to_filename}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def write_sharded(sd, out, max_shard):
    split = hf_split(sd, max_shard)
    for fname, names in split.filename_to_tensors.items():
        save_file({n: sd[n] for n in names}, os.path.join(out, fname), metadata={"format": "pt"})
    if split.is_sharded:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            f.write(index_text(sd, split))


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAIL: {what}")
    print(f"ok: {what}")


def same_bits(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def check_single(root, sub, dtype):
    path = os.path.join(root, sub, "model.safetensors")
    raw = open(path, "rb").read()
    if dtype == "BF16":  # numpy has no bfloat16: compare the raw bits via deserialize
        got = {n: (t["dtype"], np.frombuffer(bytes(t["data"]), np.uint16).reshape(t["shape"]))
               for n, t in safetensors.deserialize(raw)}
        for k, name in enumerate(NAMES):
            check(got[name][0] == "BF16" and same_bits(got[name][1], to_bf16_bits(value(k)).reshape(SHAPES[k])),
                  f"{sub}: {name} equals RNE bf16 of the reference")
        again = serialize_mixed({n: ("bfloat16", a) for n, (_, a) in got.items()})
    else:
        got = load_file(path)
        np_dtype = np.float32 if dtype == "F32" else np.float16
        for k, name in enumerate(NAMES):
            check(got[name].dtype == np_dtype and same_bits(got[name], value(k).astype(np_dtype)),
                  f"{sub}: {name} loads with safetensors.numpy and equals the reference")
        again = save(got, metadata={"format": "pt"})
    check(raw == again, f"{sub}: file bytes identical to what the Python library writes")


def check_sharded(root):
    d = os.path.join(root, "c_sharded")
    sd = {name: value(k) for k, name in enumerate(NAMES)}  # insertion order = C entry order
    split = hf_split(sd, 100)
    files = sorted(f for f in os.listdir(d) if not f.startswith("."))
    check(files == sorted(list(split.filename_to_tensors) + ["model.safetensors.index.json"]),
          f"c_sharded: file names {files} match huggingface_hub's split")
    check(open(os.path.join(d, "model.safetensors.index.json")).read() == index_text(sd, split),
          "c_sharded: index.json identical to transformers' save_pretrained")
    for fname, names in split.filename_to_tensors.items():
        raw = open(os.path.join(d, fname), "rb").read()
        check(raw == save({n: sd[n] for n in names}, metadata={"format": "pt"}),
              f"c_sharded: {fname} identical to the Python library's bytes")


def cmd_check(root):
    check_single(root, "c_f32", "F32")
    check_single(root, "c_f16", "F16")
    check_single(root, "c_bf16", "BF16")
    check_sharded(root)
    print("all interop checks passed")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        raise SystemExit(__doc__)
    (cmd_write if sys.argv[1] == "write" else cmd_check)(sys.argv[2])
