/* Recipe schema, loading, validation, dump and reference docs. See recipe.h. */
#define _POSIX_C_SOURCE 200809L
#include "controller/recipe.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/curve.h"
#include "common/toml.h"
#include "common/util.h"
#include "env/calculator.h"
#include "model/generate.h"
#include "reward/reward.h"

typedef enum { T_STR, T_INT, T_FLOAT, T_BOOL, T_ENUM, T_STRS, T_FLOATS, T_ARGVS } key_type;

typedef struct rkey {
    const char *section, *name;
    key_type type;
    size_t off;                  /* of the field in rf_recipe */
    const char *def;             /* default, as TOML */
    const char *const *allowed;  /* T_ENUM values, or T_STRS items (NULL: any), NULL-terminated */
    const char *doc;
} rkey;

static const char *const DEVICES[] = {"cpu", "cuda", NULL};
static const char *const PRECISIONS[] = {"auto", "fp32", "bf16", NULL};
static const char *const AUTO_ON_OFF[] = {"auto", "on", "off", NULL};
static const char *const PRESETS[] = {"", "tiny", "small", "25m", NULL};
static const char *const TEMPLATES[] = {"", "chatml", "llama3", NULL};
static const char *const ALGOS[] = {"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", NULL};
static const char *const AGGS[] = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm", NULL};
static const char *const KL_ESTS[] = {"k1", "k2", "k3", NULL};
static const char *const SCHEDULES[] = {"constant", "cosine", NULL};
static const char *const RULES[] = {"numeric", "math", "exact", "countdown", "format", "length",
                                    "overlong", NULL};
static const char *const PG_LOSSES[] = {"clip", "gspo", "cispo", NULL};
static const char *const CORRECTIONS[] = {"none", "tis", "mis-token", "mis-seq", NULL};
static const char *const TASKS[] = {"", "arith", "countdown", "multiply", NULL};
static const char *const ENV_TYPES[] = {"", "calculator", "external", NULL};
static const char *const AUTO_BOOL[] = {"auto", "true", "false", NULL};
static const char *const MODES[] = {"colocated", "split", NULL};
static const char *const LORA_TARGETS[] = {"q", "k", "v", "o", "gate", "up", "down", NULL};
static const char *const LORA_INITS[] = {"gaussian", "kaiming", NULL};

#define AT(field) offsetof(rf_recipe, field)

static const struct { const char *name, *doc; } SECTIONS[] = {
    {"model", "The policy model."},
    {"data", "Prompt data sets (JSONL, one object per line)."},
    {"rollout", "Generation: sampling and the continuous-batching engine."},
    {"algorithm", "Advantage estimator, policy loss, KL and reward shaping."},
    {"train", "Optimizer and the RL update loop."},
    {"sft", "Supervised fine-tuning (`rlflow sft`)."},
    {"lora", "Low-rank adapters (LoRA, as Hugging Face PEFT): train small matrices A and B on chosen projections of the frozen policy, y = x W^T + (alpha / rank) (x A^T) B^T (docs/training.md, \"LoRA\")."},
    {"reward", "Built-in reward rules and an optional reward model."},
    {"env", "Multi-turn episodes with an environment: the built-in calculator tool or environment programs over the message API (docs/env-api.md)."},
    {"reference", "The frozen reference policy for the KL term."},
    {"critic", "The value model (PPO)."},
    {"logging", "Metrics and validation."},
    {"checkpoint", "Checkpoints in logging.dir."},
    {"async", "Asynchronous (off-policy) training."},
    {"placement", "Where roles run."},
    {"placement.actor", "Parallel layout of the training roles (the actor, and the critic on the same ranks); docs/scaling.md."},
    {"placement.rollout", "Parallel layout of each rollout worker."},
    {"placement.critic", "Parallel layout of the critic on the training ranks: on the first or every data-parallel replica, whole on its first rank or split over its first tp ranks (docs/scaling.md)."},
    {"placement.reference", "Parallel layout of the reference policy on the training ranks: on the first or every data-parallel replica, whole on its first rank or split over its first tp ranks (docs/scaling.md)."},
    {"placement.reward", "Where the reward model (reward.model) scores in split runs: on the first dp data-parallel replicas, whole on each one's first rank or split over its first tp ranks (docs/scaling.md)."},
};
#define N_SECTIONS (sizeof SECTIONS / sizeof SECTIONS[0])

static const rkey KEYS[] = {
    {"model", "path", T_STR, AT(model.path), "\"\"", NULL, "Hugging Face model directory of the policy (config.json, model.safetensors, tokenizer.json)."},
    {"model", "init_preset", T_ENUM, AT(model.init_preset), "\"\"", PRESETS, "When set and model.path does not exist, create a randomly initialized model of this size there."},
    {"model", "device", T_ENUM, AT(model.device), "\"cpu\"", DEVICES, "Device of the policy."},
    {"model", "precision", T_ENUM, AT(model.precision), "\"auto\"", PRECISIONS, "Operands of every matrix product (training and generation): bf16 with fp32 accumulation, or fp32; auto = bf16 where the CPU has AVX512-BF16 or AMX-BF16 and on CUDA, else fp32. Weights, gradients, optimizer state, norms, softmax and losses stay fp32."},

    {"data", "train", T_STR, AT(data.train), "\"\"", NULL, "Training prompts (JSONL)."},
    {"data", "val", T_STR, AT(data.val), "\"\"", NULL, "Validation prompts (JSONL); \"\" = no validation."},
    {"data", "prompt_key", T_STR, AT(data.prompt_key), "\"prompt\"", NULL, "Field of each JSONL object that holds the prompt."},
    {"data", "answer_key", T_STR, AT(data.answer_key), "\"answer\"", NULL, "Field that holds the reference answer the reward rules compare with."},
    {"data", "chat_template", T_ENUM, AT(data.chat_template), "\"\"", TEMPLATES, "Wrap prompts in a chat template; \"\" = raw text."},
    {"data", "shuffle", T_BOOL, AT(data.shuffle), "true", NULL, "Shuffle the training prompts every epoch."},
    {"data", "seed", T_INT, AT(data.seed), "1", NULL, "Seed of the shuffle."},
    {"data", "max_prompt_tokens", T_INT, AT(data.max_prompt_tokens), "256", NULL, "Prompts longer than this many tokens are dropped at load; 0 = keep all."},
    {"data", "task", T_ENUM, AT(data.task), "\"\"", TASKS, "Built-in task: when data.train does not exist, generate train.jsonl and val.jsonl of this task in its directory."},
    {"data", "task_train", T_INT, AT(data.task_train), "5000", NULL, "Task: training examples to generate."},
    {"data", "task_val", T_INT, AT(data.task_val), "200", NULL, "Task: validation examples to generate (distinct from the training ones)."},
    {"data", "task_min_digits", T_INT, AT(data.task_min_digits), "1", NULL, "arith, multiply: fewest digits per operand."},
    {"data", "task_max_digits", T_INT, AT(data.task_max_digits), "3", NULL, "arith, multiply: most digits per operand."},
    {"data", "task_mul_percent", T_INT, AT(data.task_mul_percent), "10", NULL, "arith: percent of problems that are products."},
    {"data", "task_n_numbers", T_INT, AT(data.task_n_numbers), "3", NULL, "countdown: numbers per problem."},
    {"data", "task_max_number", T_INT, AT(data.task_max_number), "50", NULL, "countdown: numbers are drawn from 1..task_max_number."},
    {"data", "task_max_target", T_INT, AT(data.task_max_target), "200", NULL, "countdown: targets are in 1..task_max_target."},

    {"rollout", "n", T_INT, AT(rollout.n), "8", NULL, "Samples per prompt (the group size of GRPO and RLOO)."},
    {"rollout", "prompts_per_step", T_INT, AT(rollout.prompts_per_step), "16", NULL, "Prompts per training step."},
    {"rollout", "temperature", T_FLOAT, AT(rollout.temperature), "1.0", NULL, "Sampling temperature (0 = greedy)."},
    {"rollout", "top_p", T_FLOAT, AT(rollout.top_p), "1.0", NULL, "Nucleus sampling mass, in (0, 1]."},
    {"rollout", "top_k", T_INT, AT(rollout.top_k), "0", NULL, "Sample among the k most likely tokens; 0 = all."},
    {"rollout", "max_new_tokens", T_INT, AT(rollout.max_new_tokens), "64", NULL, "Longest response, in tokens."},
    {"rollout", "stop", T_STRS, AT(rollout.stop), "[]", NULL, "Strings that end a response (besides EOS); at most 8 (7 with env.type = \"calculator\" unless one of them is its \"</calc>\")."},
    {"rollout", "max_running", T_INT, AT(rollout.max_running), "64", NULL, "Sequences in the running batch of the generation engine."},
    {"rollout", "kv_block_size", T_INT, AT(rollout.kv_block_size), "16", NULL, "Tokens per paged KV-cache block."},
    {"rollout", "kv_blocks", T_INT, AT(rollout.kv_blocks), "0", NULL, "KV-cache blocks in the pool (rollout.kv_block_size tokens each); they bound how many tokens the running sequences hold. 0 = sized from memory when the engine starts: enough for rollout.max_running sequences of the longest length (data.max_prompt_tokens + rollout.max_new_tokens, at most the model's positions), or as many as rollout.kv_memory_fraction of the device's free memory holds when that is fewer (the size is logged). On the CPU only the blocks ever used are resident (docs/rollout.md)."},
    {"rollout", "kv_memory_fraction", T_FLOAT, AT(rollout.kv_memory_fraction), "0", NULL, "With rollout.kv_blocks = 0: the most of the device's free memory, measured after the models are loaded, that the KV cache may take, in (0, 1]; 0 = 0.9 in split runs (a rollout rank's device holds its model and the cache) and 0.5 in colocated runs (training's activations need the rest). A budget that cannot hold one sequence of the longest length is refused, naming this key. On the CPU the free memory is MemAvailable."},

    {"rollout", "free_kv_cache", T_ENUM, AT(rollout.free_kv_cache), "\"auto\"", AUTO_ON_OFF, "Give the KV cache's memory back to the device whenever generation pauses (the engine has nothing to run: in a colocated run, while training has the device) and allocate it again when generation resumes, verl's free_cache_engine (vLLM's sleep mode); training's activation and gradient buffers go back after each update in turn, so each phase has the device to itself. \"auto\" = \"on\" in colocated runs on GPUs (placement.mode = \"colocated\", in one process or one per device; model.device = \"cuda\") and \"off\" in split runs, whose rollout devices hold nothing else, and on the CPU, where each phase would fault its pages in again: \"on\" there cut the peak resident memory of a 25M-parameter colocated run by 14% and made the default recipe's training 6-54% slower (docs/rollout.md). The pool's size is kept (rollout.kv_blocks, rollout.kv_memory_fraction). The first release is logged with the MB given back; a cache that no longer fits when generation resumes is an error naming the keys that size it."},

    {"algorithm", "name", T_ENUM, AT(algorithm.name), "\"grpo\"", ALGOS, "Advantage estimator: PPO (GAE with a critic), GRPO, Dr. GRPO, RLOO or REINFORCE++."},
    {"algorithm", "gamma", T_FLOAT, AT(algorithm.gamma), "1.0", NULL, "Discount (PPO, REINFORCE++)."},
    {"algorithm", "lam", T_FLOAT, AT(algorithm.lam), "1.0", NULL, "GAE lambda (PPO)."},
    {"algorithm", "clip_low", T_FLOAT, AT(algorithm.clip_low), "0.2", NULL, "Lower clip epsilon of the ratio."},
    {"algorithm", "clip_high", T_FLOAT, AT(algorithm.clip_high), "0.2", NULL, "Upper clip epsilon of the ratio (DAPO's clip-higher when larger)."},
    {"algorithm", "dual_clip", T_FLOAT, AT(algorithm.dual_clip), "0.0", NULL, "Dual-clip constant c > 1 for negative advantages; 0 = off."},
    {"algorithm", "value_clip", T_FLOAT, AT(algorithm.value_clip), "0.2", NULL, "Clip range of the value loss (PPO)."},
    {"algorithm", "loss_agg", T_ENUM, AT(algorithm.loss_agg), "\"token-mean\"", AGGS, "How token losses are averaged over a mini-batch."},
    {"algorithm", "norm_adv_by_std", T_BOOL, AT(algorithm.norm_adv_by_std), "true", NULL, "GRPO: divide group advantages by the group's standard deviation."},
    {"algorithm", "whiten_advantages", T_BOOL, AT(algorithm.whiten_advantages), "true", NULL, "PPO: whiten advantages over the batch."},
    {"algorithm", "kl_coef", T_FLOAT, AT(algorithm.kl_coef), "0.0", NULL, "KL coefficient beta; 0 = no KL term."},
    {"algorithm", "kl_in_reward", T_BOOL, AT(algorithm.kl_in_reward), "false", NULL, "Apply the KL as a per-token reward penalty (k1) instead of a loss term."},
    {"algorithm", "kl_estimator", T_ENUM, AT(algorithm.kl_estimator), "\"k3\"", KL_ESTS, "KL estimator of the loss term."},
    {"algorithm", "adaptive_kl", T_BOOL, AT(algorithm.adaptive_kl), "false", NULL, "Adapt kl_coef towards kl_target (Ziegler et al. 2019)."},
    {"algorithm", "kl_target", T_FLOAT, AT(algorithm.kl_target), "6.0", NULL, "Target KL of the adaptive controller."},
    {"algorithm", "kl_horizon", T_INT, AT(algorithm.kl_horizon), "10000", NULL, "Horizon of the adaptive controller, in samples."},
    {"algorithm", "entropy_coef", T_FLOAT, AT(algorithm.entropy_coef), "0.0", NULL, "Entropy bonus coefficient."},
    {"algorithm", "dynamic_sampling", T_BOOL, AT(algorithm.dynamic_sampling), "false", NULL, "DAPO: drop groups whose rewards are all equal and sample more prompts."},
    {"algorithm", "max_resample_rounds", T_INT, AT(algorithm.max_resample_rounds), "4", NULL, "Dynamic sampling: most extra rounds per step."},
    {"algorithm", "overlong_buffer", T_INT, AT(algorithm.overlong_buffer), "0", NULL, "DAPO overlong shaping: tokens before max_new_tokens where the penalty ramps up; 0 = off."},
    {"algorithm", "overlong_penalty", T_FLOAT, AT(algorithm.overlong_penalty), "1.0", NULL, "Penalty at max_new_tokens for overlong shaping."},
    {"algorithm", "decoupled", T_BOOL, AT(algorithm.decoupled), "false", NULL, "Decoupled PPO objective for off-policy samples (behaviour log-probs)."},
    {"algorithm", "is_cap", T_FLOAT, AT(algorithm.is_cap), "5.0", NULL, "Cap of the truncated importance weight (decoupled objective; rollout_correction = \"tis\")."},
    {"algorithm", "policy_loss", T_ENUM, AT(algorithm.policy_loss), "\"clip\"", PG_LOSSES, "Policy loss: \"clip\" = PPO's clipped surrogate on each token's ratio; \"gspo\" = GSPO (Zheng et al. 2025): one ratio per sequence, exp of the mean over its tokens of the log ratio, clipped to [1 - clip_low, 1 + clip_high] for the whole sequence (the paper used clip_low = 3e-4, clip_high = 4e-4, with loss_agg = \"seq-mean-token-mean\"); \"cispo\" = CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * advantage * log-prob on every token, no token dropped from the gradient (clip_low = 1 leaves no lower bound, as the paper). Definitions: docs/training.md, \"Policy losses and rollout corrections\"."},
    {"algorithm", "rollout_correction", T_ENUM, AT(algorithm.rollout_correction), "\"none\"", CORRECTIONS, "Correction for the gap between the generation log-probs (behaviour) and the training engine's (proximal), ratio = exp(prox - behav): \"tis\" weights each token by min(ratio, is_cap) (the same as decoupled = true); \"mis-token\" weights by the ratio and drops tokens whose ratio is outside [rollout_is_low, rollout_is_high]; \"mis-seq\" weights every token of a sequence by the sequence's ratio (exp of the mean log ratio over its tokens) and drops whole sequences outside the range. Dropped tokens keep their place in loss_agg's denominators. \"none\": no correction (unless decoupled = true or async.max_staleness > 0, which use \"tis\"). Metrics: actor/is_weight_mean, actor/is_weight_max, actor/is_truncated_frac (tis), actor/is_masked_frac and actor/is_masked_seq_frac (mis-seq) (docs/metrics.md)."},
    {"algorithm", "rollout_is_low", T_FLOAT, AT(algorithm.rollout_is_low), "0.5", NULL, "Masked IS (rollout_correction = \"mis-token\" / \"mis-seq\"): lowest ratio kept, in [0, 1]."},
    {"algorithm", "rollout_is_high", T_FLOAT, AT(algorithm.rollout_is_high), "2.0", NULL, "Masked IS: highest ratio kept, >= 1."},

    {"train", "steps", T_INT, AT(train.steps), "100", NULL, "Training steps (policy updates)."},
    {"train", "lr", T_FLOAT, AT(train.lr), "1e-5", NULL, "Peak learning rate of the policy."},
    {"train", "warmup_steps", T_INT, AT(train.warmup_steps), "0", NULL, "Linear warm-up steps."},
    {"train", "schedule", T_ENUM, AT(train.schedule), "\"constant\"", SCHEDULES, "Learning-rate schedule after warm-up."},
    {"train", "min_lr_ratio", T_FLOAT, AT(train.min_lr_ratio), "0.0", NULL, "Cosine schedule: final learning rate as a fraction of lr."},
    {"train", "weight_decay", T_FLOAT, AT(train.weight_decay), "0.0", NULL, "AdamW weight decay."},
    {"train", "beta1", T_FLOAT, AT(train.beta1), "0.9", NULL, "AdamW beta1."},
    {"train", "beta2", T_FLOAT, AT(train.beta2), "0.999", NULL, "AdamW beta2."},
    {"train", "eps", T_FLOAT, AT(train.eps), "1e-8", NULL, "AdamW epsilon."},
    {"train", "grad_clip", T_FLOAT, AT(train.grad_clip), "1.0", NULL, "Clip the global gradient norm to this; 0 = off."},
    {"train", "ppo_epochs", T_INT, AT(train.ppo_epochs), "1", NULL, "Passes over each step's batch."},
    {"train", "mini_batches", T_INT, AT(train.mini_batches), "1", NULL, "Optimizer steps per pass (the batch is split into this many)."},
    {"train", "micro_batch_tokens", T_INT, AT(train.micro_batch_tokens), "4096", NULL, "Tokens per forward/backward micro-batch (gradient accumulation)."},
    {"train", "seed", T_INT, AT(train.seed), "1", NULL, "Seed of sampling and initialization."},

    {"sft", "epochs", T_INT, AT(sft.epochs), "1", NULL, "Passes over data.train."},
    {"sft", "lr", T_FLOAT, AT(sft.lr), "1e-4", NULL, "Learning rate."},
    {"sft", "batch_size", T_INT, AT(sft.batch_size), "16", NULL, "Examples per optimizer step."},
    {"sft", "max_steps", T_INT, AT(sft.max_steps), "0", NULL, "Stop after this many steps; 0 = epochs decide."},
    {"sft", "target_accuracy", T_FLOAT, AT(sft.target_accuracy), "0.0", NULL, "Stop early once the greedy accuracy (reward rules) on the first sft.check_size examples of data.train, measured every sft.check_every steps, reaches this; 0 = off (max_steps or epochs decide). The learning-rate schedule still spans max_steps. A warm start stopped this way has the same competence whatever the floating-point path."},
    {"sft", "check_every", T_INT, AT(sft.check_every), "100", NULL, "Steps between the checks of sft.target_accuracy."},
    {"sft", "check_size", T_INT, AT(sft.check_size), "256", NULL, "Examples (the first ones of data.train, in file order) the sft.target_accuracy check generates for."},
    {"sft", "out", T_STR, AT(sft.out), "\"\"", NULL, "Output model directory; \"\" = <logging.dir>/sft."},
    {"sft", "warm_start", T_BOOL, AT(sft.warm_start), "false", NULL, "rlflow run: when model.path holds no model, build it by SFT of a fresh model.init_preset model on data.train responses first."},

    {"lora", "enabled", T_BOOL, AT(lora.enabled), "false", NULL, "Train adapters instead of the policy's weights (rlflow run and rlflow sft): the base weights are frozen (no gradients or AdamW moments for them), the reference policy of the KL term is the base model itself (no second copy), and checkpoints hold the adapters and their moments. In one process, and in split runs (placement.mode = \"split\") with any placement.actor.dp (plain data parallelism or ZeRO-1), placement.actor.tp (adapters split like their base matrices) and placement.rollout.tp (each rollout rank holds its shard of the base), where only the adapters travel to the rollout workers after each update (each worker loads the frozen base once; every transfer carries the base's CRC-32C, and a worker on another base refuses it). Without reference.path the reference is the actor's own frozen base, split as the actor is (placement.reference.tp other than placement.actor.tp is refused). Colocated runs on several processes (placement.mode = \"colocated\" with a parallel layout): a rollout rank reading its training rank's weights in place sees the adapters there; with other layouts it holds its own base and receives the adapters alone."},
    {"lora", "rank", T_INT, AT(lora.rank), "8", NULL, "Rank r of every adapter (PEFT's r); at most the model's hidden_size."},
    {"lora", "alpha", T_FLOAT, AT(lora.alpha), "16.0", NULL, "Scale numerator: the adapter's product is multiplied by alpha / rank (PEFT's lora_alpha)."},
    {"lora", "dropout", T_FLOAT, AT(lora.dropout), "0.0", NULL, "Dropout on the adapter input (PEFT's lora_dropout): only 0 is implemented; another value is refused."},
    {"lora", "targets", T_STRS, AT(lora.targets), "[\"q\", \"v\"]", LORA_TARGETS, "Projections that get an adapter, in every layer: q, k, v, o (attention) and gate, up, down (MLP); PEFT's target_modules q_proj ... down_proj. Each at most once (a name given twice is refused)."},
    {"lora", "init", T_ENUM, AT(lora.init), "\"gaussian\"", LORA_INITS, "Initialisation of A (B starts at zero, so a fresh adapter changes nothing): gaussian = normal(0, 1/rank) (PEFT's init_lora_weights = \"gaussian\"), kaiming = uniform(-1/sqrt(in), 1/sqrt(in)) (PEFT's default kaiming_uniform_(a = sqrt(5))). Seeded by train.seed."},

    {"reward", "rules", T_STRS, AT(reward.rules), "[\"numeric\"]", RULES, "Built-in reward rules, summed with their weights (docs/rewards.md). Not set and data.task = \"countdown\": [\"countdown\"]. [] = no rule: allowed when reward.programs, reward.external or reward.model gives the reward (validation then scores with those too). A correctness rule that cannot check the task is refused: numeric, math or exact with data.task = \"countdown\" (they would reward the bare target number), countdown with data.task = \"arith\"."},
    {"reward", "weights", T_FLOATS, AT(reward.weights), "[]", NULL, "One weight per rule; [] = all 1.0."},
    {"reward", "format_regex", T_STR, AT(reward.format_regex), "\"\"", NULL, "PCRE2 pattern a response must match for the format rule."},
    {"reward", "answer_regex", T_STR, AT(reward.answer_regex), "\"\"", NULL, "PCRE2 pattern that extracts the answer the correctness rules (numeric, math, exact, countdown) read: its last match in the response, the first capture group (the whole match when it has none), e.g. \"<answer>(.*?)</answer>\". No match: those rules score 0. \"\" = each rule's own extraction (docs/rewards.md). A pattern PCRE2 refuses is an error naming this key and PCRE2's message."},
    {"reward", "length_target", T_INT, AT(reward.length_target), "0", NULL, "Length rule: target response length in tokens."},
    {"reward", "length_penalty", T_FLOAT, AT(reward.length_penalty), "0.0", NULL, "Length rule: penalty per token away from the target."},
    {"reward", "model", T_STR, AT(reward.model), "\"\"", NULL, "Reward model directory (ForSequenceClassification); \"\" = none."},
    {"reward", "model_weight", T_FLOAT, AT(reward.model_weight), "1.0", NULL, "Weight of the reward model's score."},
    {"reward", "external", T_STR, AT(reward.external), "\"\"", NULL, "ZeroMQ endpoint rlflow binds for external reward programs (docs/reward-api.md), e.g. \"tcp://127.0.0.1:5557\"; \"\" = none. An endpoint other machines can reach (not 127.0.0.1, localhost or ipc://) needs CURVE (external_curve_secret and external_curve_clients) or external_insecure = true."},
    {"reward", "external_weight", T_FLOAT, AT(reward.external_weight), "1.0", NULL, "Weight of the external reward programs' score."},
    {"reward", "external_timeout", T_FLOAT, AT(reward.external_timeout), "30.0", NULL, "Seconds to wait for a reward program to connect, and the longest silence allowed while scoring."},
    {"reward", "external_curve_secret", T_STR, AT(reward.external_curve_secret), "\"\"", NULL, "Path of a file holding rlflow's CURVE secret key (Z85, the PREFIX.key that `rlflow keygen --out PREFIX` writes; keep it mode 600). With external_curve_clients, connections to reward.external are encrypted and only the listed programs get in (docs/reward-api.md, \"CURVE\"); \"\" = no CURVE."},
    {"reward", "external_curve_clients", T_STR, AT(reward.external_curve_clients), "\"\"", NULL, "Path of a file listing the CURVE public keys of the reward programs allowed to connect, one per line (their PREFIX.pub files, concatenated); a refused connection is logged with its address and key. Needed with external_curve_secret."},
    {"reward", "external_insecure", T_BOOL, AT(reward.external_insecure), "false", NULL, "Let reward.external bind an address other machines can reach without CURVE (anyone who reaches the port can then send the rewards that train the policy; a warning is logged). false: such a recipe is refused."},
    {"reward", "programs", T_ARGVS, AT(reward.programs), "[]", NULL, "Reward programs rlflow starts itself, each an argv: [[\"python3\", \"my_reward.py\"]]. They run in rlflow's working directory, get the endpoint and keys in their environment (RLFLOW_REWARD_ENDPOINT, ...: docs/reward-api.md, \"Programs started by rlflow\"; the Python and C clients read them), write their output to <logging.dir>/reward_program_<i>.log, are restarted when they exit (reward.program_restarts) and stopped at the end of the run. Without reward.external, rlflow binds a loopback endpoint with CURVE keys made for the run. In split runs the controller process starts them."},
    {"reward", "program_restarts", T_INT, AT(reward.program_restarts), "3", NULL, "How many times each of reward.programs is started again after it exits, over the whole run; one more exit stops the run with an error naming the program, its exit status and its log."},

    {"env", "type", T_ENUM, AT(env.type), "\"\"", ENV_TYPES, "\"\" = single-turn responses. \"calculator\": every sample is an episode with the built-in calculator tool: a turn that ends with a tool call <calc>EXPRESSION</calc> (the stop string \"</calc>\" is added to rollout.stop) gets <result>VALUE</result> back and the model writes on; a turn without a call ends the episode (docs/env-api.md, \"The calculator\"). \"external\": environment programs connected to env.endpoint answer each reset and turn (docs/env-api.md). The reward rules score the last turn's text; turn rewards add up with it (GRPO family: one reward per episode; PPO and REINFORCE++: each at its turn's last token). Every deployment: in split and multi-device runs the controller owns the environment and the rollout workers run the turns (docs/env-api.md, \"Episodes in split and multi-device runs\")."},
    {"env", "endpoint", T_STR, AT(env.endpoint), "\"\"", NULL, "With env.type = \"external\": the ZeroMQ endpoint rlflow binds for environment programs, e.g. \"tcp://127.0.0.1:5558\"; \"\" with env.programs: a loopback endpoint with CURVE keys made for the run. An endpoint other machines can reach needs CURVE (env.curve_secret and env.curve_clients) or env.insecure = true."},
    {"env", "max_turns", T_INT, AT(env.max_turns), "4", NULL, "Turns per episode at most: the environment's step after the last one says `last` and the episode ends (truncated) whatever it answers."},
    {"env", "max_total_tokens", T_INT, AT(env.max_total_tokens), "256", NULL, "Tokens after the prompt (and the reset's observation) per episode at most, generated and observed; a turn also ends at rollout.max_new_tokens tokens. An observation that would leave no room for one more token ends the episode (truncated). Must be >= rollout.max_new_tokens."},
    {"env", "timeout", T_FLOAT, AT(env.timeout), "30.0", NULL, "Seconds: the wait for the first environment program, the longest silence, and the per-call deadline (a program holding requests without answering any for this long is dropped and its requests go to another program)."},
    {"env", "curve_secret", T_STR, AT(env.curve_secret), "\"\"", NULL, "Path of rlflow's CURVE secret key file (rlflow keygen) for env.endpoint; with env.curve_clients only the listed programs get in; \"\" = no CURVE."},
    {"env", "curve_clients", T_STR, AT(env.curve_clients), "\"\"", NULL, "Path of a file listing the CURVE public keys of the environment programs allowed to connect, one per line. Needed with env.curve_secret."},
    {"env", "insecure", T_BOOL, AT(env.insecure), "false", NULL, "Let env.endpoint bind an address other machines can reach without CURVE (warned). false: such a recipe is refused."},
    {"env", "programs", T_ARGVS, AT(env.programs), "[]", NULL, "Environment programs rlflow starts itself (env.type = \"external\"), each an argv: [[\"python3\", \"my_env.py\"]]. They run in rlflow's working directory, get the endpoint and keys in their environment (RLFLOW_ENV_ENDPOINT, ...: docs/env-api.md, \"Programs started by rlflow\"; the Python and C clients read them), write their output to <logging.dir>/env_program_<i>.log, are restarted when they exit (env.program_restarts; the requests a program held go to another one or to its restart) and stopped at the end of the run. Without env.endpoint, rlflow binds a loopback endpoint with CURVE keys made for the run. In split and multi-device runs the controller process starts them."},
    {"env", "program_restarts", T_INT, AT(env.program_restarts), "3", NULL, "How many times each of env.programs is started again after it exits, over the whole run; one more exit stops the run with an error naming the program, its exit status and its log."},

    {"reference", "enabled", T_ENUM, AT(reference.enabled), "\"auto\"", AUTO_BOOL, "Keep a reference policy; \"auto\" = when algorithm.kl_coef > 0 (true and false may be written as booleans)."},
    {"reference", "path", T_STR, AT(reference.path), "\"\"", NULL, "Reference model directory; \"\" = the initial policy."},

    {"critic", "path", T_STR, AT(critic.path), "\"\"", NULL, "Critic model directory; \"\" = the initial policy with a fresh value head."},
    {"critic", "lr", T_FLOAT, AT(critic.lr), "1e-5", NULL, "Learning rate of the critic."},
    {"critic", "warmup_steps", T_INT, AT(critic.warmup_steps), "0", NULL, "Linear warm-up steps of the critic."},

    {"logging", "dir", T_STR, AT(logging.dir), "\"runs/default\"", NULL, "Run directory: metrics, samples, TensorBoard files, the effective recipe, checkpoints, run_status.json. Relative to the current directory. A directory that already holds a run is refused unless `rlflow run` says --resume (continue it) or --overwrite (remove it first)."},
    {"logging", "every", T_INT, AT(logging.every), "1", NULL, "Print the console progress line every this many steps (and at the last step). metrics.jsonl and the TensorBoard files get every step whatever this is."},
    {"logging", "val_every", T_INT, AT(logging.val_every), "10", NULL, "Validate (greedy, on the first logging.val_size prompts of data.val) before training (step 0), every this many steps and at the last step; 0 = never (no validation at all)."},
    {"logging", "val_size", T_INT, AT(logging.val_size), "200", NULL, "Validation prompts used (the first ones of data.val)."},
    {"logging", "samples_every", T_INT, AT(logging.samples_every), "0", NULL, "Every this many steps, log logging.samples_per_step of the step's training samples (prompt, response, answer, reward and its components, advantage) to samples.jsonl and as TensorBoard text (docs/metrics.md); 0 = never."},
    {"logging", "samples_per_step", T_INT, AT(logging.samples_per_step), "4", NULL, "Samples logged at each logging.samples_every step: the first ones of the batch, at most its size (one response of each group in turn, then the second of each, ...)."},
    {"logging", "tensorboard", T_BOOL, AT(logging.tensorboard), "true", NULL, "Write TensorBoard event files."},
    {"logging", "jsonl", T_BOOL, AT(logging.jsonl), "true", NULL, "Write metrics.jsonl."},

    {"checkpoint", "every", T_INT, AT(checkpoint.every), "50", NULL, "Save every this many steps; 0 = only at the end. rlflow sft: every this many SFT steps, into <logging.dir>/sft_checkpoints (--resume continues from there)."},
    {"checkpoint", "keep", T_INT, AT(checkpoint.keep), "2", NULL, "Checkpoints kept (older ones are deleted); 0 = all."},
    {"checkpoint", "save_optimizer", T_BOOL, AT(checkpoint.save_optimizer), "true", NULL, "Save optimizer state too (needed to resume exactly)."},

    {"async", "max_staleness", T_INT, AT(async.max_staleness), "0", NULL, "Policy versions a sample may lag behind the trainer (k): the trainer at version v takes only samples whose oldest token is at version >= v - k, and prompts are admitted only while their samples can still meet that bound; 0 = synchronous on-policy. k > 0 needs placement.mode = \"split\" and turns on the decoupled objective."},
    {"async", "buffer_groups", T_INT, AT(async.buffer_groups), "0", NULL, "Prompt groups admitted and not yet trained on, at most (in flight plus buffered); 0 = rollout.prompts_per_step * (max_staleness + 1)."},
    {"async", "peer_timeout", T_FLOAT, AT(async.peer_timeout), "30.0", NULL, "Seconds a worker (or the controller, seen from a worker) may stay silent before it is reported lost and the run stops."},
    {"async", "progress_timeout", T_FLOAT, AT(async.progress_timeout), "1800.0", NULL, "Runs under mpirun (split, or colocated on several devices): seconds without a step, a sample, a score, a weights report or a checkpoint while every worker is alive (answering heartbeats) before the run stops with an error saying what each role was doing; longer than the slowest training step. 0: no bound."},
    {"async", "startup_timeout", T_FLOAT, AT(async.startup_timeout), "600.0", NULL, "Seconds to wait for every worker to connect (and, under a user's mpirun, for rank 0 to prepare data and model)."},

    {"placement", "mode", T_ENUM, AT(placement.mode), "\"colocated\"", MODES, "colocated: roles share devices and alternate (one process; with placement.actor.dp x placement.actor.tp or placement.rollout.tp above 1, one process per device under mpirun, each running a training rank and a rollout rank in two threads, taking turns: zero-copy when placement.rollout.tp = placement.actor.tp, else resharded in place); split: rollout and training on separate devices, at the same time (docs/deployment.md)."},
    {"placement", "device", T_ENUM, AT(placement.device), "\"cpu\"", DEVICES, "Device of the training roles."},
    {"placement", "rollout_ranks", T_INT, AT(placement.rollout_ranks), "1", NULL, "split: rollout worker processes (each a whole copy of the policy, or placement.rollout.tp ranks of it). Under a user's mpirun, when not set: every rank past the controller and the training ranks. Colocated on several devices: the training ranks / placement.rollout.tp (rollout worker i's ranks run in the processes of training ranks i x placement.rollout.tp ..), set by rlflow (another value is an error)."},
    {"placement", "rollout_threads", T_INT, AT(placement.rollout_threads), "0", NULL, "split: CPU threads per rollout worker; 0 = the machine's cores divided by (rollout_ranks + the training ranks, placement.actor.dp x placement.actor.tp)."},
    {"placement", "train_threads", T_INT, AT(placement.train_threads), "0", NULL, "split: CPU threads of each training worker (each data- and tensor-parallel rank); 0 = the machine's cores divided by the training ranks, placement.actor.dp x placement.actor.tp (idle threads sleep: OMP_WAIT_POLICY=PASSIVE)."},
    {"placement", "endpoint", T_STR, AT(placement.endpoint), "\"\"", NULL, "split: the controller's ZeroMQ endpoint for workers; \"\" = tcp on 127.0.0.1 when every rank is on one machine, else on rank 0's host name, a free port."},
    {"placement", "mpirun", T_STR, AT(placement.mpirun), "\"mpirun\"", NULL, "split: the MPI launcher `rlflow run` starts the processes with when it is not already under mpirun."},

    {"placement.actor", "dp", T_INT, AT(placement.actor.dp), "1", NULL, "Data-parallel training ranks (MPI ranks 1..dp; the rollout workers follow them): each trains on its share of every batch and the gradients are summed over them, so an optimizer step equals one rank's on the same samples (with train.mini_batches > 1 each mini-batch takes a part of every rank's share). With placement.actor.tp > 1 too, dp replicas of tp ranks each (dp x tp training ranks, tp varying fastest: training rank i is shard i % tp of replica i / tp); each shard's gradients are summed over its replicas. dp > 1 runs under mpirun: placement.mode = \"split\", or \"colocated\" with a rollout rank in each training rank's process; with model.device = \"cuda\" the gradients are reduced over NCCL, each machine's ranks taking its visible GPUs in turn, one per training rank (docs/scaling.md)."},
    {"placement.actor", "tp", T_INT, AT(placement.actor.tp), "1", NULL, "Tensor-parallel ranks of the actor (MPI ranks 1..tp; the rollout workers follow them): each holds one shard (attention heads, MLP rows, vocabulary rows; norms whole), all train on every whole batch (with placement.actor.dp > 1: on their replica's share) together, and their shards are resharded into each rollout worker's whole copy after every step (from replica 0). The critic and the reference follow the actor's layout unless [placement.critic] / [placement.reference] say otherwise; the reward model is whole on each replica's first rank ([placement.reward]). Must divide the model's attention heads; tp > 1 runs under mpirun (placement.mode = \"split\", or \"colocated\", where tp = placement.actor.tp generates with the training shards themselves); on CUDA the shards compute over NCCL (docs/scaling.md)."},
    {"placement.actor", "zero", T_INT, AT(placement.actor.zero), "0", NULL, "ZeRO stage of the training roles' optimizer state: 0 = every data-parallel rank holds all of it; 1 = sharded across the placement.actor.dp ranks (gradients reduce-scattered, AdamW on each rank's shard, parameters allgathered; needs dp > 1; with placement.actor.tp > 1 each tensor-parallel shard's state is sharded over its dp replicas). Stages 2 and 3 are refused (not implemented)."},

    {"placement.rollout", "tp", T_INT, AT(placement.rollout.tp), "1", NULL, "Tensor-parallel ranks per rollout worker (split: MPI ranks after the training ranks, tp consecutive ranks per rollout worker; colocated: threads of tp consecutive training ranks' processes): each holds one shard of the policy and a KV cache of its own k/v heads; the first runs the engine (scheduler, sampling, the controller's link) and drives the others step by step, and the weights are resharded from the training layout into every rank's shard. Must divide the model's attention heads; tp > 1 runs under mpirun (placement.mode = \"split\", or \"colocated\" with a rollout rank in each training rank's process); on CUDA the shards compute over NCCL (docs/scaling.md)."},
    {"placement.rollout", "replicas", T_INT, AT(placement.rollout.replicas), "0", NULL, "Rollout workers (generation replicas, each a whole copy of the policy); the same count as placement.rollout_ranks, which it sets (giving both with different values is an error); 0 = placement.rollout_ranks."},
    {"placement.critic", "dp", T_INT, AT(placement.critic.dp), "0", NULL, "Data-parallel replicas holding the critic, 1 .. placement.actor.dp; 0 = placement.actor.dp. The first dp replicas hold it: a batch is split over them in token-balanced shares of its own (the actor's shares are over all the replicas), the critic is trained data parallel over them (gradients summed, ZeRO-1 as placement.actor.zero), and values are computed on them. 1: the first replica alone trains it on whole batches and computes every batch's values."},
    {"placement.critic", "tp", T_INT, AT(placement.critic.tp), "0", NULL, "Tensor-parallel ranks of the critic in each replica; 0 = placement.actor.tp. 1: the critic is whole on the first rank of each replica; a larger value dividing placement.actor.tp: split over the replica's first tp ranks like the actor (value head whole on each; the other ranks hold none of it), trained tensor parallel, gathered tensor by tensor for checkpoints (the files those of a whole critic). Values that do not divide placement.actor.tp are refused when the run starts, with an error naming the key (the shards live on the first ranks of each replica). Must divide the critic model's attention heads."},
    {"placement.reference", "dp", T_INT, AT(placement.reference.dp), "0", NULL, "Data-parallel replicas holding the reference policy, 1 .. placement.actor.dp; 0 = placement.actor.dp. The first dp replicas hold it, and a scored batch is split over them (token-balanced shares, as training; over the fewer of the critic's and the reference's when both are asked for). 1: the first replica alone computes the reference log-probs of every scored batch."},
    {"placement.reference", "tp", T_INT, AT(placement.reference.tp), "0", NULL, "Tensor-parallel ranks of the reference policy in each replica holding it; 0 = placement.actor.tp. 1: whole on the replica's first rank; a larger value dividing placement.actor.tp: split over the replica's first tp ranks like the actor (vocabulary-parallel log-probs). Values that do not divide placement.actor.tp are refused when the run starts, with an error naming the key (the shards live on the first ranks of each replica). Must divide the reference model's attention heads. With lora.enabled and no reference.path the reference is the actor's frozen base shards themselves, so only placement.actor.tp (or 0) is accepted."},
    {"placement.reward", "dp", T_INT, AT(placement.reward.dp), "0", NULL, "Data-parallel replicas holding the reward model (reward.model) in split runs, 1 .. placement.actor.dp; 0 = placement.actor.dp. Each of the first dp replicas loads it whole on its first rank, and a scored batch is split over them in token-balanced shares (with the reference or the critic asked for too: over the fewest replicas holding every model asked for). 1: the first replica alone scores every batch. Colocated runs score on the one process."},
    {"placement.reward", "tp", T_INT, AT(placement.reward.tp), "1", NULL, "Tensor-parallel ranks of the reward model in each replica holding it: 1 = whole on the replica's first rank; a larger value dividing placement.actor.tp: split over the replica's first tp ranks (each reads its shard of reward.model's files; they score every share together). Must divide the reward model's attention heads. Values that do not divide placement.actor.tp are refused when the run starts, with an error naming the key (the shards live on the first ranks of each replica)."},
};
#define N_KEYS ((int)(sizeof KEYS / sizeof KEYS[0]))
_Static_assert(sizeof KEYS / sizeof KEYS[0] <= RF_RECIPE_MAX_KEYS, "raise RF_RECIPE_MAX_KEYS");

/* Values that parse but cannot work: lo/hi bounds, open or closed. */
static const struct { const char *key; double lo, hi; int lo_open, hi_open; } RANGES[] = {
    {"data.max_prompt_tokens", 0, INFINITY, 0, 1},
    {"reward.external_timeout", 0, INFINITY, 1, 1},
    {"reward.program_restarts", 0, INFINITY, 0, 1},
    {"env.program_restarts", 0, INFINITY, 0, 1},
    {"env.max_turns", 1, 1000, 0, 0},
    {"env.max_total_tokens", 1, INFINITY, 0, 1},
    {"env.timeout", 0, INFINITY, 1, 1},
    {"data.task_train", 0, INFINITY, 0, 1},
    {"data.task_val", 0, INFINITY, 0, 1},
    {"data.task_min_digits", 1, 9, 0, 0},
    {"data.task_max_digits", 1, 9, 0, 0},
    {"data.task_mul_percent", 0, 100, 0, 0},
    {"data.task_n_numbers", 2, 6, 0, 0},
    {"data.task_max_number", 2, 9999, 0, 0},
    {"data.task_max_target", 1, INFINITY, 0, 1},
    {"rollout.n", 1, INFINITY, 0, 1},
    {"rollout.prompts_per_step", 1, INFINITY, 0, 1},
    {"rollout.temperature", 0, INFINITY, 0, 1},
    {"rollout.top_p", 0, 1, 1, 0},
    {"rollout.top_k", 0, INFINITY, 0, 1},
    {"rollout.max_new_tokens", 1, INFINITY, 0, 1},
    {"rollout.max_running", 1, INFINITY, 0, 1},
    {"rollout.kv_block_size", 1, INFINITY, 0, 1},
    {"rollout.kv_blocks", 0, INFINITY, 0, 1},
    {"rollout.kv_memory_fraction", 0, 1, 0, 0},
    {"algorithm.gamma", 0, 1, 0, 0},
    {"algorithm.lam", 0, 1, 0, 0},
    {"algorithm.clip_low", 0, INFINITY, 0, 1},
    {"algorithm.clip_high", 0, INFINITY, 0, 1},
    {"algorithm.dual_clip", 0, INFINITY, 0, 1},
    {"algorithm.value_clip", 0, INFINITY, 0, 1},
    {"algorithm.kl_coef", 0, INFINITY, 0, 1},
    {"algorithm.kl_target", 0, INFINITY, 1, 1},
    {"algorithm.kl_horizon", 1, INFINITY, 0, 1},
    {"algorithm.entropy_coef", 0, INFINITY, 0, 1},
    {"algorithm.max_resample_rounds", 0, INFINITY, 0, 1},
    {"algorithm.overlong_buffer", 0, INFINITY, 0, 1},
    {"algorithm.overlong_penalty", 0, INFINITY, 0, 1},
    {"algorithm.is_cap", 0, INFINITY, 1, 1},
    {"algorithm.rollout_is_low", 0, 1, 0, 0},
    {"algorithm.rollout_is_high", 1, INFINITY, 0, 1},
    {"train.steps", 0, INFINITY, 0, 1},
    {"train.lr", 0, INFINITY, 0, 1},
    {"train.warmup_steps", 0, INFINITY, 0, 1},
    {"train.min_lr_ratio", 0, 1, 0, 0},
    {"train.weight_decay", 0, INFINITY, 0, 1},
    {"train.beta1", 0, 1, 0, 1},
    {"train.beta2", 0, 1, 0, 1},
    {"train.eps", 0, INFINITY, 1, 1},
    {"train.grad_clip", 0, INFINITY, 0, 1},
    {"train.ppo_epochs", 1, INFINITY, 0, 1},
    {"train.mini_batches", 1, INFINITY, 0, 1},
    {"train.micro_batch_tokens", 1, INFINITY, 0, 1},
    {"sft.epochs", 0, INFINITY, 0, 1},
    {"sft.lr", 0, INFINITY, 0, 1},
    {"sft.batch_size", 1, INFINITY, 0, 1},
    {"sft.max_steps", 0, INFINITY, 0, 1},
    {"sft.target_accuracy", 0, 1, 0, 0},
    {"sft.check_every", 1, INFINITY, 0, 1},
    {"sft.check_size", 1, INFINITY, 0, 1},
    {"lora.rank", 1, INFINITY, 0, 1},
    {"lora.alpha", 0, INFINITY, 1, 1},
    {"lora.dropout", 0, 1, 0, 1},
    {"reward.length_target", 0, INFINITY, 0, 1},
    {"reward.length_penalty", 0, INFINITY, 0, 1},
    {"critic.lr", 0, INFINITY, 0, 1},
    {"critic.warmup_steps", 0, INFINITY, 0, 1},
    {"logging.every", 1, INFINITY, 0, 1},
    {"logging.val_every", 0, INFINITY, 0, 1},
    {"logging.val_size", 0, INFINITY, 0, 1},
    {"logging.samples_every", 0, INFINITY, 0, 1},
    {"logging.samples_per_step", 1, INFINITY, 0, 1},
    {"checkpoint.every", 0, INFINITY, 0, 1},
    {"checkpoint.keep", 0, INFINITY, 0, 1},
    {"async.max_staleness", 0, INFINITY, 0, 1},
    {"async.buffer_groups", 0, INFINITY, 0, 1},
    {"async.peer_timeout", 0, INFINITY, 1, 1},
    {"async.startup_timeout", 0, INFINITY, 1, 1},
    {"async.progress_timeout", 0, INFINITY, 0, 1},
    {"placement.rollout_ranks", 1, 1024, 0, 0},
    {"placement.rollout_threads", 0, 1024, 0, 0},
    {"placement.train_threads", 0, 1024, 0, 0},
    {"placement.actor.dp", 1, 1024, 0, 0},
    {"placement.actor.tp", 1, 1024, 0, 0},
    {"placement.actor.zero", 0, 3, 0, 0},
    {"placement.rollout.tp", 1, 1024, 0, 0},
    {"placement.rollout.replicas", 0, 1024, 0, 0},
    {"placement.critic.dp", 0, 1024, 0, 0},
    {"placement.critic.tp", 0, 1024, 0, 0},
    {"placement.reference.dp", 0, 1024, 0, 0},
    {"placement.reference.tp", 0, 1024, 0, 0},
    {"placement.reward.dp", 0, 1024, 0, 0},
    {"placement.reward.tp", 1, 1024, 0, 0},
};

/* ------------------------------------------------------------------ fields */

#define FIELD(r, k, T) ((T *)((char *)(r) + (k)->off))
#define CFIELD(r, k, T) ((const T *)((const char *)(r) + (k)->off))

static int key_index(const char *full) {
    for (int i = 0; i < N_KEYS; i++) {
        size_t s = strlen(KEYS[i].section);
        if (strncmp(full, KEYS[i].section, s) == 0 && full[s] == '.' &&
            strcmp(full + s + 1, KEYS[i].name) == 0)
            return i;
    }
    return -1;
}

static int section_known(const char *name) {
    for (size_t i = 0; i < N_SECTIONS; i++)
        if (strcmp(SECTIONS[i].name, name) == 0) return 1;
    return 0;
}

static void str_list_free(rf_str_list *l) {
    for (int i = 0; i < l->n; i++) free(l->v[i]);
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

static void argv_list_free(rf_argv_list *l) {
    for (int i = 0; i < l->n; i++) str_list_free(&l->v[i]);
    free(l->v);
    l->v = NULL;
    l->n = 0;
}

static void field_free(rf_recipe *r, const rkey *k) {
    if (k->type == T_STR) {
        free(*FIELD(r, k, char *));
        *FIELD(r, k, char *) = NULL;
    } else if (k->type == T_STRS) {
        str_list_free(FIELD(r, k, rf_str_list));
    } else if (k->type == T_ARGVS) {
        argv_list_free(FIELD(r, k, rf_argv_list));
    } else if (k->type == T_FLOATS) {
        rf_float_list *l = FIELD(r, k, rf_float_list);
        free(l->v);
        l->v = NULL;
        l->n = 0;
    }
}

void rf_recipe_free(rf_recipe *r) {
    if (!r) return;
    for (int i = 0; i < N_KEYS; i++) field_free(r, &KEYS[i]);
    free(r->source);
    memset(r, 0, sizeof *r);
}

/* Writes a TOML basic string: quotes, backslashes and control characters escaped. */
static void put_quoted(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        const char *esc = *p == '"' ? "\\\"" : *p == '\\' ? "\\\\" : *p == '\n' ? "\\n"
                        : *p == '\t' ? "\\t" : *p == '\r' ? "\\r" : NULL;
        if (esc) fputs(esc, f);
        else if (*p < 0x20 || *p == 0x7F) fprintf(f, "\\u%04X", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

/* Shortest of %.15g..%.17g that reads back exactly, always with a '.', 'e', inf or nan so it
 * stays a TOML float. */
static void put_float(FILE *f, double x) {
    if (isnan(x)) {
        fputs("nan", f);
        return;
    }
    if (isinf(x)) {
        fputs(x < 0 ? "-inf" : "inf", f);
        return;
    }
    char buf[40];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    fputs(buf, f);
    if (!strpbrk(buf, ".e")) fputs(".0", f);
}

/* The value of key k as TOML. */
static void put_value(FILE *f, const rf_recipe *r, const rkey *k) {
    switch (k->type) {
    case T_STR: put_quoted(f, *CFIELD(r, k, char *) ? *CFIELD(r, k, char *) : ""); break;
    case T_ENUM: put_quoted(f, *CFIELD(r, k, char *)); break;
    case T_INT: fprintf(f, "%d", *CFIELD(r, k, int)); break;
    case T_FLOAT: put_float(f, *CFIELD(r, k, double)); break;
    case T_BOOL: fputs(*CFIELD(r, k, int) ? "true" : "false", f); break;
    case T_STRS: {
        const rf_str_list *l = CFIELD(r, k, rf_str_list);
        fputc('[', f);
        for (int i = 0; i < l->n; i++) fputs(i ? ", " : "", f), put_quoted(f, l->v[i]);
        fputc(']', f);
        break;
    }
    case T_FLOATS: {
        const rf_float_list *l = CFIELD(r, k, rf_float_list);
        fputc('[', f);
        for (int i = 0; i < l->n; i++) fputs(i ? ", " : "", f), put_float(f, l->v[i]);
        fputc(']', f);
        break;
    }
    case T_ARGVS: {
        const rf_argv_list *l = CFIELD(r, k, rf_argv_list);
        fputc('[', f);
        for (int i = 0; i < l->n; i++) {
            fputs(i ? ", [" : "[", f);
            for (int j = 0; j < l->v[i].n; j++) fputs(j ? ", " : "", f), put_quoted(f, l->v[i].v[j]);
            fputc(']', f);
        }
        fputc(']', f);
        break;
    }
    }
}

/* put_value into a new string (the caller frees it). */
static char *value_text(const rf_recipe *r, const rkey *k) {
    char *s = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&s, &n);
    if (!m) return NULL;
    put_value(m, r, k);
    fclose(m);
    return s;
}

const char *rf_recipe_where(const rf_recipe *r, const char *key, char *buf, size_t cap) {
    int i = key_index(key);
    if (i < 0 || r->where_[i].from == 0) snprintf(buf, cap, "(default)");
    else if (r->where_[i].from == 2) snprintf(buf, cap, "--set");
    else snprintf(buf, cap, "%s:%d:%d", r->source ? r->source : "?", r->where_[i].line,
                  r->where_[i].col);
    return buf;
}

/* ------------------------------------------------------------------ setting values */

/* Where a value was written, for messages: "FILE:LINE:COL" of the node, or `origin` alone for
 * values that have no file ("--set", "(default)"). */
static const char *node_where(const rf_toml *v, char *buf, size_t cap) {
    const char *o = rf_toml_origin(v);
    if (strcmp(o, "--set") == 0 || strcmp(o, "(default)") == 0) snprintf(buf, cap, "%s", o);
    else snprintf(buf, cap, "%s:%d:%d", o, rf_toml_line(v), rf_toml_col(v));
    return buf;
}

static rf_status type_error(const rkey *k, const rf_toml *v, const char *want, const char *got) {
    char w[600];
    return rf_error(RF_ERR_ARG, "%s: %s.%s: expected %s %s, got %s %s", node_where(v, w, sizeof w),
                    k->section, k->name, rf_toml_article(want), want, rf_toml_article(got), got);
}

static rf_status not_allowed(const rkey *k, const rf_toml *v, const char *s) {
    char w[600], list[512] = "";
    size_t n = 0;
    for (int i = 0; k->allowed[i] && n < sizeof list; i++)
        n += (size_t)snprintf(list + n, sizeof list - n, "%s\"%s\"", i ? ", " : "", k->allowed[i]);
    return rf_error(RF_ERR_ARG, "%s: %s.%s: \"%s\" is not allowed (allowed: %s)",
                    node_where(v, w, sizeof w), k->section, k->name, s, list);
}

/* The allowed value equal to s (a static string), or NULL. */
static const char *allowed_value(const rkey *k, const char *s) {
    for (int i = 0; k->allowed[i]; i++)
        if (strcmp(k->allowed[i], s) == 0) return k->allowed[i];
    return NULL;
}

static rf_status set_str_list(rf_recipe *r, const rkey *k, const rf_toml *v) {
    size_t n = rf_toml_count(v);
    for (size_t i = 0; i < n; i++) {
        const rf_toml *it = rf_toml_at(v, i);
        if (rf_toml_kind(it) != RF_TOML_STRING)
            return type_error(k, it, "string", rf_toml_type_name(rf_toml_kind(it)));
        if (k->allowed && !allowed_value(k, rf_toml_string(it, NULL)))
            return not_allowed(k, it, rf_toml_string(it, NULL));
    }
    rf_str_list *l = FIELD(r, k, rf_str_list);
    str_list_free(l);
    if (n && !(l->v = rf_calloc(n, sizeof *l->v))) return RF_ERR_NOMEM;
    for (; l->n < (int)n; l->n++)
        if (!(l->v[l->n] = rf_strdup(rf_toml_string(rf_toml_at(v, (size_t)l->n), NULL))))
            return rf_error(RF_ERR_NOMEM, "out of memory");
    return RF_OK;
}

/* "reward.programs[1]" or "reward.programs[1][0]" (j < 0: the first alone). */
static rf_status argv_error(const rkey *k, const rf_toml *v, size_t i, long j, const char *what) {
    char w[600], idx[48];
    if (j < 0) snprintf(idx, sizeof idx, "[%zu]", i);
    else snprintf(idx, sizeof idx, "[%zu][%ld]", i, j);
    return rf_error(RF_ERR_ARG, "%s: %s.%s%s: %s", node_where(v, w, sizeof w), k->section, k->name, idx, what);
}

/* One program's argv: an array of one or more strings, the first not empty. */
static rf_status check_argv(const rkey *k, const rf_toml *a, size_t i) {
    char what[160];
    if (rf_toml_kind(a) != RF_TOML_ARRAY) {
        const char *got = rf_toml_type_name(rf_toml_kind(a));
        snprintf(what, sizeof what, "expected an array of strings (a program and its arguments), got %s %s",
                 rf_toml_article(got), got);
        return argv_error(k, a, i, -1, what);
    }
    if (rf_toml_count(a) == 0)
        return argv_error(k, a, i, -1, "is empty: give the program and its arguments, e.g. "
                                       "[\"python3\", \"my_reward.py\"]");
    for (size_t j = 0; j < rf_toml_count(a); j++) {
        const rf_toml *it = rf_toml_at(a, j);
        if (rf_toml_kind(it) != RF_TOML_STRING) {
            const char *got = rf_toml_type_name(rf_toml_kind(it));
            snprintf(what, sizeof what, "expected a string, got %s %s", rf_toml_article(got), got);
            return argv_error(k, it, i, (long)j, what);
        }
        if (j == 0 && !rf_toml_string(it, NULL)[0]) return argv_error(k, it, i, 0, "the program's name is empty");
    }
    return RF_OK;
}

static rf_status set_argv_list(rf_recipe *r, const rkey *k, const rf_toml *v) {
    size_t n = rf_toml_count(v);
    for (size_t i = 0; i < n; i++) RF_TRY(check_argv(k, rf_toml_at(v, i), i));
    rf_argv_list *l = FIELD(r, k, rf_argv_list);
    argv_list_free(l);
    if (n && !(l->v = rf_calloc(n, sizeof *l->v))) return rf_error(RF_ERR_NOMEM, "out of memory");
    for (; l->n < (int)n; l->n++) {
        const rf_toml *a = rf_toml_at(v, (size_t)l->n);
        rf_str_list *s = &l->v[l->n];
        size_t m = rf_toml_count(a);
        if (!(s->v = rf_calloc(m, sizeof *s->v))) return rf_error(RF_ERR_NOMEM, "out of memory");
        for (; s->n < (int)m; s->n++)
            if (!(s->v[s->n] = rf_strdup(rf_toml_string(rf_toml_at(a, (size_t)s->n), NULL))))
                return rf_error(RF_ERR_NOMEM, "out of memory");
    }
    return RF_OK;
}

static rf_status set_float_list(rf_recipe *r, const rkey *k, const rf_toml *v) {
    size_t n = rf_toml_count(v);
    for (size_t i = 0; i < n; i++) {
        rf_toml_type t = rf_toml_kind(rf_toml_at(v, i));
        if (t != RF_TOML_FLOAT && t != RF_TOML_INTEGER)
            return type_error(k, rf_toml_at(v, i), "float", rf_toml_type_name(t));
    }
    rf_float_list *l = FIELD(r, k, rf_float_list);
    free(l->v);
    l->v = NULL;
    l->n = 0;
    if (n && !(l->v = rf_calloc(n, sizeof *l->v))) return RF_ERR_NOMEM;
    for (; l->n < (int)n; l->n++) l->v[l->n] = rf_toml_float(rf_toml_at(v, (size_t)l->n));
    return RF_OK;
}

static rf_status set_int(rf_recipe *r, const rkey *k, const rf_toml *v) {
    int64_t x = rf_toml_int(v);
    if (x < INT32_MIN || x > INT32_MAX) {
        char w[600];
        return rf_error(RF_ERR_ARG, "%s: %s.%s: %lld is out of range", node_where(v, w, sizeof w),
                        k->section, k->name, (long long)x);
    }
    *FIELD(r, k, int) = (int)x;
    return RF_OK;
}

/* Type-checks v against key k and stores it. */
static rf_status set_value(rf_recipe *r, const rkey *k, const rf_toml *v) {
    static const char *const want[] = {"string", "integer", "float", "boolean", "string",
                                       "string array", "float array", "array of string arrays"};
    static const rf_toml_type need[] = {RF_TOML_STRING, RF_TOML_INTEGER, RF_TOML_FLOAT,
                                        RF_TOML_BOOL, RF_TOML_STRING, RF_TOML_ARRAY, RF_TOML_ARRAY,
                                        RF_TOML_ARRAY};
    rf_toml_type t = rf_toml_kind(v);
    if (k->type == T_ENUM && t == RF_TOML_BOOL && allowed_value(k, "true")) {
        /* auto|true|false keys also take the booleans themselves */
        *FIELD(r, k, const char *) = allowed_value(k, rf_toml_bool(v) ? "true" : "false");
        return RF_OK;
    }
    if (t != need[k->type] && !(k->type == T_FLOAT && t == RF_TOML_INTEGER))
        return type_error(k, v, want[k->type], rf_toml_type_name(t));
    switch (k->type) {
    case T_STR: {
        char *s = rf_strdup(rf_toml_string(v, NULL));
        if (!s) return rf_error(RF_ERR_NOMEM, "out of memory");
        free(*FIELD(r, k, char *));
        *FIELD(r, k, char *) = s;
        return RF_OK;
    }
    case T_ENUM: {
        const char *s = allowed_value(k, rf_toml_string(v, NULL));
        if (!s) return not_allowed(k, v, rf_toml_string(v, NULL));
        *FIELD(r, k, const char *) = s;
        return RF_OK;
    }
    case T_INT: return set_int(r, k, v);
    case T_FLOAT: *FIELD(r, k, double) = rf_toml_float(v); return RF_OK;
    case T_BOOL: *FIELD(r, k, int) = rf_toml_bool(v); return RF_OK;
    case T_STRS: return set_str_list(r, k, v);
    case T_FLOATS: return set_float_list(r, k, v);
    case T_ARGVS: return set_argv_list(r, k, v);
    }
    return RF_OK;
}

/* A scalar that is not a string: for a string key given on the command line, its text is
 * meant ("--set logging.dir=2024" is the directory "2024"). */
static int non_string_scalar(const rf_toml *doc) {
    rf_toml_type t = rf_toml_kind(rf_toml_value(doc, 0));
    return t != RF_TOML_STRING && t != RF_TOML_ARRAY && t != RF_TOML_TABLE;
}

/* Parses `text` as one TOML value (in a document "v = TEXT"); text that is not one, or any
 * scalar but a string when want_string, becomes a string. *doc owns *v afterwards. */
static rf_status parse_loose_value(const char *text, const char *origin, int want_string,
                                   rf_toml **doc, const rf_toml **v) {
    size_t n = strlen(text);
    char *buf = malloc(2 * n + 16);
    if (!buf) return rf_error(RF_ERR_NOMEM, "out of memory");
    snprintf(buf, 2 * n + 16, "v = %s\n", text);
    if (rf_toml_parse(doc, buf, strlen(buf), origin) != RF_OK || rf_toml_count(*doc) != 1 ||
        (want_string && non_string_scalar(*doc))) {
        rf_toml_free(*doc);
        char *q = NULL;
        size_t qn = 0;
        FILE *m = open_memstream(&q, &qn);
        if (m) fputs("v = ", m), put_quoted(m, text), fclose(m);
        rf_status st = q ? rf_toml_parse(doc, q, qn, origin) : RF_ERR_NOMEM;
        free(q);
        if (st != RF_OK) {
            free(buf);
            return rf_error(RF_ERR_INTERNAL, "%s: cannot read value \"%s\"", origin, text);
        }
        rf_error_clear(); /* the first parse's complaint was answered by reading a string */
    }
    free(buf);
    *v = rf_toml_find(*doc, "v");
    return RF_OK;
}

rf_status rf_recipe_init(rf_recipe *r) {
    memset(r, 0, sizeof *r);
    for (int i = 0; i < N_KEYS; i++) {
        rf_toml *doc;
        const rf_toml *v;
        rf_status st = parse_loose_value(KEYS[i].def, "(default)", 0, &doc, &v);
        if (st == RF_OK) st = set_value(r, &KEYS[i], v);
        rf_toml_free(doc);
        if (st != RF_OK) {
            rf_recipe_free(r);
            return st;
        }
    }
    return RF_OK;
}

/* ------------------------------------------------------------------ unknown keys */

static int edit_distance(const char *a, const char *b) {
    int n = (int)strlen(a), m = (int)strlen(b);
    if (n > 63 || m > 63) return 99;
    int row[64];
    for (int j = 0; j <= m; j++) row[j] = j;
    for (int i = 1; i <= n; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= m; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[m];
}

/* The valid key closest to section.name, or -1 when none is close: by the whole name, or by
 * the key name alone when it sits in the wrong section. */
static int closest_key(const char *section, const char *name) {
    char full[256], kfull[256];
    snprintf(full, sizeof full, "%s%s%s", section, *section ? "." : "", name);
    int best = -1, best_d = 1 + (int)strlen(name) / 3 + 1;
    for (int i = 0; i < N_KEYS; i++) {
        snprintf(kfull, sizeof kfull, "%s.%s", KEYS[i].section, KEYS[i].name);
        int d = edit_distance(full, kfull), d2 = edit_distance(name, KEYS[i].name) + 2;
        if (d2 < d) d = d2;
        if (d < best_d) best = i, best_d = d;
    }
    return best;
}

static rf_status unknown_key(const char *where, const char *section, const char *name) {
    int k = closest_key(section, name);
    char hint[300] = "";
    if (k >= 0) snprintf(hint, sizeof hint, " (did you mean \"%s.%s\"?)", KEYS[k].section, KEYS[k].name);
    return rf_error(RF_ERR_ARG, "%s: unknown key \"%s%s%s\"%s", where, section, *section ? "." : "",
                    name, hint);
}

static rf_status unknown_section(const char *where, const char *name) {
    int best = -1, best_d = 1 + (int)strlen(name) / 3 + 1;
    for (size_t i = 0; i < N_SECTIONS; i++) {
        int d = edit_distance(name, SECTIONS[i].name);
        if (d < best_d) best = (int)i, best_d = d;
    }
    char hint[300] = "";
    if (best >= 0) snprintf(hint, sizeof hint, " (did you mean [%s]?)", SECTIONS[best].name);
    return rf_error(RF_ERR_ARG, "%s: unknown section [%s]%s", where, name, hint);
}

/* ------------------------------------------------------------------ loading */

static void remember(rf_recipe *r, int i, int from, int line, int col) {
    r->where_[i].from = (signed char)from;
    r->where_[i].line = line;
    r->where_[i].col = col;
}

static rf_status apply_section(rf_recipe *r, const char *section, const rf_toml *t) {
    char full[512], where[600];
    for (size_t j = 0; j < rf_toml_count(t); j++) {
        const char *name = rf_toml_key(t, j, NULL);
        int line, col;
        rf_toml_key_pos(t, j, &line, &col);
        snprintf(full, sizeof full, "%s.%s", section, name);
        /* a table inside a section: a section of its own ([placement.actor]) */
        if (rf_toml_kind(rf_toml_value(t, j)) == RF_TOML_TABLE && section_known(full)) {
            RF_TRY(apply_section(r, full, rf_toml_value(t, j)));
            continue;
        }
        int i = key_index(full);
        snprintf(where, sizeof where, "%s:%d:%d", r->source, line, col);
        if (i < 0) return unknown_key(where, section, name);
        RF_TRY(set_value(r, &KEYS[i], rf_toml_value(t, j)));
        remember(r, i, 1, line, col);
    }
    return RF_OK;
}

static rf_status apply_file(rf_recipe *r, const rf_toml *doc) {
    char where[600];
    for (size_t j = 0; j < rf_toml_count(doc); j++) {
        const char *name = rf_toml_key(doc, j, NULL);
        const rf_toml *v = rf_toml_value(doc, j);
        int line, col;
        rf_toml_key_pos(doc, j, &line, &col);
        snprintf(where, sizeof where, "%s:%d:%d", r->source, line, col);
        if (rf_toml_kind(v) != RF_TOML_TABLE) return unknown_key(where, "", name);
        if (!section_known(name)) return unknown_section(where, name);
        RF_TRY(apply_section(r, name, v));
    }
    return RF_OK;
}

/* "section.key=value" */
static rf_status apply_override(rf_recipe *r, const char *ov) {
    const char *eq = strchr(ov, '=');
    char key[256];
    if (!eq || eq == ov || (size_t)(eq - ov) >= sizeof key)
        return rf_error(RF_ERR_ARG, "--set %s: expected section.key=value", ov);
    memcpy(key, ov, (size_t)(eq - ov));
    key[eq - ov] = '\0';
    int i = key_index(key);
    if (i < 0) {
        char *dot = strchr(key, '.');
        if (!dot) return unknown_key("--set", "", key);
        *dot = '\0';
        return unknown_key("--set", key, dot + 1);
    }
    rf_toml *doc;
    const rf_toml *v;
    RF_TRY(parse_loose_value(eq + 1, "--set", KEYS[i].type == T_STR, &doc, &v));
    rf_status st = set_value(r, &KEYS[i], v);
    rf_toml_free(doc);
    if (st == RF_OK) remember(r, i, 2, 0, 0);
    return st;
}

static rf_status colocated_rollout_ranks(rf_recipe *r);

/* data.task = "countdown" with reward.rules left at its default: the countdown rule (the
 * default numeric rule would reward the bare target number). */
static rf_status task_default_rules(rf_recipe *r) {
    if (strcmp(r->data.task, "countdown") != 0 || r->where_[key_index("reward.rules")].from != 0)
        return RF_OK;
    rf_str_list *l = &r->reward.rules;
    str_list_free(l);
    if (!(l->v = rf_calloc(1, sizeof *l->v)) || !(l->v[0] = rf_strdup("countdown")))
        return rf_error(RF_ERR_NOMEM, "out of memory");
    l->n = 1;
    return RF_OK;
}

static rf_status load_steps(rf_recipe *r, const char *path, const char *const *ov, int n_ov) {
    if (path) {
        rf_toml *doc;
        RF_TRY(rf_toml_parse_file(&doc, path));
        r->source = rf_strdup(path);
        rf_status st = r->source ? apply_file(r, doc) : RF_ERR_NOMEM;
        rf_toml_free(doc);
        RF_TRY(st);
    }
    for (int i = 0; i < n_ov; i++) RF_TRY(apply_override(r, ov[i]));
    /* placement.rollout.replicas is placement.rollout_ranks by its [placement.rollout] name */
    int rep = key_index("placement.rollout.replicas"), ranks = key_index("placement.rollout_ranks");
    if (r->placement.rollout.replicas > 0) {
        if (r->where_[ranks].from != 0 && r->placement.rollout_ranks != r->placement.rollout.replicas) {
            char w1[600], w2[600];
            return rf_error(RF_ERR_ARG, "%s: placement.rollout.replicas = %d and %s: placement.rollout_ranks = %d "
                            "name the same count (rollout workers) and differ",
                            rf_recipe_where(r, "placement.rollout.replicas", w1, sizeof w1),
                            r->placement.rollout.replicas, rf_recipe_where(r, "placement.rollout_ranks", w2, sizeof w2),
                            r->placement.rollout_ranks);
        }
        r->placement.rollout_ranks = r->placement.rollout.replicas;
        r->where_[ranks] = r->where_[rep];
    }
    if (rf_recipe_colocated_ranks(r)) RF_TRY(colocated_rollout_ranks(r));
    RF_TRY(task_default_rules(r));
    return rf_recipe_validate(r);
}

rf_status rf_recipe_load(rf_recipe *r, const char *path, const char *const *overrides,
                         int n_overrides) {
    RF_TRY(rf_recipe_init(r));
    rf_status st = load_steps(r, path, overrides, n_overrides);
    if (st != RF_OK) rf_recipe_free(r);
    return st;
}

/* ------------------------------------------------------------------ validation */

static rf_status invalid(const rf_recipe *r, const char *key, const char *rule) {
    char where[600];
    int i = key_index(key);
    RF_ASSERT(i >= 0);
    char *val = value_text(r, &KEYS[i]);
    rf_status st = rf_error(RF_ERR_ARG, "%s: %s = %s: %s", rf_recipe_where(r, key, where, sizeof where),
                            key, val ? val : "?", rule);
    free(val);
    return st;
}

static double numeric(const rf_recipe *r, const rkey *k) {
    return k->type == T_INT ? *CFIELD(r, k, int) : *CFIELD(r, k, double);
}

static rf_status check_range(const rf_recipe *r, size_t i) {
    int k = key_index(RANGES[i].key);
    RF_ASSERT(k >= 0 && (KEYS[k].type == T_INT || KEYS[k].type == T_FLOAT));
    double x = numeric(r, &KEYS[k]), lo = RANGES[i].lo, hi = RANGES[i].hi;
    int ok = !isnan(x) && (RANGES[i].lo_open ? x > lo : x >= lo) && (RANGES[i].hi_open ? x < hi : x <= hi);
    if (ok) return RF_OK;
    char rule[96];
    if (isinf(hi)) snprintf(rule, sizeof rule, "must be %s %g", RANGES[i].lo_open ? ">" : ">=", lo);
    else snprintf(rule, sizeof rule, "must be in %c%g, %g%c", RANGES[i].lo_open ? '(' : '[', lo, hi,
                  RANGES[i].hi_open ? ')' : ']');
    return invalid(r, RANGES[i].key, rule);
}

/* [env]: an endpoint or programs exactly with env.type = "external", its CURVE files together,
 * room for a whole turn. */
static rf_status validate_env(const rf_recipe *r) {
    int ext = strcmp(r->env.type, "external") == 0;
    if (!ext && r->env.programs.n > 0)
        return invalid(r, "env.programs", "needs env.type = \"external\" (environment programs answer the episodes)");
    if (ext && !r->env.endpoint[0] && r->env.programs.n == 0)
        return invalid(r, "env.endpoint", "is needed with env.type = \"external\" (or env.programs, which rlflow "
                       "starts on an endpoint of its own)");
    if (!ext && r->env.endpoint[0]) return invalid(r, "env.endpoint", "is set but env.type is not \"external\"");
    if ((r->env.curve_secret[0] != 0) != (r->env.curve_clients[0] != 0))
        return invalid(r, r->env.curve_secret[0] ? "env.curve_secret" : "env.curve_clients",
                       "needs the other CURVE file too (env.curve_secret and env.curve_clients)");
    if (ext && r->env.endpoint[0] && !r->env.curve_secret[0] && !r->env.insecure &&
        !rf_curve_endpoint_is_local(r->env.endpoint))
        return invalid(r, "env.endpoint", "can be reached from other machines, and without CURVE anyone who "
                       "reaches it can send the observations and rewards that train the policy: set "
                       "env.curve_secret and env.curve_clients, bind a loopback address, or set env.insecure = "
                       "true on a network you trust");
    if (!r->env.type[0]) return RF_OK;
    if (r->env.max_total_tokens < r->rollout.max_new_tokens)
        return invalid(r, "env.max_total_tokens", "must be >= rollout.max_new_tokens (a turn's limit)");
    return RF_OK;
}

/* reward.external's security: CURVE takes both files; an endpoint other machines can reach
 * takes CURVE or an explicit external_insecure (reward/external.c checks the same at bind). */
static rf_status validate_external(const rf_recipe *r) {
    int secret = r->reward.external_curve_secret[0] != '\0';
    int clients = r->reward.external_curve_clients[0] != '\0';
    if (secret && !clients)
        return invalid(r, "reward.external_curve_secret", "needs reward.external_curve_clients "
                       "too (the public keys of the reward programs allowed to connect)");
    if (clients && !secret)
        return invalid(r, "reward.external_curve_clients", "needs reward.external_curve_secret "
                       "too (rlflow's secret key; rlflow keygen --out PREFIX writes one)");
    const char *ep = r->reward.external;
    if (ep[0] && !secret && !r->reward.external_insecure && !rf_curve_endpoint_is_local(ep))
        return invalid(r, "reward.external", "can be reached from other machines, and without "
                       "CURVE anyone who reaches it can send the rewards that train the policy: "
                       "set reward.external_curve_secret and reward.external_curve_clients "
                       "(docs/reward-api.md, \"CURVE\"), bind a loopback address, or set "
                       "reward.external_insecure = true on a network you trust");
    return RF_OK;
}

/* A correctness rule must be able to check the built-in task's answers. */
static rf_status validate_task_rules(const rf_recipe *r) {
    int countdown = strcmp(r->data.task, "countdown") == 0, arith = strcmp(r->data.task, "arith") == 0;
    for (int i = 0; i < r->reward.rules.n; i++) {
        const char *rule = r->reward.rules.v[i], *why = NULL;
        if (countdown && (!strcmp(rule, "numeric") || !strcmp(rule, "math") || !strcmp(rule, "exact")))
            why = "it would reward the bare target number, not an expression that reaches it; use "
                  "\"countdown\" (or leave reward.rules unset)";
        else if (arith && !strcmp(rule, "countdown"))
            why = "arith answers are numbers, not \"NUMBERS -> TARGET\"; use \"numeric\"";
        if (!why) continue;
        char where[600], rule_text[1024];
        snprintf(rule_text, sizeof rule_text, "\"%s\" cannot check data.task = \"%s\" (%s): %s", rule,
                 r->data.task, rf_recipe_where(r, "data.task", where, sizeof where), why);
        return invalid(r, "reward.rules", rule_text);
    }
    return RF_OK;
}

/* reward.rules = []: the reward comes from elsewhere (a program, a reward model) or there is none. */
static rf_status validate_reward_sources(const rf_recipe *r) {
    if (r->reward.rules.n > 0 || r->reward.programs.n > 0 || r->reward.external[0] || r->reward.model[0])
        return RF_OK;
    return invalid(r, "reward.rules", "no reward at all: an empty list needs reward.programs, reward.external or "
                   "reward.model to give the rewards");
}

/* reward.answer_regex must compile (reward/rules.c compiles it the same way at run start). */
static rf_status validate_answer_regex(const rf_recipe *r) {
    if (!r->reward.answer_regex[0]) return RF_OK;
    rf_status s = rf_reward_regex_check("reward.answer_regex", r->reward.answer_regex);
    if (s == RF_OK) return RF_OK;
    char where[600];
    return rf_error_wrap(s, "%s", rf_recipe_where(r, "reward.answer_regex", where, sizeof where));
}

/* rollout.stop fits the RF_MAX_STOP stop strings a request holds, with the calculator's own
 * "</calc>" (added unless listed): a string past them would be dropped, not honoured. */
static rf_status validate_stop(const rf_recipe *r) {
    int calc = strcmp(r->env.type, "calculator") == 0, listed = 0;
    for (int i = 0; i < r->rollout.stop.n; i++) listed |= strcmp(r->rollout.stop.v[i], RF_CALC_STOP) == 0;
    int room = RF_MAX_STOP - (calc && !listed);
    if (r->rollout.stop.n <= room) return RF_OK;
    char why[160];
    snprintf(why, sizeof why, "holds %d strings, at most %d fit%s", r->rollout.stop.n, room,
             room < RF_MAX_STOP ? " (env.type = \"calculator\" adds \"" RF_CALC_STOP "\")" : "");
    return invalid(r, "rollout.stop", why);
}

/* LoRA's limits: what [lora] does not support is refused naming the key, never ignored. */
static rf_status validate_lora(const rf_recipe *r) {
    if (!r->lora.enabled) return RF_OK;
    if (r->lora.targets.n == 0)
        return invalid(r, "lora.targets", "names no projection (some of \"q\", \"k\", \"v\", \"o\", "
                       "\"gate\", \"up\", \"down\")");
    for (int i = 0; i < r->lora.targets.n; i++)
        for (int j = 0; j < i; j++)
            if (strcmp(r->lora.targets.v[i], r->lora.targets.v[j]) == 0) {
                char why[64];
                snprintf(why, sizeof why, "names \"%s\" twice", r->lora.targets.v[i]);
                return invalid(r, "lora.targets", why);
            }
    if (r->lora.dropout != 0)
        return rf_recipe_reject_unimplemented(r, "lora.dropout", "dropout on the adapter input; set it to 0");
    /* implemented everywhere: one process, colocated on several processes (the rollout ranks
     * bind the adapters over the training weights read in place, or receive them alone) and
     * split runs (the adapters alone sent to rollout workers, whole or tensor parallel) */
    /* the reference is the actor's frozen base itself, so it is split as the actor is */
    int dp, tp;
    rf_recipe_role_layout(r, RF_ROLE_REFERENCE, &dp, &tp);
    if (rf_recipe_reference_enabled(r) && !r->reference.path[0] && tp != r->placement.actor.tp) {
        char why[256];
        snprintf(why, sizeof why, "with lora.enabled = true and no reference.path: the reference is the actor's frozen "
                 "base, split as the actor is (placement.actor.tp = %d); leave it at 0 or set reference.path",
                 r->placement.actor.tp);
        return rf_recipe_reject_unimplemented(r, "placement.reference.tp", why);
    }
    return RF_OK;
}

rf_status rf_recipe_validate(const rf_recipe *r) {
    for (size_t i = 0; i < sizeof RANGES / sizeof RANGES[0]; i++) RF_TRY(check_range(r, i));
    if (r->algorithm.dual_clip != 0 && r->algorithm.dual_clip <= 1)
        return invalid(r, "algorithm.dual_clip", "must be 0 (off) or > 1");
    if (r->data.task_min_digits > r->data.task_max_digits)
        return invalid(r, "data.task_min_digits", "must be <= data.task_max_digits");
    if (r->reward.weights.n != 0 && r->reward.weights.n != r->reward.rules.n)
        return invalid(r, "reward.weights", "needs one weight per rule in reward.rules (or none)");
    RF_TRY(validate_task_rules(r));
    RF_TRY(validate_reward_sources(r));
    RF_TRY(validate_answer_regex(r));
    if (r->algorithm.rollout_is_low >= r->algorithm.rollout_is_high)
        return invalid(r, "algorithm.rollout_is_low", "must be below algorithm.rollout_is_high");
    if (r->placement.actor.zero == 1 && r->placement.actor.dp == 1)
        return invalid(r, "placement.actor.zero", "shards the optimizer state across data-parallel "
                       "ranks and needs placement.actor.dp > 1 (with one rank it holds all of it)");
    RF_TRY(validate_lora(r));
    RF_TRY(validate_stop(r));
    RF_TRY(validate_env(r));
    return validate_external(r);
}

void rf_recipe_role_layout(const rf_recipe *r, int role, int *dp, int *tp) {
    int d = role == RF_ROLE_REWARD ? r->placement.reward.dp : role == RF_ROLE_CRITIC ? r->placement.critic.dp
                                                                                     : r->placement.reference.dp;
    int t = role == RF_ROLE_REWARD ? r->placement.reward.tp : role == RF_ROLE_CRITIC ? r->placement.critic.tp
                                                                                     : r->placement.reference.tp;
    *dp = d > 0 ? d : r->placement.actor.dp;
    *tp = t > 0 ? t : r->placement.actor.tp;
}

const char *rf_recipe_role_name(int role) {
    static const char *const names[3] = {"reference", "critic", "reward model"};
    return role >= 0 && role < 3 ? names[role] : "?";
}

int rf_recipe_colocated_ranks(const rf_recipe *r) {
    return strcmp(r->placement.mode, "colocated") == 0 &&
           (r->placement.actor.dp * r->placement.actor.tp > 1 || r->placement.rollout.tp > 1);
}

int rf_recipe_multi_process(const rf_recipe *r) {
    return strcmp(r->placement.mode, "split") == 0 || rf_recipe_colocated_ranks(r);
}

int rf_recipe_free_kv_cache(const rf_recipe *r) {
    if (strcmp(r->rollout.free_kv_cache, "auto") == 0)
        return strcmp(r->placement.mode, "colocated") == 0 && strcmp(r->model.device, "cuda") == 0;
    return strcmp(r->rollout.free_kv_cache, "on") == 0;
}

/* A colocated run on several ranks: one rollout rank on each training rank's device, so
 * placement.rollout_ranks = training ranks / placement.rollout.tp. */
static rf_status colocated_rollout_ranks(rf_recipe *r) {
    int n_train = r->placement.actor.dp * r->placement.actor.tp, gtp = r->placement.rollout.tp;
    int ranks = key_index("placement.rollout_ranks");
    char where[600];
    if (gtp < 1 || n_train % gtp != 0)
        return rf_error(RF_ERR_ARG, "%s: placement.rollout.tp = %d does not divide the %d training ranks "
                        "(placement.actor.dp x placement.actor.tp) of a colocated run, whose rollout ranks are on "
                        "their devices", rf_recipe_where(r, "placement.rollout.tp", where, sizeof where), gtp, n_train);
    if (r->where_[ranks].from != 0 && r->placement.rollout_ranks != n_train / gtp)
        return rf_error(RF_ERR_ARG, "%s: placement.rollout_ranks = %d, but a colocated run has one rollout rank on each "
                        "of its %d training ranks' devices: %d rollout workers of placement.rollout.tp = %d ranks (leave "
                        "it unset)", rf_recipe_where(r, "placement.rollout_ranks", where, sizeof where),
                        r->placement.rollout_ranks, n_train, n_train / gtp, gtp);
    r->placement.rollout_ranks = n_train / gtp;
    return RF_OK;
}

int rf_recipe_reference_enabled(const rf_recipe *r) {
    if (strcmp(r->reference.enabled, "auto") == 0) return r->algorithm.kl_coef > 0;
    return strcmp(r->reference.enabled, "true") == 0;
}

rf_status rf_recipe_reject_unimplemented(const rf_recipe *r, const char *key, const char *why) {
    int i = key_index(key);
    if (i < 0) return rf_error(RF_ERR_ARG, "rf_recipe_reject_unimplemented: no key \"%s\"", key);
    char where[600];
    char *val = value_text(r, &KEYS[i]);
    rf_status st = rf_error(RF_ERR_UNSUPPORTED, "%s: %s = %s is not implemented yet (%s)",
                            rf_recipe_where(r, key, where, sizeof where), key, val ? val : "?", why);
    free(val);
    return st;
}

/* ------------------------------------------------------------------ dump and docs */

rf_status rf_recipe_dump(const rf_recipe *r, FILE *f) {
    fprintf(f, "# rlflow recipe: the effective values of every key (docs/recipes.md)\n");
    if (r->source) fprintf(f, "# read from %s\n", r->source);
    for (size_t s = 0; s < N_SECTIONS; s++) {
        fprintf(f, "\n[%s]\n", SECTIONS[s].name);
        for (int i = 0; i < N_KEYS; i++) {
            if (strcmp(KEYS[i].section, SECTIONS[s].name) != 0) continue;
            fprintf(f, "%s = ", KEYS[i].name);
            put_value(f, r, &KEYS[i]);
            fputc('\n', f);
        }
    }
    if (ferror(f)) return rf_error(RF_ERR_IO, "writing the recipe failed");
    return RF_OK;
}

static void doc_type(FILE *f, const rkey *k) {
    static const char *const names[] = {"string", "integer", "float", "boolean", "enum",
                                        "string array", "float array", "array of string arrays"};
    fputs(names[k->type], f);
    if (!k->allowed) return;
    fputs(k->type == T_ENUM ? ": " : " of: ", f);
    for (int i = 0; k->allowed[i]; i++)
        fprintf(f, "%s`%s`", i ? ", " : "", k->allowed[i][0] ? k->allowed[i] : "\"\"");
}

void rf_recipe_doc_markdown(FILE *f) {
    fputs("# Recipe reference\n\n"
          "<!-- Generated from the schema in controller/recipe.c by rf_recipe_doc_markdown;\n"
          "     tests/test_recipe.c fails when this file is stale. Regenerate with\n"
          "     `build/test_recipe --write-doc docs/recipes.md`. -->\n\n"
          "A recipe is a TOML 1.0 file (`rlflow run recipe.toml`). Every key is optional; a key\n"
          "left out keeps the default below. `--set section.key=value` overrides a key after the\n"
          "file is read; the value is read as TOML, and text that is not a TOML value is taken as\n"
          "a string (`--set model.path=models/x`), as is any value given to a string key\n"
          "(`--set logging.dir=2024`). Unknown keys, wrong types, values outside an\n"
          "enum and impossible values are errors that name the file, line and column.\n"
          "Integers are accepted where a float is expected. The effective recipe can be written\n"
          "back as TOML (`rf_recipe_dump`, every key) and loads back to the same values.\n\n"
          "Debian packages no C TOML library, so rlflow has its own parser (`common/toml.c`);\n"
          "it implements all of TOML 1.0.0 and passes every 1.0.0 case of the toml-test suite.\n",
          f);
    for (size_t s = 0; s < N_SECTIONS; s++) {
        fprintf(f, "\n## [%s]\n\n%s\n\n| key | type | default | meaning |\n|---|---|---|---|\n",
                SECTIONS[s].name, SECTIONS[s].doc);
        for (int i = 0; i < N_KEYS; i++) {
            if (strcmp(KEYS[i].section, SECTIONS[s].name) != 0) continue;
            fprintf(f, "| `%s` | ", KEYS[i].name);
            doc_type(f, &KEYS[i]);
            fprintf(f, " | `%s` | %s |\n", KEYS[i].def, KEYS[i].doc);
        }
    }
}
