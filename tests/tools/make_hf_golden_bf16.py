"""Writes tiny bf16 Hugging Face models and what transformers computes for them in bf16 and fp32.

tests/test_hf_golden.c loads each directory with rlflow (rf_model_load and rf_model_load_frozen)
and compares: its fp32 forward with transformers' fp32 forward of the same (bf16-valued) weights
tightly, and its bf16 forward (model.precision = "bf16": bf16 operands, fp32 accumulation and
activations) with transformers run in bf16 (torch.bfloat16 weights and activations, eager
attention) within the tolerance explained there. Per-token log-probs and entropies of the next
tokens, and the last position's logits, of sequences of different lengths.
Run from the repository root:
    python3 tests/tools/make_hf_golden_bf16.py tests/data/hf
Needs torch and transformers (developer machines only; the C test needs neither)."""
import json
import os
import sys

import torch
import transformers as tf

SEQS = [[5, 17, 42, 99, 3, 250, 7, 7, 8, 120], [1, 2, 3],
        [200, 201, 13, 13, 13, 88, 77, 66, 55, 44, 33, 22, 11, 0, 299, 150]]


def common(**kw):
    base = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-6, eos_token_id=299, bos_token_id=1)
    base.update(kw)
    return base


MODELS = {
    "qwen2_bf16": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                   common(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama_bf16_tied": (tf.LlamaConfig, tf.LlamaForCausalLM,
                        common(tie_word_embeddings=True, rope_theta=500000.0)),
}


def perturb(model, seed):
    """Random norms and biases too, so that a mix-up of any tensor shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def outputs(model):
    out = {"logprobs": [], "entropy": [], "last_logits": []}
    for s in SEQS:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = model(ids).logits[0].float()  # bf16 model: bf16 logits, widened exactly
        lp = torch.log_softmax(logits[:-1], -1)
        out["logprobs"].append(lp.gather(1, ids[0, 1:, None])[:, 0].tolist())
        out["entropy"].append((-(lp.exp() * lp).sum(-1)).tolist())
        out["last_logits"].append([round(x, 6) for x in logits[-1].tolist()])
    return out


def main(root):
    for i, (name, (cfg_cls, model_cls, cfg)) in enumerate(MODELS.items()):
        torch.manual_seed(50 + i)
        model = model_cls(cfg_cls(**cfg)).eval()
        perturb(model, 150 + i)
        path = os.path.join(root, name)
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        exp = {"sequences": SEQS}
        for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            m = model_cls.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
            exp[key] = outputs(m)
        exp["transformers"] = tf.__version__
        exp["torch"] = torch.__version__
        with open(os.path.join(path, "expected.json"), "w") as f:
            json.dump(exp, f, separators=(",", ":"))
        print(name, sorted(os.listdir(path)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/hf")
