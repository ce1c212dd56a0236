// The real engine behind the server's gen_engine interface.
#include "server/gen_engine.h"

namespace perigee::server {
namespace {

class engine_adapter final : public gen_engine {
public:
    explicit engine_adapter(engine & e) : e_(e) {}
    uint64_t submit(request r, std::function<void(const token_event &)> cb) override { return e_.submit(std::move(r), std::move(cb)); }
    void cancel(uint64_t id) override { e_.cancel(id); }
    engine_stats stats() const override { return e_.stats(); }
    int vocab_size() const override { return static_cast<int>(e_.config().vocab_size); }

private:
    engine & e_;
};

} // namespace

std::unique_ptr<gen_engine> wrap_engine(engine & e) { return std::make_unique<engine_adapter>(e); }

} // namespace perigee::server
