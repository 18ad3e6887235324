#!/usr/bin/env python3
"""PyTorch's side of bench/bench_model.c: the same model shapes, batches, threads and FLOP counts,
printed as JSON lines of the same shape (bench, config, precision, tokens_per_s, seconds, gflops),
so the two can be put side by side (bench/side_by_side_table.py).

Not part of rlflow: it needs torch and transformers installed by pip on the measuring machine.

  python3 bench/torch_side_by_side.py --config small|qwen0.5b --precision fp32|bf16 \
      [--quick] [--no-compile] [--only train,prefill,decode1,decode32,adamw]

- train_step: forward + per-token log-probs of the targets + backward + clip_grad_norm_(1.0) +
  AdamW (torch.optim.AdamW, lr 1e-5, weight decay 0.01), eager and torch.compile (the model's
  forward and the log-prob compiled; the optimizer eager). bf16: torch.autocast("cpu", bf16) around
  the forward, fp32 master weights and AdamW state (the mixed precision rlflow's bf16 mode has).
- adamw: clip_grad_norm_ + AdamW step alone; GB/s of the same 32 bytes per parameter rlflow counts.
- prefill: B x L prompt tokens with use_cache=True, logits of the last token only.
- decode1 / decode32: Hugging Face generate (greedy, no early stop) after a 16-token prompt;
  tokens/s of the decoding steps alone: (generate of n + 1 new tokens) - (generate of 1).
  bf16: the model converted to bfloat16 (how Hugging Face inference runs bf16).
Threads: OMP_NUM_THREADS (default 2), torch.set_num_threads. Random weights (std 0.02).
"""
import argparse
import json
import os
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

CONFIGS = {
    # bench_model's "small": rf_config_preset "25m" with vocab 16384
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=16384,
                  max_position_embeddings=2048, rope_theta=10000.0, batch=8, seq=256),
    # Qwen/Qwen2.5-0.5B's config.json
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                     max_position_embeddings=32768, rope_theta=1000000.0, batch=2, seq=256),
}


def emit(**kv):
    print(json.dumps(kv), flush=True)


def make_model(name):
    c = dict(CONFIGS[name])
    c.pop("batch"), c.pop("seq")
    cfg = Qwen2Config(**c, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                      initializer_range=0.02, attn_implementation="sdpa")
    torch.manual_seed(1)
    return Qwen2ForCausalLM(cfg), cfg


def matmul_weights(cfg):
    """Weights touched by the layers' matmuls and the LM head (model/model.c's count)."""
    C, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    QD = cfg.num_attention_heads * (C // cfg.num_attention_heads)
    KD = cfg.num_key_value_heads * (C // cfg.num_attention_heads)
    return L * (2 * C * QD + 2 * C * KD + 3 * C * F), cfg.vocab_size * C


def train_flops_per_token(cfg, seq):
    """rf_model_train_flops_per_token: 6 N + 3 x causal attention."""
    layers, head = matmul_weights(cfg)
    QD = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    attn = cfg.num_hidden_layers * 2.0 * 2.0 * QD * seq / 2.0
    return 6.0 * (layers + head) + 3.0 * attn


def prefill_flops(cfg, B, L):
    """bench_model.c's forward_flops: layers' matmuls on every token, LM head on the last of each
    sequence, QK^T and PV over the causal half."""
    layers, head = matmul_weights(cfg)
    QD = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    att = 2.0 * cfg.num_hidden_layers * QD * L * L
    return 2.0 * layers * B * L + 2.0 * head * B + att * B


def best_of(fn, reps):
    best = float("inf")
    for i in range(reps + 1):  # the first run warms up
        t = time.perf_counter()
        fn()
        el = time.perf_counter() - t
        if i > 0:
            best = min(best, el)
    return best


def bench_train(model, cfg, a, impl):
    B, L = CONFIGS[a.config]["batch"], CONFIGS[a.config]["seq"]
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    bf16 = a.precision == "bf16"

    def logprobs(ids, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits
        return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)

    fwd = torch.compile(logprobs) if impl == "torch_compile" else logprobs
    times = {}

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lp = fwd(tok, tgt)
        loss = -lp.mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t3 = time.perf_counter()
        times.update(fwd=t1 - t0, bwd=t2 - t1, opt=t3 - t2)

    t_first = time.perf_counter()
    step()  # warm-up (and compilation)
    first = time.perf_counter() - t_first
    best, best_times = float("inf"), None
    for _ in range(1 if a.quick else 3):
        t = time.perf_counter()
        step()
        el = time.perf_counter() - t
        if el < best:
            best, best_times = el, dict(times)
    T = B * L
    fl = train_flops_per_token(cfg, L) * T
    emit(bench="train_step", impl=impl, config=a.config, precision=a.precision,
         params=sum(p.numel() for p in model.parameters()), tokens=T, seconds=round(best, 4),
         forward_s=round(best_times["fwd"], 4), backward_s=round(best_times["bwd"], 4),
         optim_s=round(best_times["opt"], 4), first_step_s=round(first, 2),
         tokens_per_s=round(T / best, 1), gflops=round(fl / best / 1e9, 2),
         threads=torch.get_num_threads())
    return opt


def bench_adamw(model, opt, a):
    n = sum(p.numel() for p in model.parameters())

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    best = best_of(step, 2 if a.quick else 5)
    emit(bench="adamw", impl="torch", config=a.config, precision=a.precision, params=n, seconds=round(best, 4),
         bytes=32 * n, gb_per_s=round(32 * n / best / 1e9, 2))


def bench_prefill(model, cfg, a):
    B, L = CONFIGS[a.config]["batch"], CONFIGS[a.config]["seq"]
    tok = torch.arange(B * L).reshape(B, L) % cfg.vocab_size
    model.eval()

    def run():
        with torch.no_grad():
            model(input_ids=tok, use_cache=True, logits_to_keep=1)
    best = best_of(run, 1 if a.quick else 2)
    emit(bench="prefill", impl="torch_eager", config=a.config, precision=a.precision,
         sequences=B, prompt_len=L, seconds=round(best, 4), tokens_per_s=round(B * L / best, 1),
         gflops=round(prefill_flops(cfg, B, L) / best / 1e9, 2))


def bench_decode(model, cfg, a, B):
    steps = (8 if a.quick else 32) * (2 if a.config == "small" else 1)
    P = 16
    tok = (torch.arange(B * P).reshape(B, P) * 31) % cfg.vocab_size
    mask = torch.ones_like(tok)
    model.eval()

    def gen(n):
        with torch.no_grad():
            out = model.generate(input_ids=tok, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert out.shape[1] == P + n
    gen(2)  # warm-up
    reps = 1 if a.quick else 2
    t1 = min(timed(lambda: gen(1)) for _ in range(reps))
    tn = min(timed(lambda: gen(steps + 1)) for _ in range(reps))
    el = max(tn - t1, 1e-9)
    layers, head = matmul_weights(cfg)
    emit(bench="decode", impl="hf_generate", config=a.config, precision=a.precision, batch=B,
         steps=steps, seconds=round(el, 4), tokens_per_s=round(B * steps / el, 1),
         gflops=round(2.0 * (layers + head) * B * steps / el / 1e9, 2))


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def wanted(a, name):
    return a.only is None or name in a.only.split(",")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--only")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    emit(bench="machine", impl="torch", torch=torch.__version__,
         threads=torch.get_num_threads(), cpu_capability=torch.backends.cpu.get_cpu_capability())
    model, cfg = make_model(a.config)
    opt = None
    if wanted(a, "train"):
        opt = bench_train(model, cfg, a, "torch_eager")
        if wanted(a, "adamw"):
            bench_adamw(model, opt, a)
        if not a.no_compile:
            try:
                bench_train(model, cfg, a, "torch_compile")
            except Exception as e:  # report, do not hide: compile may not work on this CPU
                emit(bench="train_step", impl="torch_compile", config=a.config,
                     precision=a.precision, error=f"{type(e).__name__}: {e}"[:300])
        del opt
        model.zero_grad(set_to_none=True)
    if a.precision == "bf16":
        model = model.to(torch.bfloat16)
    if wanted(a, "prefill"):
        bench_prefill(model, cfg, a)
    if wanted(a, "decode1"):
        bench_decode(model, cfg, a, 1)
    if wanted(a, "decode32"):
        bench_decode(model, cfg, a, 32)


if __name__ == "__main__":
    main()
