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
    // Steps of at least this many tokens feed their LINEARs and routed experts bf16-rounded inputs (op_params::
    // bf16_inputs): ARCHITECTURE §3.0's precision, one bf16 tensor-core pass per GEMM on the CUDA backend instead of
    // the hi + lo split that keeps fp32 inputs to ~16 bits. 0: never (every step keeps fp32 inputs). A per-step
    // rule: the decode rows of a step that also carries a long prefill chunk are rounded with it. 0 or >= 2.
    int bf16_inputs_min_tokens = 0;
};

// Refuses options no step could use, naming the option (forward_build checks them; model_runner at start-up).
void forward_options_check(const forward_options & opt);

graph forward_build(const kimi_config & c, const model_weights & w, model_state & st, std::shared_ptr<const batch> b,
                    const forward_options & opt = {});

} // namespace perigee
