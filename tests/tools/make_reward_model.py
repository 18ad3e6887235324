"""Writes a tiny Qwen2ForSequenceClassification reward model, its tokenizer, and the scores
PyTorch/transformers computes for three chat transcripts, into tests/data/reward_model/.

tests/test_reward.c loads the directory with rf_reward_model_open, encodes the same texts with
rlflow's tokenizer (the ids must equal the ones below), and must reproduce the scores. The
scores come from transformers' own sequence-classification head on a right-padded batch with
an attention mask, so its pooling rule (the last token that is not pad_token_id) is what is
tested; the third transcript ends in the pad token on purpose. Run from the repository root:
    python3 tests/tools/make_reward_model.py tests/data/reward_model
Needs torch, transformers and tokenizers (developer machines only; the C test needs none)."""
import json
import os
import sys

import torch
import transformers as tf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; pad = 0
CORPUS = [
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n12 * 7 = 84. #### 84",
    "The answer is 42. Let me think step by step: first the total, then the rest.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
    "So the final answer is \\boxed{\\frac{1}{2}} and that is the answer.",
] * 8
TEXTS = [
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n12 * 7 = 84. #### 84<|im_end|>",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\nI think it is 74.<|im_end|>",
    "<|im_start|>user\nHalf of one?<|im_end|>\n<|im_start|>assistant\n\\boxed{\\frac{1}{2}}<|endoftext|>",
]


def make_tokenizer(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= 300, tok.get_vocab_size()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2TokenizerFast", "bos_token": None,
                   "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "add_prefix_space": False}, f, indent=1)
    return tok


def perturb(model, seed):
    """Random norms and biases too, so that a mix-up of any tensor shows in the scores."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def main(path):
    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path)
    cfg = tf.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                         tie_word_embeddings=False, num_labels=1, pad_token_id=0,
                         bos_token_id=None, eos_token_id=2)
    torch.manual_seed(7)
    model = tf.Qwen2ForSequenceClassification(cfg).eval()
    perturb(model, 107)
    model.save_pretrained(path, safe_serialization=True)
    # The reference is what transformers computes from the saved files, loaded in fp32.
    model = tf.Qwen2ForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tok.encode(t).ids for t in TEXTS]
    T = max(len(s) for s in ids)
    batch = torch.tensor([s + [0] * (T - len(s)) for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in ids])
    with torch.no_grad():
        scores = model(input_ids=batch, attention_mask=mask).logits[:, 0]
    exp = {"texts": TEXTS, "ids": ids, "scores": scores.tolist(), "pad_token_id": 0,
           "transformers": tf.__version__, "torch": torch.__version__}
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(exp, f, indent=1)
    print(sorted(os.listdir(path)), [len(s) for s in ids], exp["scores"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/reward_model")
