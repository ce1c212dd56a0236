// backend::slot_zero and backend::slot_snapshots_new on the CPU backend do exactly what the runtime did
// on the host pools before they moved behind the backend: state_slot_zero (model/state.h) and the old
// snapshot_store's per-tensor row memcpy (reimplemented here as the reference). Bitwise, on every pool
// byte, with controls that must fail. Pools are filled with distinct random words first, so a zero or a
// copy in the wrong place cannot hide.
#include "backend/backend.h"
#include "model/config.h"
#include "model/state.h"
#include "runtime/model-runner.h"
#include "runtime/prefix-cache.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

namespace {

using namespace perigee;

const std::string k_model = std::string(PERIGEE_REPO_ROOT) + "/models/default";

std::vector<tensor *> kda_pools(model_state & st) {
    std::vector<tensor *> v;
    for (auto & ls : st.layers)
        for (tensor * t : {&ls.conv_q, &ls.conv_k, &ls.conv_v, &ls.recurrent})
            if (!t->empty()) v.push_back(t);
    return v;
}

void fill(model_state & st, uint32_t seed) {
    std::mt19937 g(seed);
    for (auto & ls : st.layers)
        for (tensor * t : {&ls.conv_q, &ls.conv_k, &ls.conv_v, &ls.recurrent, &ls.latent, &ls.index_keys})
            for (size_t i = 0; i < t->nbytes / 4; ++i) static_cast<uint32_t *>(t->data)[i] = g() | 1u;   // never 0
}

// Bytes of every pool (KDA and MLA) equal? Returns the first differing tensor's index, or -1.
int first_diff(const model_state & a, const model_state & b) {
    int k = 0;
    for (size_t l = 0; l < a.layers.size(); ++l) {
        const auto & x = a.layers[l];
        const auto & y = b.layers[l];
        const tensor * xs[] = {&x.conv_q, &x.conv_k, &x.conv_v, &x.recurrent, &x.latent, &x.index_keys};
        const tensor * ys[] = {&y.conv_q, &y.conv_k, &y.conv_v, &y.recurrent, &y.latent, &y.index_keys};
        for (int i = 0; i < 6; ++i, ++k) {
            if (xs[i]->nbytes != ys[i]->nbytes) return k;
            if (xs[i]->nbytes && std::memcmp(xs[i]->data, ys[i]->data, xs[i]->nbytes) != 0) return k;
        }
    }
    return -1;
}

// The old snapshot_store (runtime/prefix-cache.cpp before the slot ops moved to the backend).
struct ref_snapshots {
    std::vector<float> data;
    int64_t per = 0;
    ref_snapshots(const model_state & st, int n) {
        for (const auto & ls : st.layers)
            for (const tensor * t : {&ls.conv_q, &ls.conv_k, &ls.conv_v, &ls.recurrent})
                if (!t->empty()) per += int64_t(t->nbytes / sizeof(float)) / st.n_slots;
        data.assign(size_t(per) * size_t(n), 0.0f);
    }
    void save(const model_state & st, int slot, int snap) {
        float * dst = data.data() + int64_t(snap) * per;
        for (const auto & ls : st.layers)
            for (const tensor * t : {&ls.conv_q, &ls.conv_k, &ls.conv_v, &ls.recurrent}) {
                if (t->empty()) continue;
                const size_t row = t->nbytes / size_t(st.n_slots);
                std::memcpy(dst, static_cast<const char *>(t->data) + row * size_t(slot), row);
                dst += row / sizeof(float);
            }
    }
    void load(int snap, model_state & st, int slot) const {
        const float * src = data.data() + int64_t(snap) * per;
        for (auto & ls : st.layers)
            for (tensor * t : {&ls.conv_q, &ls.conv_k, &ls.conv_v, &ls.recurrent}) {
                if (t->empty()) continue;
                const size_t row = t->nbytes / size_t(st.n_slots);
                std::memcpy(static_cast<char *>(t->data) + row * size_t(slot), src, row);
                src += row / sizeof(float);
            }
    }
};

struct slot_ops : ::testing::Test {
    kimi_config cfg = config_load(k_model);
    std::unique_ptr<backend> be = backend_cpu_init();
    model_state a = state_init(cfg, 4, 6, 16), b = state_init(cfg, 4, 6, 16);
    void SetUp() override {
        ASSERT_GT(cfg.n_kda_layers(), 0) << k_model << " has no KDA layers";
        fill(a, 11);
        fill(b, 11);
        ASSERT_EQ(first_diff(a, b), -1);
    }
};

TEST_F(slot_ops, zero_is_state_slot_zero_bitwise) {
    state_slot_zero(a, 2);
    be->slot_zero(kda_pools(b), 2);
    EXPECT_EQ(first_diff(a, b), -1) << "backend slot_zero differs from state_slot_zero";
    // Control: zeroing another slot must be reported.
    be->slot_zero(kda_pools(b), 1);
    EXPECT_NE(first_diff(a, b), -1) << "control: zeroing slot 1 too went unnoticed";
}

TEST_F(slot_ops, zero_checks_the_slot) {
    EXPECT_THROW(be->slot_zero(kda_pools(b), 4), error);
    EXPECT_THROW(be->slot_zero(kda_pools(b), -1), error);
    EXPECT_EQ(first_diff(a, b), -1) << "a refused zero wrote something";
}

TEST_F(slot_ops, snapshots_match_the_old_store_bitwise) {
    ref_snapshots ref(a, 3);
    auto snaps = be->slot_snapshots_new(kda_pools(b), 3);
    ASSERT_EQ(snaps->capacity(), 3);
    EXPECT_EQ(snaps->bytes_per_snapshot(), state_slot_bytes(cfg));
    EXPECT_EQ(snaps->bytes_per_snapshot(), ref.per * 4);
    // save slot 1 -> snap 0 and slot 3 -> snap 2; scribble over both slots; load snap 0 -> slot 3, snap 2 -> slot 0.
    ref.save(a, 1, 0);
    ref.save(a, 3, 2);
    snaps->save(1, 0);
    snaps->save(3, 2);
    fill(a, 99);
    fill(b, 99);
    ref.load(0, a, 3);
    ref.load(2, a, 0);
    snaps->load(0, 3);
    snaps->load(2, 0);
    EXPECT_EQ(first_diff(a, b), -1) << "backend snapshots differ from the old snapshot_store";
    // Load of a never-saved snapshot: zeros, as the old store's zero-initialised buffer gave.
    ref.load(1, a, 2);
    snaps->load(1, 2);
    EXPECT_EQ(first_diff(a, b), -1);
    // Control: loading the wrong snapshot must be reported.
    snaps->load(2, 3);
    EXPECT_NE(first_diff(a, b), -1) << "control: a wrong restore went unnoticed";
}

TEST_F(slot_ops, snapshots_check_their_ranges) {
    auto snaps = be->slot_snapshots_new(kda_pools(b), 2);
    EXPECT_THROW(snaps->save(4, 0), error);
    EXPECT_THROW(snaps->save(0, 2), error);
    EXPECT_THROW(snaps->load(-1, 0), error);
    std::vector<tensor *> mixed = kda_pools(b);
    model_state other = state_init(cfg, 3, 6, 16);
    mixed.push_back(kda_pools(other).front());
    EXPECT_THROW(be->slot_snapshots_new(mixed, 1), error) << "pools with different slot counts";
}

// Through the runner (what the engine uses): zero_slot and snapshot_store on the runner's own pools.
TEST(slot_ops_runner, runner_paths_match_the_host_reference) {
    runner_options ro;
    ro.n_slots = 3;
    ro.max_tokens = 64;
    model_runner r(k_model, ro);
    EXPECT_EQ(r.be().name(), "cpu");
    model_state & st = r.state();
    fill(st, 5);
    model_state ref = state_init(r.config(), st.n_slots, st.n_pages, st.page_size);
    fill(ref, 5);
    ASSERT_EQ(first_diff(st, ref), -1);
    r.zero_slot(1);
    state_slot_zero(ref, 1);
    EXPECT_EQ(first_diff(st, ref), -1);
    snapshot_store snaps(r, 2);
    ref_snapshots rs(ref, 2);
    EXPECT_EQ(snaps.bytes_per_snapshot(), state_slot_bytes(r.config()));
    snaps.save(2, 1);
    rs.save(ref, 2, 1);
    snaps.load(1, 0);
    rs.load(1, ref, 0);
    EXPECT_EQ(first_diff(st, ref), -1);
    r.skip_slot_zero = true;   // control: the test hook makes zero_slot a no-op, which must show
    r.zero_slot(2);
    state_slot_zero(ref, 2);
    EXPECT_NE(first_diff(st, ref), -1) << "control: skip_slot_zero left no trace";
}

TEST(slot_ops_runner, backend_names_are_strict) {
    runner_options ro;
    ro.backend = "gpu";
    try {
        model_runner r(k_model, ro);
        FAIL() << "backend 'gpu' was accepted";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("'gpu'"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("cpu"), std::string::npos) << e.what();
    }
#ifndef PERIGEE_HAVE_CUDA
    ro.backend = "cuda";
    EXPECT_THROW(model_runner(k_model, ro), error) << "a build without CUDA must refuse backend 'cuda'";
#endif
    EXPECT_EQ(runner_backends().rfind("cpu", 0), 0u);
}

} // namespace
