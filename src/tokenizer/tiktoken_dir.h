// Loads a tokenizer directory in the layout of Kimi checkpoints: `tiktoken.model` (rank file) and
// `tokenizer_config.json` (class + `added_tokens_decoder`). Special ids follow TOKENIZER §2.2:
// the 256 ids after the last rank are all special; each takes its name from
// `added_tokens_decoder[id].content`, else `<|reserved_token_{id}|>`. Names are never invented
// outside that range (an entry outside it is an error).
#pragma once
#include "tokenizer/tokenizer.h"

#include <memory>
#include <string>

namespace perigee::tok {

struct tiktoken_dir_info {
    std::string dir;
    std::string model_path;      // .../tiktoken.model
    std::string config_path;     // .../tokenizer_config.json
    std::string model_sha256;
    size_t model_bytes = 0;
    size_t n_ranks = 0;
    size_t n_vocab = 0;          // n_ranks + 256
    std::string tokenizer_class; // tokenizer_config.json "tokenizer_class"
    std::string bos_token, eos_token;  // names from the config ("" if absent)
};

struct tiktoken_dir {
    std::unique_ptr<tokenizer> tok;
    tiktoken_dir_info info;
};

constexpr size_t k_num_reserved_special = 256;

// Reads DIR/tiktoken.model and DIR/tokenizer_config.json. Errors name the file and key.
tiktoken_dir load_tiktoken_dir(const std::string & dir);

} // namespace perigee::tok
