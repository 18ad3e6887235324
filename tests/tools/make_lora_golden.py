"""Loads the LoRA adapter rlflow saved (tests/data/lora/adapter, written by
`test_lora_golden --write-adapter tests/data/lora/adapter`) onto its base model
(tests/data/hf/qwen2_tied) with transformers + PEFT and writes the per-token log-probs of next
tokens PyTorch computes (tests/data/lora/expected.json). tests/test_lora_golden.c loads the same
adapter with rlflow and must reproduce them. tests/data/lora/merged (config.json,
model.safetensors: what `rlflow merge-lora --model tests/data/hf/qwen2_tied --adapter
tests/data/lora/adapter --out DIR` writes, byte for byte, test_lora_golden checks) is loaded by
transformers alone, without PEFT, as a plain model: its log-probs must equal PEFT's with the
adapter (within 1e-5), and are written as logprobs_merge_lora. It also makes an adapter with PEFT
itself (get_peft_model + save_pretrained: rank 2, alpha 6 on q, k, gate, down, B drawn from
normal(0, 0.1), seed 1) into tests/data/lora/peft_adapter and writes its log-probs as
logprobs_peft_made: rlflow must load what PEFT writes, not only what it writes itself.
Run from the repository root:
    python3 tests/tools/make_lora_golden.py tests/data/hf/qwen2_tied tests/data/lora
Needs torch, transformers and peft (developer machines only; the C test needs none of them)."""
import json
import os
import sys

import torch
import transformers as tf
from peft import LoraConfig, PeftModel, get_peft_model

SEQS = [[5, 17, 42, 99, 3, 250, 7], [1, 2], [200, 201, 13, 13, 13, 88, 77, 66, 55, 44, 33]]


def logprobs(model):
    out = []
    with torch.no_grad():
        for s in SEQS:
            ids = torch.tensor([s])
            lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            out.append(lp.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def peft_made(base_dir, root):
    """An adapter written by PEFT's save_pretrained, and its log-probs under PEFT."""
    torch.manual_seed(1)
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    cfg = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"],
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    out = os.path.join(root, "peft_adapter")
    model.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # the model card: not part of the adapter
    return logprobs(model.eval())


def main(base_dir, root):
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    plain = logprobs(base)
    model = PeftModel.from_pretrained(base, os.path.join(root, "adapter")).eval()
    with_adapter = logprobs(model)
    merged = logprobs(model.merge_and_unload())
    plain_merged = logprobs(tf.AutoModelForCausalLM.from_pretrained(os.path.join(root, "merged"),
                                                                    dtype=torch.float32).eval())
    gap = max(abs(a - b) for x, y in zip(plain_merged, with_adapter) for a, b in zip(x, y))
    assert gap < 1e-5, f"rlflow merge-lora's directory in transformers differs from PEFT by {gap}"
    made = peft_made(base_dir, root)
    out = {"sequences": SEQS, "logprobs_peft_made": made, "logprobs": with_adapter, "logprobs_merged": merged, "logprobs_base": plain,
           "logprobs_merge_lora": plain_merged,
           "peft_version": __import__("peft").__version__, "transformers_version": tf.__version__}
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(out, f, indent=1)
    worst = max(abs(a - b) for x, y in zip(with_adapter, plain) for a, b in zip(x, y))
    print(f"wrote {root}/expected.json; the adapter moves log-probs by up to {worst:.3g}; "
          f"merge-lora's directory in transformers is within {gap:.2g} of PEFT")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
