// Python `json.dumps(..., ensure_ascii=False)` emulation over nlohmann::ordered_json, which the
// Kimi chat encoders use (TOKENIZER §7.7): compact (",", ":") or default (", ", ": ") separators,
// escapes only `" \ \n \r \t \b \f` and other C0 controls (\u00XX lower-case), key order kept.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace perigee::chat {

using json = nlohmann::ordered_json;

std::string py_json_dumps(const json & v, bool compact);

// Recursively sorts object keys in code-point order (Python sort_keys / the tokenizer classes'
// deep sort); list order is kept.
json deep_sorted(const json & v);

// Python `str.strip()` emptiness: true if s is empty or only Unicode whitespace.
bool py_is_blank(const std::string & s);

} // namespace perigee::chat
