// The router's near-tie rule: whether two backends' MOE_ROUTE selections of one token differ only where the biased
// scores are closer than what the two sides' inputs and fp32 summation order can move them (perigee compare-backends;
// tests/unit/model/test_route_ties.cpp). Both sides compute the same selection (op.h MOE_ROUTE: sigmoid or softmax of
// h . gate, plus the bias; grouped top-k when n_group > 1 and topk_group < n_group, a group scored by the sum of its
// top-2 biased scores, ties to the lower id); their h differ within the comparison's tolerance.
#pragma once

#include "core/tensor.h"
#include "ir/graph.h"

#include <cstdint>
#include <string>
#include <vector>

namespace perigee {

// Biased scores of one token (h [D]) from the gate [E, D] (F32 or BF16) and the bias [E] (or none), in fp64;
// *abs_max = max_e sum_i |h_i g_ei| (the scale of the fp32 summation-order error of a logit).
std::vector<double> route_biased(const float * h, const tensor & gate, const tensor * bias, router_act act, double * abs_max);

struct route_tie {
    bool tie = false;       // the difference is explained by near ties (accepted)
    double gap = 0.0;       // how far the CPU's choice is ahead of the other's, in biased score (group score if groups differ)
    double bound = 0.0;     // what the inputs' difference and the fp32 order allow for that gap
    double delta = 0.0;     // max_e |biased_cpu(e) - biased_other(e)| from the two sides' h
    double r = 0.0;         // the fp32 summation-order bound of one biased score
    bool groups_differ = false;
    bool refused = false;   // no scores compared: ids out of range or repeated, or over more than topk_group groups
    std::string what;       // a line naming the differing experts (and groups) with the CPU's scores
};

// One token. a: the CPU's K ids (in its order), b: the other backend's; h_a / h_b: the router input each side used.
// Ungrouped: the sets differ -> gap = min biased(CPU-only) - max biased(other-only), a tie when 0 <= gap <= bound, bound
// = 2 (delta + r); the same set in another order -> every pair ranked the other way within the bound. Grouped: the
// other side's kept groups are those its ids use, filled up to topk_group by the CPU's group order; where they differ
// from the CPU's kept groups, the group gap (min CPU-kept-only group score - max other-kept-only group score) must lie
// in [0, 2 bound] (a group score sums two biased scores); then the CPU's top-k inside the other side's kept groups
// must match b under the ungrouped rule. Ids out of range, repeated, or spread over more than topk_group groups are
// never a tie. An exact tie on identical inputs (gap 0, delta 0) is not accepted either: the selections must agree.
route_tie route_near_tie(const int32_t * a, const int32_t * b, int64_t K, const float * h_a, const float * h_b, const tensor & gate,
                         const tensor * bias, router_act act, int64_t n_group, int64_t topk_group);

} // namespace perigee
