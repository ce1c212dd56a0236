#include "runtime/model-runner.h"

#include "core/error.h"
#include "runtime/block-manager.h"

#ifdef PERIGEE_HAVE_CUDA
#include "backend/cuda/backend-cuda.h"
#endif

namespace perigee {

std::string runner_backends() {
#ifdef PERIGEE_HAVE_CUDA
    return "cpu, cuda";
#else
    return "cpu";
#endif
}

model_runner::model_runner(const std::string & dir, const runner_options & opt) {
    // The backend name first: a wrong name is an error before the model is loaded.
    const bool cuda = opt.backend == "cuda";
    PG_CHECK(opt.backend == "cpu" || cuda, "unknown backend '{}' (this build has: {})", opt.backend, runner_backends());
#ifndef PERIGEE_HAVE_CUDA
    PG_CHECK(!cuda, "backend 'cuda' is not available in this build (it has: {}; configure with -DPERIGEE_CUDA=ON)",
             runner_backends());
#endif
    forward_options_check(opt.forward);
    fwd_ = opt.forward;
    cfg_ = config_load(dir);
    w_ = weights_load(cfg_, checkpoint::open(dir));
    int pages = opt.n_pages > 0 ? opt.n_pages : opt.n_slots * ((opt.max_tokens + opt.page_size - 1) / opt.page_size);
    if (opt.memory_budget_bytes > 0) {
        pages = plan_pools(cfg_, opt.memory_budget_bytes, opt.n_slots, opt.page_size, opt.max_tokens, opt.prefix_snapshots).n_pages;
        budget_snapshots_ = opt.prefix_snapshots;
    }
    st_ = state_init(cfg_, opt.n_slots, pages, opt.page_size);
    for (auto & ls : st_.layers)
        for (tensor * t : {&ls.conv_q, &ls.conv_k, &ls.conv_v, &ls.recurrent})
            if (!t->empty()) slot_pools_.push_back(t);
#ifdef PERIGEE_HAVE_CUDA
    if (cuda) {
        cuda_options co;
        co.graph_decode = opt.graph_decode;
        co.free_dead_outputs = true;   // the runner reads only the logits: intermediates die after their last reader
        be_ = backend_cuda_init(opt.device, co);
    }
#endif
    if (!be_) be_ = backend_cpu_init();
}

tensor model_runner::step(std::shared_ptr<const batch> b, const backend::node_callback & cb) {
    graph g = forward_build(cfg_, *w_, st_, b, fwd_);
    be_->check_supported(g);
    be_->run(g, cb);
    return be_->read(g.logits);
}

tensor model_runner::step_rows(std::shared_ptr<const batch> b) {
    PG_CHECK(!b->logits_rows.empty(), "step_rows: batch.logits_rows is empty");
    // The forward honours batch.logits_rows (SELECT_ROWS before the final norm and lm_head), so
    // only these rows are computed and copied back to the host.
    tensor rows = step(b);
    PG_CHECK(rows.dim(0) == int64_t(b->logits_rows.size()), "step_rows: forward returned {} logits rows for {} requested",
             rows.dim(0), b->logits_rows.size());
    if (logits_hook) logits_hook(*b, rows);
    return rows;
}

std::vector<int32_t> model_runner::step_sample(std::shared_ptr<const batch> b, const std::vector<row_sampling> & rows) {
    PG_CHECK(!b->logits_rows.empty(), "step_sample: batch.logits_rows is empty");
    PG_CHECK(rows.size() == b->logits_rows.size(), "step_sample: {} sampling entries for {} logits rows", rows.size(),
             b->logits_rows.size());
    graph g = forward_build(cfg_, *w_, st_, b, fwd_);
    be_->check_supported(g);
    be_->run(g);
    std::vector<int32_t> ids = be_->sample_rows(g.logits, rows);
    backend_sampled_rows += ids.size();
    return ids;
}

void model_runner::advance(std::shared_ptr<const batch> b) {
    PG_CHECK(b->n_tokens() > 0, "advance: empty batch");
    auto one = std::make_shared<batch>(*b);
    one->logits_rows = {int32_t(b->n_tokens() - 1)};
    graph g = forward_build(cfg_, *w_, st_, one, fwd_);
    be_->check_supported(g);
    be_->run(g);
}

void model_runner::zero_slot(int slot) {
    PG_CHECK(slot >= 0 && slot < st_.n_slots, "zero_slot: slot {} outside the pool of {}", slot, st_.n_slots);
    if (!skip_slot_zero) be_->slot_zero(slot_pools_, slot);
}

std::unique_ptr<slot_snapshots> model_runner::new_snapshots(int n) { return be_->slot_snapshots_new(slot_pools_, n); }

single_sequence::single_sequence(model_runner & r) : r_(r) { r_.be().slot_zero(r_.slot_pools(), 0); }

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
