// A sequence: one request's tokens and where its state lives (nano-vllm's sequence.py).
//
// Lifecycle: WAITING -> PREFILL -> DECODE -> FINISHED (finish reason STOP, LENGTH, CANCELLED or
// ERROR). A preempted sequence goes back to WAITING with nothing cached and is recomputed.
// `tokens` holds the prompt then the generated tokens; `n_cached` counts the leading tokens whose
// effect is in the caches (the KDA slot and the MLA pages). Each step feeds
// tokens[n_cached, n_cached + n); a step that feeds the last token samples the next one.
#pragma once
#include "runtime/engine.h"   // sampling_params, finish_reason

#include <cstdint>
#include <string>
#include <vector>

namespace perigee {

enum class seq_status : uint8_t { WAITING, PREFILL, DECODE, FINISHED };
std::string_view seq_status_name(seq_status s);

struct sequence {
    uint64_t id = 0;
    std::vector<int32_t> tokens;         // prompt + generated
    int32_t n_prompt = 0;
    int32_t n_cached = 0;                // tokens already in the caches
    int32_t slot = -1;                   // KDA state slot, -1 when none
    std::vector<int32_t> pages;          // MLA cache pages (block table), in position order
    seq_status status = seq_status::WAITING;
    finish_reason finished = finish_reason::NONE;
    std::string error;                   // when finished == ERROR
    sampling_params sp;
    uint64_t seed = 0;                   // the request's seed (given, or drawn at submit)
    std::vector<int32_t> stop_ids;       // eos ids (unless ignore_eos) + the request's stop ids
    int32_t max_model_len = 0;           // prompt + generated never exceeds this
    int n_preemptions = 0;
    // Prefix caching (runtime/prefix-cache.h): the chained hash of each leading full prompt page
    // already indexed or taken from the cache; a snapshot pinned between admission and its restore
    // into the slot; cache_blocked after a hash collision (the rest of this prompt is not indexed).
    std::vector<uint64_t> page_hashes;
    int32_t snapshot_pin = -1;
    bool cache_blocked = false;
    int32_t n_prefix_hit = 0;            // tokens taken from the cache at the last admission

    int32_t n_tokens() const { return int32_t(tokens.size()); }
    int32_t n_generated() const { return n_tokens() - n_prompt; }
    int32_t n_uncached() const { return n_tokens() - n_cached; }
    bool is_finished() const { return status == seq_status::FINISHED; }
};

// Appends a sampled token; returns the stop condition it meets (NONE to go on): a stop id -> STOP;
// max_tokens generated or max_model_len reached -> LENGTH. Does not free anything.
finish_reason sequence_append(sequence & s, int32_t token);

} // namespace perigee
