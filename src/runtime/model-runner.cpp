#include "runtime/model-runner.h"

#include "core/error.h"
#include "runtime/block-manager.h"


namespace perigee {

model_runner::model_runner(const std::string & dir, const runner_options & opt) {
    cfg_ = config_load(dir);
    w_ = weights_load(cfg_, checkpoint::open(dir));
    int pages = opt.n_pages > 0 ? opt.n_pages : opt.n_slots * ((opt.max_tokens + opt.page_size - 1) / opt.page_size);
    if (opt.memory_budget_bytes > 0)
        pages = plan_pools(cfg_, opt.memory_budget_bytes, opt.n_slots, opt.page_size, opt.max_tokens).n_pages;
    st_ = state_init(cfg_, opt.n_slots, pages, opt.page_size);
    PG_CHECK(opt.backend == "cpu", "backend '{}' is not available in this build (cpu)", opt.backend);
    be_ = backend_cpu_init();
}

tensor model_runner::step(std::shared_ptr<const batch> b, const backend::node_callback & cb) {
    graph g = forward_build(cfg_, *w_, st_, b);
    be_->check_supported(g);
    be_->run(g, cb);
    return be_->read(g.logits);
}

tensor model_runner::step_rows(std::shared_ptr<const batch> b) {
    PG_CHECK(!b->logits_rows.empty(), "step_rows: batch.logits_rows is empty");
    // The forward honours batch.logits_rows (SELECT_ROWS before the final norm and lm_head).
    tensor rows = step(b);
    PG_CHECK(rows.dim(0) == int64_t(b->logits_rows.size()), "step_rows: forward returned {} logits rows for {} requested",
             rows.dim(0), b->logits_rows.size());
    if (logits_hook) logits_hook(*b, rows);
    return rows;
}

void model_runner::zero_slot(int slot) {
    if (!skip_slot_zero) state_slot_zero(st_, slot);
}

single_sequence::single_sequence(model_runner & r) : r_(r) { state_slot_zero(r_.state(), 0); }

tensor single_sequence::feed(const std::vector<int32_t> & ids) {
    PG_CHECK(!ids.empty(), "feed: no tokens");
    auto b = std::make_shared<batch>();
    b->ids = ids;
    b->seq_start = {0, int32_t(ids.size())};
    b->pos0 = {n_past_};
    b->slot = {0};
    b->page_size = r_.state().page_size;
    const int32_t need = (n_past_ + int32_t(ids.size()) + b->page_size - 1) / b->page_size;
    PG_CHECK(need <= r_.state().n_pages, "sequence of {} tokens needs {} cache pages; the pool has {}",
             n_past_ + ids.size(), need, r_.state().n_pages);
    while (int32_t(pages_.size()) < need) pages_.push_back(int32_t(pages_.size()));
    b->block_table = {pages_};
    tensor logits = r_.step(b);
    n_past_ += int32_t(ids.size());
    return logits;
}

} // namespace perigee
