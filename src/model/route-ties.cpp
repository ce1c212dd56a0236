#include "model/route-ties.h"

#include "core/dtype.h"
#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numeric>

namespace perigee {

namespace {

double leaf_value(const tensor & t, int64_t i) {
    switch (t.type) {
        case dtype::F32: return t.as<float>()[i];
        case dtype::BF16: return bf16_to_f32(t.as<uint16_t>()[i]);
        default: PG_FAIL("MOE_ROUTE near-tie check: router weight of dtype {}", dtype_name(t.type));
    }
}

// The CPU's top-k of the scores s over the experts whose group is kept (all when keep is empty): descending, ties to
// the lower id (as the CPU reference ranks).
std::vector<int32_t> top_k(const std::vector<double> & s, int64_t K, const std::vector<bool> & keep, int64_t gs) {
    std::vector<int32_t> ids;
    for (int32_t e = 0; e < int32_t(s.size()); ++e)
        if (keep.empty() || keep[size_t(e / gs)]) ids.push_back(e);
    const auto before = [&](int32_t x, int32_t y) { return s[size_t(x)] > s[size_t(y)] || (s[size_t(x)] == s[size_t(y)] && x < y); };
    std::sort(ids.begin(), ids.end(), before);
    ids.resize(size_t(std::min<int64_t>(K, int64_t(ids.size()))));
    return ids;
}

std::string id_list(const std::vector<int32_t> & ids, const std::vector<double> & s) {
    std::string o;
    for (int32_t e : ids) o += fmt::format("{}{}({:.9g})", o.empty() ? "" : ",", e, s[size_t(e)]);
    return o;
}

} // namespace

std::vector<double> route_biased(const float * h, const tensor & gate, const tensor * bias, router_act act, double * abs_max) {
    const int64_t E = gate.shape.at(0), D = gate.shape.at(1);
    std::vector<double> s(static_cast<size_t>(E));
    double am = 0.0;
    for (int64_t e = 0; e < E; ++e) {
        double acc = 0.0, ab = 0.0;
        for (int64_t i = 0; i < D; ++i) {
            const double v = double(h[i]) * leaf_value(gate, e * D + i);
            acc += v;
            ab += std::fabs(v);
        }
        s[size_t(e)] = acc;
        am = std::max(am, ab);
    }
    if (act == router_act::SIGMOID) {
        for (auto & v : s) v = 1.0 / (1.0 + std::exp(-v));
    } else {
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0.0;
        for (auto & v : s) sum += (v = std::exp(v - mx));
        for (auto & v : s) v /= sum;
    }
    if (bias)
        for (int64_t e = 0; e < E; ++e) s[size_t(e)] += leaf_value(*bias, e);
    *abs_max = am;
    return s;
}

route_tie route_near_tie(const int32_t * a_ids, const int32_t * b_ids, int64_t K, const float * h_a, const float * h_b,
                         const tensor & gate, const tensor * bias, router_act act, int64_t n_group, int64_t topk_group) {
    route_tie v;
    const int64_t E = gate.shape.at(0), D = gate.shape.at(1);
    const bool grouped = n_group > 1 && topk_group < n_group;
    const int64_t gs = grouped ? E / n_group : E;
    std::vector<int32_t> a(a_ids, a_ids + K), b(b_ids, b_ids + K);
    const auto valid = [&](std::vector<int32_t> x) {
        std::sort(x.begin(), x.end());
        return x.front() >= 0 && x.back() < E && std::adjacent_find(x.begin(), x.end()) == x.end();
    };
    if (!valid(a) || !valid(b)) {
        v.what = "ids invalid or repeated";
        v.refused = true;
        return v;
    }
    double am_a = 0.0, am_b = 0.0;
    const auto sa = route_biased(h_a, gate, bias, act, &am_a);
    const auto sb = route_biased(h_b, gate, bias, act, &am_b);
    for (int64_t e = 0; e < E; ++e) v.delta = std::max(v.delta, std::fabs(sa[size_t(e)] - sb[size_t(e)]));
    v.r = 2.0 * double(D) * std::ldexp(1.0, -24) * std::max(am_a, am_b) + std::ldexp(1.0, -22);
    v.bound = 2.0 * (v.delta + v.r);
    const bool exact_inputs = v.delta == 0.0;

    std::vector<bool> keep_b;   // grouped: the other side's kept groups
    std::string group_note;
    if (grouped) {
        std::vector<double> gscore(static_cast<size_t>(n_group));
        for (int64_t g = 0; g < n_group; ++g) {
            std::vector<double> m(sa.begin() + g * gs, sa.begin() + (g + 1) * gs);
            std::sort(m.begin(), m.end(), std::greater<double>());
            gscore[size_t(g)] = m[0] + (gs > 1 ? m[1] : 0.0);
        }
        std::vector<int64_t> order(static_cast<size_t>(n_group));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return gscore[size_t(x)] > gscore[size_t(y)]; });
        std::vector<bool> keep_a(size_t(n_group), false);
        for (int64_t i = 0; i < topk_group; ++i) keep_a[size_t(order[size_t(i)])] = true;
        keep_b.assign(size_t(n_group), false);
        int64_t used = 0;
        for (int32_t e : b)
            if (!keep_b[size_t(e / gs)]) keep_b[size_t(e / gs)] = true, ++used;
        if (used > topk_group) {
            v.what = fmt::format("ids over {} groups, more than the {} kept", used, topk_group);
            v.refused = true;
            return v;
        }
        for (int64_t i = 0; i < n_group && used < topk_group; ++i)   // filled up in the CPU's group order
            if (!keep_b[size_t(order[size_t(i)])]) keep_b[size_t(order[size_t(i)])] = true, ++used;
        double lo_a = INFINITY, hi_b = -INFINITY;
        std::vector<int32_t> ga, gb;   // groups kept by one side only
        for (int64_t g = 0; g < n_group; ++g) {
            if (keep_a[size_t(g)] && !keep_b[size_t(g)]) lo_a = std::min(lo_a, gscore[size_t(g)]), ga.push_back(int32_t(g));
            if (keep_b[size_t(g)] && !keep_a[size_t(g)]) hi_b = std::max(hi_b, gscore[size_t(g)]), gb.push_back(int32_t(g));
        }
        if (!ga.empty()) {
            v.groups_differ = true;
            v.gap = lo_a - hi_b;
            const bool exact_tie = v.gap == 0.0 && exact_inputs;
            const bool gtie = v.gap >= 0.0 && v.gap <= 2.0 * v.bound && !exact_tie;
            group_note = fmt::format("groups cpu-only [{}] other-only [{}] (cpu group scores; group gap {:.3e} {} bound {:.3e}); ",
                                     id_list(ga, gscore), id_list(gb, gscore),
                                     v.gap, exact_tie ? "an exact tie on identical inputs, against" : gtie ? "<=" : ">", 2.0 * v.bound);
            if (!gtie) {
                v.bound *= 2.0;
                v.what = group_note;
                return v;
            }
        }
    }
    // the experts: the CPU's top-k inside the other side's kept groups (a itself where the groups agree) against b
    const std::vector<int32_t> ref = v.groups_differ ? top_k(sa, K, keep_b, gs) : a;
    std::vector<int32_t> s_ref = ref, s_b = b, only_a, only_b;
    std::sort(s_ref.begin(), s_ref.end()), std::sort(s_b.begin(), s_b.end());
    std::set_difference(s_ref.begin(), s_ref.end(), s_b.begin(), s_b.end(), std::back_inserter(only_a));
    std::set_difference(s_b.begin(), s_b.end(), s_ref.begin(), s_ref.end(), std::back_inserter(only_b));
    double gap = 0.0;
    bool tie;
    if (only_a.empty()) {   // the same experts in another order: every pair the other side ranks the other way
        for (int64_t i = 0; i < K; ++i)
            for (int64_t j = i + 1; j < K; ++j) {
                const auto pi = std::find(b.begin(), b.end(), ref[size_t(i)]) - b.begin();
                const auto pj = std::find(b.begin(), b.end(), ref[size_t(j)]) - b.begin();
                if (pi > pj) gap = std::max(gap, sa[size_t(ref[size_t(i)])] - sa[size_t(ref[size_t(j)])]);
            }
        // (ref == b only where the groups differ, a != b: the group near tie explains it all)
        tie = ref == b || (gap <= v.bound && !(gap == 0.0 && exact_inputs));
        v.what = group_note + (ref == b ? "the same experts as the cpu's top-k inside those groups;" : "same experts, other order;");
    } else {
        double lo_a = INFINITY, hi_b = -INFINITY;
        for (int32_t e : only_a) lo_a = std::min(lo_a, sa[size_t(e)]);
        for (int32_t e : only_b) hi_b = std::max(hi_b, sa[size_t(e)]);
        gap = lo_a - hi_b;
        tie = gap >= 0.0 && gap <= v.bound && !(gap == 0.0 && exact_inputs);
        v.what = group_note + fmt::format("cpu-only [{}] other-only [{}] (cpu biased scores);", id_list(only_a, sa), id_list(only_b, sa));
    }
    if (v.groups_differ) v.bound *= 2.0;   // gap and bound of the group choice, which the experts' near tie then follows
    else v.gap = gap;
    v.tie = tie;
    return v;
}

} // namespace perigee
