// The mechanics of one engine step around the forward, shared by the engine loop and the tests:
// build the batch for a plan (preparing fresh slots), and after the forward commit the plan and
// take the prefix cache's KDA snapshots.
#pragma once
#include "runtime/model-runner.h"
#include "runtime/prefix-cache.h"
#include "runtime/scheduler.h"

#include <memory>

namespace perigee {

// Packs the plan's tokens into a batch (positions, slots, block tables, page size). A fresh slot
// is prepared first: a prefix hit's snapshot is copied into it (and unpinned), otherwise it is
// zeroed. logits_rows: the last row of every sampling sequence, or empty (all rows) if all_rows.
// `cache` and `snaps` may be null (no prefix caching).
std::shared_ptr<batch> step_prepare(const step_plan & p, model_runner & runner, prefix_cache * cache, snapshot_store * snaps,
                                    bool all_rows = false);

// After a successful forward: scheduler::commit (which indexes newly full prompt pages), then for
// every sequence whose chunk ended on a page boundary inside (or at the end of) its prompt, a copy
// of its slot's KDA state into a new snapshot for that boundary when it has none.
void step_commit(const step_plan & p, scheduler & sched, model_runner & runner, prefix_cache * cache, snapshot_store * snaps);

} // namespace perigee
