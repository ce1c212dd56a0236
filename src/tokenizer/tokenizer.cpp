#include "tokenizer/tokenizer.h"

#include "core/error.h"
#include "tokenizer/utf8.h"

#include <algorithm>
#include <limits>
#include <functional>

namespace perigee::tok {

namespace {

constexpr uint32_t k_no_rank = std::numeric_limits<uint32_t>::max();

// Python str.isspace(): White_Space plus bidi B/S/WS plus Zs — notably U+001C..U+001F (§4.4).
bool py_isspace(uint32_t c) {
    if (c <= 0x20) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    if (c < 0x85) return false;
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

} // namespace

tokenizer::tokenizer(rank_file ranks, std::vector<special_token> specials, std::string_view pat_str,
                     tokenizer_options opt)
    : ranks_(std::move(ranks)), specials_(std::move(specials)), opt_(opt), pre_(pat_str) {
    const token_id n = n_ranks();
    rank_map_.reserve(ranks_.tokens.size() * 2);
    for (size_t r = 0; r < ranks_.tokens.size(); ++r) rank_map_.emplace(ranks_.tokens[r], static_cast<uint32_t>(r));
    PG_CHECK(rank_map_.size() == ranks_.tokens.size(), "{}: duplicate tokens", ranks_.source);
    token_id max_id = n - 1;
    for (const auto & s : specials_) {
        PG_CHECK(!s.name.empty(), "special token with id {} has an empty name", s.id);
        PG_CHECK(s.id >= n, "special token '{}' has id {} inside the rank range 0..{}", s.name, s.id, n - 1);
        max_id = std::max(max_id, s.id);
    }
    const size_t n_special_slots = static_cast<size_t>(max_id + 1 - n);
    id_bytes_special_.assign(n_special_slots, std::string());
    hf_special_.assign(n_special_slots, 0);
    trie_.emplace_back();
    for (const auto & s : specials_) {
        auto & slot = id_bytes_special_[s.id - n];
        PG_CHECK(slot.empty(), "special id {} is given twice ('{}' and '{}')", s.id, slot, s.name);
        slot = s.name;
        hf_special_[s.id - n] = s.hf_special;
    }
    for (const auto & s : specials_) {
        const auto [it, ok] = special_by_name_.emplace(id_bytes_special_[s.id - n], s.id);
        PG_CHECK(ok, "special token name '{}' is given twice (ids {} and {})", s.name, it->second, s.id);
        int32_t node = 0;
        for (char ch : s.name) {
            const uint8_t b = static_cast<uint8_t>(ch);
            int32_t nx = -1;
            for (auto & [k, v] : trie_[node].next) {
                if (k == b) { nx = v; break; }
            }
            if (nx < 0) {
                nx = static_cast<int32_t>(trie_.size());
                trie_[node].next.emplace_back(b, nx);
                trie_.emplace_back();
            }
            node = nx;
        }
        trie_[node].id = s.id;
        first_byte_[static_cast<uint8_t>(s.name[0])] = true;
    }
    id_bytes_.resize(static_cast<size_t>(max_id) + 1);
    for (token_id i = 0; i < n; ++i) id_bytes_[i] = &ranks_.tokens[i];
    for (size_t k = 0; k < n_special_slots; ++k) id_bytes_[n + k] = &id_bytes_special_[k];
}

std::optional<uint32_t> tokenizer::rank_of(std::string_view bytes) const {
    const auto it = rank_map_.find(bytes);
    if (it == rank_map_.end()) return std::nullopt;
    return it->second;
}

void tokenizer::bpe_piece(std::string_view piece, std::vector<token_id> & out, bool force_heap) const {
    if (piece.empty()) return;
    if (auto r = rank_of(piece)) {  // whole-piece lookup first (tiktoken behaviour)
        out.push_back(static_cast<token_id>(*r));
        return;
    }
    const auto rank_or_none = [&](size_t a, size_t b) {
        const auto it = rank_map_.find(piece.substr(a, b - a));
        return it == rank_map_.end() ? k_no_rank : it->second;
    };
    const size_t n = piece.size();
    if (!force_heap && n < 128) {
        // tiktoken's vector form: parts[i] = (start, rank of merging part i with part i+1).
        struct part { uint32_t start; uint32_t rank; };
        std::vector<part> parts(n + 1);
        for (size_t i = 0; i <= n; ++i) parts[i] = {static_cast<uint32_t>(i), k_no_rank};
        for (size_t i = 0; i + 1 < n; ++i) parts[i].rank = rank_or_none(i, i + 2);
        const auto get_rank = [&](size_t i) {
            return i + 3 < parts.size() ? rank_or_none(parts[i].start, parts[i + 3].start) : k_no_rank;
        };
        while (parts.size() > 1) {
            uint32_t best = k_no_rank;
            size_t bi = 0;
            for (size_t i = 0; i + 1 < parts.size(); ++i) {
                if (parts[i].rank < best) { best = parts[i].rank; bi = i; }
            }
            if (best == k_no_rank) break;
            if (bi > 0) parts[bi - 1].rank = get_rank(bi - 1);
            parts[bi].rank = get_rank(bi);
            parts.erase(parts.begin() + static_cast<ptrdiff_t>(bi) + 1);
        }
        for (size_t i = 0; i + 1 < parts.size(); ++i) {
            const uint32_t r = rank_or_none(parts[i].start, parts[i + 1].start);
            PG_ASSERT(r != k_no_rank);
            out.push_back(static_cast<token_id>(r));
        }
        return;
    }
    // Heap form for long pieces: doubly linked parts and a min-heap of packed (rank << 32 | start)
    // keys with lazy invalidation: an entry is live iff its part is alive and still has that pair
    // rank (a part's pair rank never returns to an old value: the part only grows). Same choice
    // rule as above: lowest rank, leftmost on ties.
    std::vector<uint32_t> next(n), prev(n), pair_rank(n, k_no_rank);
    std::vector<uint8_t> alive(n, 1);
    for (size_t i = 0; i < n; ++i) {
        next[i] = static_cast<uint32_t>(i + 1);  // n = end; a part starts at its own index
        prev[i] = static_cast<uint32_t>(i == 0 ? k_no_rank : i - 1);
    }
    std::vector<uint64_t> heap;
    heap.reserve(2 * n);
    const auto push = [&](uint32_t rank, uint32_t pos) {
        heap.push_back((uint64_t(rank) << 32) | pos);
        std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    };
    const auto end_of = [&](uint32_t i) { return next[i]; };
    const auto pair_at = [&](uint32_t i) -> uint32_t {
        if (next[i] >= n) return k_no_rank;
        return rank_or_none(i, end_of(next[i]));
    };
    for (uint32_t i = 0; i + 1 < n; ++i) {
        pair_rank[i] = pair_at(i);
        if (pair_rank[i] != k_no_rank) heap.push_back((uint64_t(pair_rank[i]) << 32) | i);
    }
    std::make_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
        const uint64_t e = heap.back();
        heap.pop_back();
        const uint32_t i = static_cast<uint32_t>(e & 0xFFFFFFFFu), rank = static_cast<uint32_t>(e >> 32);
        if (!alive[i] || pair_rank[i] != rank) continue;
        const uint32_t j = next[i];
        alive[j] = 0;  // merge j into i
        next[i] = next[j];
        if (next[j] < n) prev[next[j]] = i;
        pair_rank[i] = pair_at(i);
        if (pair_rank[i] != k_no_rank) push(pair_rank[i], i);
        if (prev[i] != k_no_rank) {
            const uint32_t p = prev[i];
            pair_rank[p] = pair_at(p);
            if (pair_rank[p] != k_no_rank) push(pair_rank[p], p);
        }
    }
    for (uint32_t i = 0; i < n; i = next[i]) {
        const uint32_t r = rank_or_none(i, end_of(i));
        PG_ASSERT(r != k_no_rank);
        out.push_back(static_cast<token_id>(r));
    }
}

void tokenizer::encode_plain(std::string_view text, std::vector<token_id> & out) const {
    pre_.split(text, [&](std::string_view piece) { bpe_piece(piece, out); });
}

// Kimi's outer chunking (TOKENIZER §4.4): windows of max_encode_chars code points, each cut so
// that no run of isspace / non-isspace code points exceeds max_run_chars. fn(slice) per slice.
template <typename F>
void tokenizer::for_each_chunk(std::string_view text, F && fn) const {
    if (opt_.max_encode_chars == 0 && opt_.max_run_chars == 0) {
        fn(text);
        return;
    }
    size_t i = 0;
    while (i < text.size() || (i == 0 && text.empty())) {
        // one window
        size_t w_end = i, count = 0;
        while (w_end < text.size() && (opt_.max_encode_chars == 0 || count < opt_.max_encode_chars)) {
            w_end += utf8_seq_len(text, w_end);
            ++count;
        }
        const std::string_view window = text.substr(i, w_end - i);
        if (opt_.max_run_chars == 0 || window.empty()) {
            fn(window);
        } else {
            size_t slice_start = 0, run = 0, k = 0;
            bool run_is_space = false;
            while (k < window.size()) {
                const size_t len = utf8_seq_len(window, k);
                const bool sp = py_isspace(utf8_decode_at(window, k, len));
                if (k == 0) {
                    run_is_space = sp;
                    run = 1;
                } else if (sp != run_is_space) {
                    run_is_space = sp;
                    run = 1;
                } else if (++run > opt_.max_run_chars) {
                    fn(window.substr(slice_start, k - slice_start));
                    slice_start = k;
                    run = 1;
                }
                k += len;
            }
            fn(window.substr(slice_start));
        }
        if (text.empty()) break;
        i = w_end;
    }
}

void tokenizer::encode_chunk(std::string_view chunk, std::span<const token_id> allowed,
                             std::vector<token_id> & out) const {
    if (allowed.empty() || specials_.empty()) {
        encode_plain(chunk, out);
        return;
    }
    const auto is_allowed = [&](token_id id) { return std::find(allowed.begin(), allowed.end(), id) != allowed.end(); };
    size_t seg_start = 0, pos = 0;
    while (pos < chunk.size()) {
        if (!first_byte_[static_cast<uint8_t>(chunk[pos])]) { ++pos; continue; }
        // longest allowed special name starting at pos
        int32_t node = 0;
        token_id found = -1;
        size_t found_len = 0;
        for (size_t k = pos; k < chunk.size(); ++k) {
            const uint8_t b = static_cast<uint8_t>(chunk[k]);
            int32_t nx = -1;
            for (const auto & [key, v] : trie_[node].next) {
                if (key == b) { nx = v; break; }
            }
            if (nx < 0) break;
            node = nx;
            if (trie_[node].id >= 0 && is_allowed(trie_[node].id)) {
                found = trie_[node].id;
                found_len = k + 1 - pos;
            }
        }
        if (found < 0) { ++pos; continue; }
        encode_plain(chunk.substr(seg_start, pos - seg_start), out);
        out.push_back(found);
        pos += found_len;
        seg_start = pos;
    }
    encode_plain(chunk.substr(seg_start), out);
}

void tokenizer::encode_append(std::string_view text, std::span<const token_id> allowed,
                              std::vector<token_id> & out) const {
    size_t bad = 0;
    PG_CHECK(utf8_valid(text, &bad), "tokenizer: input is not valid UTF-8 (byte offset {})", bad);
    for_each_chunk(text, [&](std::string_view chunk) { encode_chunk(chunk, allowed, out); });
}

void tokenizer::encode_ordinary_append(std::string_view text, std::vector<token_id> & out) const {
    encode_append(text, {}, out);
}

std::vector<token_id> tokenizer::encode_ordinary(std::string_view text) const {
    std::vector<token_id> out;
    encode_append(text, {}, out);
    return out;
}

std::vector<token_id> tokenizer::encode(std::string_view text, std::span<const token_id> allowed) const {
    std::vector<token_id> out;
    encode_append(text, allowed, out);
    return out;
}

std::vector<std::string> tokenizer::pieces(std::string_view text) const {
    size_t bad = 0;
    PG_CHECK(utf8_valid(text, &bad), "tokenizer: input is not valid UTF-8 (byte offset {})", bad);
    std::vector<std::string> out;
    for_each_chunk(text, [&](std::string_view chunk) {
        pre_.split(chunk, [&](std::string_view p) { out.emplace_back(p); });
    });
    return out;
}

const std::string & tokenizer::token_bytes(token_id id) const {
    PG_CHECK(id >= 0 && static_cast<size_t>(id) < id_bytes_.size(), "token id {} out of range [0, {})", id,
             id_bytes_.size());
    const std::string & b = *id_bytes_[id];
    PG_CHECK(!b.empty(), "token id {} is an unassigned special slot", id);
    return b;
}

bool tokenizer::is_hf_special(token_id id) const {
    return is_special(id) && hf_special_[id - n_ranks()];
}

std::string tokenizer::decode(std::span<const token_id> ids, bool skip_special) const {
    std::string out;
    for (token_id id : ids) {
        const std::string & b = token_bytes(id);
        if (skip_special && is_hf_special(id)) continue;
        out += b;
    }
    return out;
}

std::optional<token_id> tokenizer::special_id(std::string_view name) const {
    const auto it = special_by_name_.find(name);
    if (it == special_by_name_.end()) return std::nullopt;
    return it->second;
}

std::vector<token_id> tokenizer::all_special_ids() const {
    std::vector<token_id> ids;
    for (const auto & s : specials_) ids.push_back(s.id);
    return ids;
}

} // namespace perigee::tok
