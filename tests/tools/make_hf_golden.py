"""Writes tiny Hugging Face models and the outputs PyTorch/transformers computes for them.

The C test tests/test_hf_golden.c loads each directory with rlflow and must reproduce these
numbers: per-token log-probs and entropies of next tokens (packed batch of sequences of
different lengths), greedy continuations, and value-head outputs. Run from the repository root:
    python3 tests/tools/make_hf_golden.py tests/data/hf
Needs torch and transformers (developer machines only; the C test needs neither)."""
import json
import os
import sys

import torch
import transformers as tf

SEQS = [[5, 17, 42, 99, 3, 250, 7], [1, 2], [200, 201, 13, 13, 13, 88, 77, 66, 55, 44, 33]]
GEN_PROMPTS = [[5, 17, 42], [200, 9, 9, 9, 9]]
GEN_NEW = 8


def common(**kw):
    base = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-6, eos_token_id=299, bos_token_id=1)
    base.update(kw)
    return base


MODELS = {
    "qwen2_tied": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                   common(tie_word_embeddings=True, rope_theta=10000.0), {}),
    "qwen3_sharded_bf16": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
                           common(head_dim=16, tie_word_embeddings=False, rope_theta=1000.0),
                           dict(max_shard_size="40KB", dtype=torch.bfloat16)),
    "llama3_scaled_bias": (tf.LlamaConfig, tf.LlamaForCausalLM,
                           common(attention_bias=True, rope_theta=500000.0,
                                  rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=16)),
                           {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM,
                common(num_key_value_heads=1, sliding_window=None, rope_theta=10000.0), {}),
    "qwen2_value_head": (tf.Qwen2Config, tf.Qwen2ForSequenceClassification,
                         common(num_labels=1, pad_token_id=0), {}),
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


def expected_lm(model):
    out = {"sequences": SEQS, "logprobs": [], "entropy": [], "greedy": []}
    for s in SEQS:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = model(ids).logits[0].float()[:-1]
        lp = torch.log_softmax(logits, -1)
        out["logprobs"].append(lp.gather(1, ids[0, 1:, None])[:, 0].tolist())
        out["entropy"].append((-(lp.exp() * lp).sum(-1)).tolist())
    for p in GEN_PROMPTS:
        with torch.no_grad():
            g = model.generate(torch.tensor([p]), max_new_tokens=GEN_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        out["greedy"].append({"prompt": p, "tokens": g[0, len(p):].tolist()})
    return out


def expected_values(model):
    out = {"sequences": SEQS, "values": []}
    for s in SEQS:
        with torch.no_grad():
            h = model.model(torch.tensor([s])).last_hidden_state
            out["values"].append(model.score(h)[0, :, 0].tolist())
    return out


def main(root):
    for i, (name, (cfg_cls, model_cls, cfg, save)) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = model_cls(cfg_cls(**cfg)).eval()
        perturb(model, 100 + i)
        dtype = save.pop("dtype", None)
        path = os.path.join(root, name)
        if dtype is not None:
            model = model.to(dtype)
        model.save_pretrained(path, safe_serialization=True, **save)
        # The reference is what transformers computes from the saved files, loaded in fp32.
        model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
        exp = expected_values(model) if "value_head" in name else expected_lm(model)
        exp["transformers"] = tf.__version__
        exp["torch"] = torch.__version__
        with open(os.path.join(path, "expected.json"), "w") as f:
            json.dump(exp, f, indent=1)
        print(name, sorted(os.listdir(path)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/hf")
