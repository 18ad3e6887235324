#!/usr/bin/env python3
"""TRL GRPOTrainer on the default recipe's task, for the learning-efficiency comparison in
docs/training.md (not a dependency of rlflow: needs torch, transformers and trl from pip).

It trains the same warm start rlflow's examples/grpo.toml starts from (a Hugging Face
directory: config.json, model.safetensors, tokenizer.json), on the same prompts
(data/arith3d/train.jsonl), with the same batch (prompts per step, group size), lengths,
learning rate, clipping, KL (none), loss aggregation and reward (rlflow's `numeric` rule: the
last number of the response equals the answer), and evaluates held-out greedy accuracy on the
same prompts the way `rlflow eval` does.  Prints one JSON line per evaluation and one with the
mean seconds per step.

  python3 tests/tools/trl_grpo_compare.py --model models/arith3d-sft --steps 200 --eval-every 100
"""
import argparse
import json
import os
import re
import time


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="warm start (HF directory rlflow wrote)")
    p.add_argument("--train", default="data/arith3d/train.jsonl")
    p.add_argument("--val", default="data/arith3d/val.jsonl")
    p.add_argument("--val-size", type=int, default=500)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="group size (rollout.n)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="/tmp/trl_grpo_compare")
    return p.parse_args()


NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def numeric_reward(response, truth):
    """rlflow's `numeric` rule for integer answers: the last number of the response, commas
    dropped, equals the truth's number."""
    m = NUM.findall(response or "")
    t = NUM.findall(truth or "")
    if not m or not t:
        return 0.0
    try:
        return 1.0 if float(m[-1].replace(",", "")) == float(t[-1].replace(",", "")) else 0.0
    except ValueError:
        return 0.0


def load_jsonl(path, limit=None):
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
            if limit and len(rows) >= limit:
                break
    return rows


def greedy_accuracy(model, tok, rows, max_new_tokens, torch):
    """Greedy accuracy, one batch per prompt length (no padding: rlflow's eval packs nothing
    either, so both see the same context)."""
    model.eval()
    by_len = {}
    for r in rows:
        ids = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        by_len.setdefault(len(ids), []).append((ids, r["answer"]))
    correct = 0
    with torch.no_grad():
        for _, items in by_len.items():
            x = torch.tensor([i for i, _ in items])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.eos_token_id)
            for row, (_, ans) in zip(out, items):
                text = tok.decode(row[x.shape[1]:], skip_special_tokens=True)
                correct += numeric_reward(text, ans)
    model.train()
    return correct / len(rows)


def main():
    a = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import torch
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import trl

    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    need = a.steps * a.prompts_per_step
    train = load_jsonl(a.train, need)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train])
    val = load_jsonl(a.val, a.val_size)

    def reward_fn(prompts, completions, answer, **kw):
        return [numeric_reward(c, t) for c, t in zip(completions, answer)]

    cfg = dict(output_dir=a.out, learning_rate=a.lr, lr_scheduler_type="constant", warmup_ratio=0.0,
               weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
               per_device_train_batch_size=a.prompts_per_step * a.n, gradient_accumulation_steps=1,
               num_generations=a.n, max_completion_length=a.max_new_tokens,
               temperature=1.0, top_p=1.0, beta=0.0, epsilon=a.clip_low, epsilon_high=a.clip_high,
               loss_type="dapo", scale_rewards="group",
               num_iterations=1, max_steps=a.steps, logging_steps=10, save_strategy="no", report_to="none",
               use_cpu=True, bf16=False, fp16=False, seed=a.seed, shuffle_dataset=False,
               mask_truncated_completions=False, disable_dropout=True, dataloader_num_workers=0)
    fields = GRPOConfig.__dataclass_fields__
    if "max_prompt_length" in fields:
        cfg["max_prompt_length"] = 32
    cfg = {k: v for k, v in cfg.items() if k in fields}
    args = GRPOConfig(**cfg)

    times = []
    log = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if state.global_step % a.eval_every == 0 or state.global_step == a.steps:
                acc = greedy_accuracy(kw["model"], tok, val, a.max_new_tokens, torch)
                rec = {"trl": trl.__version__, "step": state.global_step,
                       "samples": state.global_step * a.prompts_per_step * a.n,
                       "val_accuracy": acc, "s_per_step": sum(times) / len(times)}
                log.append(rec)
                print(json.dumps(rec), flush=True)

    acc0 = greedy_accuracy(model, tok, val, a.max_new_tokens, torch)
    print(json.dumps({"step": 0, "val_accuracy": acc0}), flush=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Timer()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    hist = [h for h in trainer.state.log_history if "reward" in h]
    print(json.dumps({"summary": True, "steps": a.steps, "threads": a.threads,
                      "s_per_step_mean": sum(times) / len(times), "s_per_step_min": min(times),
                      "train_wall_s": wall, "final_val_accuracy": log[-1]["val_accuracy"] if log else None,
                      "reward_last_logged": hist[-1]["reward"] if hist else None}), flush=True)


if __name__ == "__main__":
    main()
