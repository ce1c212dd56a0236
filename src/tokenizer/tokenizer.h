// Byte-level BPE tokenizer with tiktoken's exact semantics (TOKENIZER §4): regex pre-tokenizer,
// whole-piece lookup first, then lowest-rank (leftmost on ties) merges; special tokens only
// through an explicit allowed set; optional outer chunking (§4.4); decode to bytes.
// Model-agnostic: ranks, specials, pattern and chunking come from the caller (see tiktoken_dir.h).
#pragma once
#include "tokenizer/pretokenizer.h"
#include "tokenizer/ranks.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace perigee::tok {

using token_id = int32_t;

struct special_token {
    std::string name;          // exact text, e.g. "<|open|>"
    token_id id = 0;           // must be >= number of ranks
    bool hf_special = true;    // tokenizer_config "special" flag: only for decode(skip_special=true)
};

struct tokenizer_options {
    // Kimi's outer chunking (TOKENIZER §4.4); 0 disables a stage. Kimi: 400000 / 25000.
    size_t max_encode_chars = 0;  // windows of this many code points
    size_t max_run_chars = 0;     // longest run of isspace / non-isspace code points per slice
};

class tokenizer {
public:
    tokenizer(rank_file ranks, std::vector<special_token> specials, std::string_view pat_str,
              tokenizer_options opt = {});
    tokenizer(const tokenizer &) = delete;
    tokenizer & operator=(const tokenizer &) = delete;

    // Ordinary text: special names are never recognised (they encode as text). Throws on invalid
    // UTF-8 (naming the byte offset).
    std::vector<token_id> encode_ordinary(std::string_view text) const;
    // Recognises exactly the special tokens in `allowed` (ids); other special names are text.
    std::vector<token_id> encode(std::string_view text, std::span<const token_id> allowed) const;
    // Appending forms (no allocation of a result vector per call).
    void encode_ordinary_append(std::string_view text, std::vector<token_id> & out) const;
    void encode_append(std::string_view text, std::span<const token_id> allowed, std::vector<token_id> & out) const;

    // The pre-tokenizer pieces of `text` after the outer chunking (no special handling).
    std::vector<std::string> pieces(std::string_view text) const;

    // Concatenated bytes of the ids (special ids give their names). Out-of-range ids throw.
    // skip_special drops specials whose hf_special flag is set.
    std::string decode(std::span<const token_id> ids, bool skip_special = false) const;
    const std::string & token_bytes(token_id id) const;

    std::optional<token_id> special_id(std::string_view name) const;
    bool is_special(token_id id) const { return id >= n_ranks() && id < static_cast<token_id>(n_vocab()); }
    bool is_hf_special(token_id id) const;
    const std::vector<special_token> & specials() const { return specials_; }
    std::vector<token_id> all_special_ids() const;

    token_id n_ranks() const { return static_cast<token_id>(ranks_.tokens.size()); }
    size_t n_vocab() const { return id_bytes_.size(); }  // ranks + specials (+ unnamed gaps)
    const rank_file & ranks() const { return ranks_; }
    const pretokenizer & pre() const { return pre_; }
    const tokenizer_options & options() const { return opt_; }

    // BPE of one piece (exposed for tests). force_heap selects the O(n log n) merge used for long
    // pieces; both must give identical output.
    void bpe_piece(std::string_view piece, std::vector<token_id> & out, bool force_heap = false) const;

private:
    void encode_chunk(std::string_view chunk, std::span<const token_id> allowed, std::vector<token_id> & out) const;
    void encode_plain(std::string_view text, std::vector<token_id> & out) const;
    template <typename F> void for_each_chunk(std::string_view text, F && fn) const;
    std::optional<uint32_t> rank_of(std::string_view bytes) const;

    rank_file ranks_;
    std::vector<special_token> specials_;
    tokenizer_options opt_;
    pretokenizer pre_;
    std::unordered_map<std::string_view, uint32_t> rank_map_;
    std::vector<std::string> id_bytes_special_;  // id - n_ranks -> bytes ("" for unnamed)
    std::vector<const std::string *> id_bytes_;  // id -> bytes
    std::vector<uint8_t> hf_special_;            // id - n_ranks -> flag
    std::unordered_map<std::string_view, token_id> special_by_name_;
    // byte trie of the special names, for the scan in encode()
    struct trie_node { std::vector<std::pair<uint8_t, int32_t>> next; token_id id = -1; };
    std::vector<trie_node> trie_;
    bool first_byte_[256] = {};
};

} // namespace perigee::tok
