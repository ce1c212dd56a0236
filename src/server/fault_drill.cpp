// TEST-ONLY fault injection; see fault_drill.h.
#include "server/fault_drill.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>

namespace perigee::server {

void install_nan_drill(model_runner & r, int32_t trigger, int after_rows) {
    struct slot_state {
        bool armed = false;
        int rows = 0;
    };
    auto slots = std::make_shared<std::map<int, slot_state>>();
    r.logits_hook = [slots, trigger, after_rows](const batch & b, tensor & rows) {
        const int64_t V = rows.dim(1);
        for (int s = 0; s < b.n_seq(); ++s) {
            const int slot = b.slot[size_t(s)];
            const auto first = b.ids.begin() + b.seq_start[size_t(s)], last = b.ids.begin() + b.seq_start[size_t(s) + 1];
            const bool has = std::find(first, last, trigger) != last;
            slot_state & st = (*slots)[slot];
            if (b.pos0[size_t(s)] == 0) st = {has, 0};
            else if (has) st.armed = true;
            if (!st.armed) continue;
            // the row of this sequence's last token, if its logits were asked for
            const int tok = b.seq_start[size_t(s) + 1] - 1;
            int row = tok;
            if (!b.logits_rows.empty()) {
                const auto it = std::find(b.logits_rows.begin(), b.logits_rows.end(), tok);
                if (it == b.logits_rows.end()) continue;
                row = int(it - b.logits_rows.begin());
            }
            if (st.rows++ == after_rows) {
                float * p = rows.f32() + int64_t(row) * V;
                std::fill(p, p + V, NAN);
                st.armed = false;
            }
        }
    };
}

} // namespace perigee::server
