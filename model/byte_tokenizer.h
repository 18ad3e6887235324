/* Writes a byte-level BPE tokenizer.json with no merges (every byte is a token) plus the
 * ChatML special tokens, for random-init models (`rlflow init-model`). The file follows the
 * Hugging Face tokenizers format exactly, so transformers' AutoTokenizer loads it. */
#ifndef RF_BYTE_TOKENIZER_H
#define RF_BYTE_TOKENIZER_H

#include "common/status.h"

#define RF_BYTE_TOKENIZER_VOCAB 259 /* 256 bytes + <|endoftext|>, <|im_start|>, <|im_end|> */
#define RF_BYTE_TOKENIZER_EOS 256

/* Writes dir/tokenizer.json and dir/tokenizer_config.json. */
rf_status rf_byte_tokenizer_write(const char *dir);

#endif
