// THE architecture: the one file that knows the layer order of the Kimi family (STYLE §3.4).
// Builds the forward graph for one batch (ir/batch.h); any backend runs it.
#pragma once
#include "ir/graph.h"
#include "model/config.h"
#include "model/state.h"
#include "model/weights.h"

namespace perigee {

struct forward_options {
    int kda_chunk_size = 64;   // KDA_SCAN form for steps that prefill (>1 token in a sequence); decode uses 0
};

graph forward_build(const kimi_config & c, const model_weights & w, model_state & st, std::shared_ptr<const batch> b,
                    const forward_options & opt = {});

} // namespace perigee
