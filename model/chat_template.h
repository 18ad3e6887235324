/* Built-in chat templates: render a conversation into the prompt text a chat model was
 * tuned on. rlflow does not run the Jinja templates shipped in tokenizer_config.json; it
 * carries the few formats current models use, written out in C and checked against the
 * HF renderings in tests/test_tokenizer.c. */
#ifndef RF_CHAT_TEMPLATE_H
#define RF_CHAT_TEMPLATE_H

#include "common/status.h"

typedef struct rf_chat_message {
    const char *role;       /* "system", "user", "assistant", ... */
    const char *content;    /* UTF-8 */
} rf_chat_message;

/* Renders msgs[0..n) with a built-in template:
 *  "chatml": plain ChatML, "<|im_start|>{role}\n{content}<|im_end|>\n" per message;
 *            the generation prompt is "<|im_start|>assistant\n". No default system message
 *            is added: Qwen2.5's own template inserts "You are Qwen, created by Alibaba
 *            Cloud. You are a helpful assistant." when none is given, so callers that want
 *            Qwen2.5's exact prompt pass that system message themselves.
 *  "llama3": Llama-3-Instruct: "<|begin_of_text|>" once, then per message
 *            "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>" with
 *            content trimmed of surrounding whitespace (the HF template's `| trim`); the
 *            generation prompt is "<|start_header_id|>assistant<|end_header_id|>\n\n".
 * The llama3 text already holds BOS: encode it with add_special = 0.
 * *out is malloc'd and NUL-terminated; the caller frees it.
 * Errors: RF_ERR_ARG for an unknown template (the message lists the valid names) or a
 * message with a NULL role or content. */
rf_status rf_chat_apply(const char *template_name, const rf_chat_message *msgs, int n,
                        int add_generation_prompt, char **out);

#endif
