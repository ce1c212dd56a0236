#include "runtime/model-runner.h"

#include "core/error.h"

namespace perigee {

model_runner::model_runner(const std::string & dir, const runner_options & opt) {
    cfg_ = config_load(dir);
    w_ = weights_load(cfg_, checkpoint::open(dir));
    const int pages = opt.n_pages > 0 ? opt.n_pages : opt.n_slots * ((opt.max_tokens + opt.page_size - 1) / opt.page_size);
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
