// Strict loader for tiktoken rank files (`tiktoken.model`, `*.tiktoken`): one
// `<base64 of the token bytes><SPACE><decimal rank>` per line; the rank is both the merge
// priority and the token id (TOKENIZER §2.1). Any malformed line, duplicate rank, duplicate token,
// gap in the ranks or missing single byte is an error that names the file and the line.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace perigee::tok {

struct rank_file {
    std::vector<std::string> tokens;  // rank -> token bytes; ranks are 0..tokens.size()-1
    std::string sha256;               // hex digest of the file bytes
    size_t file_bytes = 0;
    std::string source;               // path or name, for messages
};

// Parses rank-file text; `source` names it in error messages.
rank_file parse_tiktoken_ranks(std::string_view text, const std::string & source);

// Reads and parses a rank file from disk.
rank_file load_tiktoken_ranks(const std::string & path);

// Reads a whole file into a string (error names the path).
std::string read_file_bytes(const std::string & path);

} // namespace perigee::tok
