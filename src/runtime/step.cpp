#include "runtime/step.h"

#include "core/error.h"

namespace perigee {

std::shared_ptr<batch> step_prepare(const step_plan & p, model_runner & runner, prefix_cache * cache, snapshot_store * snaps,
                                    bool all_rows) {
    auto b = std::make_shared<batch>();
    b->page_size = runner.state().page_size;
    b->seq_start.push_back(0);
    for (const auto & it : p.items) {
        sequence & s = *it.seq;
        if (it.fresh_slot) {
            if (it.restore_snapshot >= 0) {
                PG_CHECK(cache && snaps, "step: sequence {} has a prefix snapshot to restore but no cache is set", s.id);
                PG_CHECK(s.snapshot_pin == it.restore_snapshot, "step: sequence {} does not hold snapshot {}", s.id,
                         it.restore_snapshot);
                snaps->load(it.restore_snapshot, s.slot);
                cache->unpin(it.restore_snapshot);
                s.snapshot_pin = -1;
            } else {
                runner.zero_slot(s.slot);
            }
        }
        b->ids.insert(b->ids.end(), s.tokens.begin() + it.pos0, s.tokens.begin() + it.pos0 + it.n_tokens);
        b->seq_start.push_back(int32_t(b->ids.size()));
        b->pos0.push_back(it.pos0);
        b->slot.push_back(s.slot);
        b->block_table.push_back(s.pages);
        if (!all_rows && it.samples()) b->logits_rows.push_back(int32_t(b->ids.size()) - 1);
    }
    return b;
}

void step_commit(const step_plan & p, scheduler & sched, model_runner & runner, prefix_cache * cache, snapshot_store * snaps) {
    sched.commit(p);
    if (!cache || !snaps) return;
    const int32_t ps = runner.state().page_size;
    for (const auto & it : p.items) {
        const sequence & s = *it.seq;
        if (s.is_finished()) continue;
        const int32_t end = it.pos0 + it.n_tokens;
        if (end % ps != 0 || end > s.n_prompt) continue;
        const int32_t snap = cache->snapshot_for(s, end / ps - 1);
        if (snap >= 0) snaps->save(s.slot, snap);
    }
}

} // namespace perigee
