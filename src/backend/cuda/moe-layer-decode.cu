// The 48B MoE block at T == 1 as ONE persistent launch (cuda_options::moe_layer_fused; the first piece of the persistent
// decode kernel sized in bench/RESULTS.md session 22): RMS_NORM -> router LINEAR -> MOE_ROUTE (small selection) ->
// MOE_EXPERTS with the shared expert as a ninth slot, the routed sum, the shared add and the residual add.
//
// Why: in the graph these are five launches (norm, router GEMV, selection, gate/up, down) and the three small ones leave
// the HBM idle: per MoE layer on the H200 norm 2.0 + router 2.5 + selection 4.0 us exposed, and gate/up / down pay
// ~2-3 us of ramp each over their bytes (session 18 timeline: ~43 us against ~30 us of bytes). Every local fix (sessions
// 5-23) moved that latency instead of hiding it. Here one grid of exactly the co-resident blocks runs the phases with
// device-wide counters instead of kernel boundaries, and the weights a phase can know early are in flight early:
//   phase 1  before the PDL wait each warp issues its first task's weight loads (a router row, or a row pair of the
//            shared expert's gate / up: none depends on the step), so they arrive while the previous kernel finishes;
//            after the wait every block computes the norm of x itself (norm-row.cuh, k_norm_reg's own code: h bit for bit the
//            RMS_NORM launch's; block 0 writes it), then the warps finish their rows (router logits, shared gate / up /
//            GLU).
//   barrier  A: the E router rows written (a counter the router warps raise); each block then selects the top k itself
//            from the logits (route-pick.cuh select_small_block: ids and weights bit for bit the selection launch's;
//            block 0 writes them), so no second barrier is paid for the selection.
//   phase 2  the routed gate / up rows, (slot, row) tasks strided over every warp of the grid; then each warp issues the
//            first two slots of its down task (two output rows) before barrier B.
//   barrier  B: every block's phase 2 done (a counter each block raises once). Down + combine: one warp per two output
//            rows, all k + 1 slots in slot order with two slots in flight; the combine is the pair's (routed sum in slot
//            order, then the shared row, then the residual).
// The last block to leave resets the counters, so each launch finds them 0 (they must be 0 before the first launch).
// A wait that exceeds its bound (grid-sync.cuh k_grid_wait_ns) flags ERR_SYNC_TIMEOUT and goes on: a flagged wrong
// result, not a hang.
// Co-residency: the grid is the occupancy-limited count of blocks (launch checks), every block of which must be
// resident for the barriers to pass; the PDL trigger comes after barrier B, when all are, so a dependent grid can never
// take the SM slots a block of this grid still needs. Kernels of the same stream before it drain on their own, so its
// blocks become resident in time. Not safe: two such grids running at once on one device from different streams (each
// could hold part of the SMs while waiting for the rest); the engine runs one decode stream per device. (A cooperative
// launch would promise co-residency but would start only on an idle device, losing the loads issued before the wait.)
//
// Arithmetic: every row is the pair's (moe-bf16-rows.cuh) and the norm and selection are their launches' own code, so
// every output except the router logits is bit for bit the unfused launches' given the same logits (test-moe-layer-cuda
// checks it); the router row is one warp's sum over the row (the GEMV launcher splits rows differently): the same dot
// product in another order, checked against the GEMV and an fp64 host sum.
#include "backend/cuda/moe-bf16-rows.cuh"
#include "backend/cuda/grid-sync.cuh"
#include "backend/cuda/norm-row.cuh"
#include "backend/cuda/route-pick.cuh"

namespace perigee::cuda {

namespace {

constexpr int k_ml_warps = 8;   // warps per block (256 threads: the norm's block size, so h is k_norm_reg's bit for bit)
constexpr int k_ml_threads = 32 * k_ml_warps;
constexpr int k_ml_select_warps = 4;   // select_small_block<4>, as the selection launch (cuda_options::moe_select_small 4)

// The down task's loads of one slot: R = 2 rows of nu = 32 NUF units.
template <int NUF>
struct down_loads {
    uint4 q[2][NUF];
};

template <int NUD, int NUF, int K>
__global__ void __launch_bounds__(k_ml_threads, 2) k_moe_layer_d1(dmoe_layer p, int fl) {
    constexpr int D = 256 * NUD, F = 256 * NUF, PT = NUD;   // the norm: PT elements per thread (i = tid + 256 j)
    static_assert(K >= 1 && K <= k_small_max_k, "the small selection's k");
    __shared__ __align__(16) float hs[D];
    __shared__ int32_t ids_s[K];
    __shared__ float w_s[K];
    const uint64_t pol = l2_stream_policy(fl & 2);
    const int tid = int(threadIdx.x), lane = tid & 31, wid = tid >> 5;
    const int G = int(gridDim.x), GW = G * k_ml_warps;
    const int gw = wid * G + int(blockIdx.x);   // the grid's warps numbered across the SMs first
    const int E = int(p.E);
    unsigned * bar_route = p.sync, * bar_h = p.sync + 1, * bar_exit = p.sync + 2;
    const dmoe_shared & sh = p.sh;

    // ---- phase 1 loads (weights only: never written by a kernel) and the norm / bias weights, before the wait
    const bool is_router = gw < E, is_shared = !is_router && gw < E + F;
    bf16_gate_up_loads<NUD> q1;   // a router row uses .g only
    if (is_router) bf16_row_issue<NUD>(p.router, gw, pol, lane, q1.g);
    else if (is_shared) bf16_gate_up_issue<NUD>(sh.w.gate.w, sh.w.up.w, gw - E, pol, lane, q1);
    float nwv[PT];
#pragma unroll
    for (int j = 0; j < PT; ++j) nwv[j] = wload_or(p.norm_w, tid + 256 * j, 1.0f);
    float bias_mine[2];
    select_small_bias<k_ml_select_warps>(p.bias, p.rc, bias_mine);
    pdl_wait();

    // ---- the norm: norm_row_reg<0, PT> on a 256-thread block, as k_norm_reg<0, *> (x written by the previous kernel)
    {
        float xv[PT], v[PT];
#pragma unroll
        for (int j = 0; j < PT; ++j) xv[j] = p.x[tid + 256 * j];
        norm_row_reg<0, PT>(xv, xv, nwv, nwv, D, p.eps, v);   // mode 0 reads neither z nor b
#pragma unroll
        for (int j = 0; j < PT; ++j) {
            hs[tid + 256 * j] = v[j];
            if (blockIdx.x == 0) p.h[tid + 256 * j] = v[j];
        }
    }
    __syncthreads();

    // ---- phase 1 sums
    if (is_router) {
        const float a = warp_sum(bf16_row_lane_dot<NUD, XM_PLAIN>(q1.g, hs, lane));
        if (lane == 0) {
            p.logits[gw] = a;
            __threadfence();
            atomicAdd(bar_route, 1u);
        }
    } else if (is_shared) {
        const float2 gu = bf16_gate_up_finish<NUD, XM_PLAIN>(q1, hs, lane);
        if (lane == 0) {
            const int row = gw - E;
            sh.gate[row] = gu.x;
            sh.up[row] = gu.y;
            sh.act[row] = bf16_glu(p.c, gu.x, gu.y);
        }
    }

    // ---- barrier A, then every block selects (block 0 writes the MOE_ROUTE outputs)
    block_wait_count(bar_route, unsigned(E) + unsigned((fl & 4) != 0), p.err);   // fl bit 2: the timeout's control
    select_small_block<k_ml_select_warps>(p.logits, bias_mine, p.rc, 0, ids_s, w_s);
    __syncthreads();
    if (blockIdx.x == 0 && tid < K) {
        p.ids[tid] = ids_s[tid];
        p.w[tid] = w_s[tid];
    }

    // ---- phase 2: routed gate / up, task t = (slot t / F, row t % F)
    for (int t = gw; t < K * F; t += GW) {
        const int j = t / F, row = t - j * F;
        const int32_t e = ids_s[j];
        if (e < 0 || e >= E) {   // as the pair: flagged, the slot's row unwritten and counted 0 by the combine
            if (lane == 0) atomicOr(p.err + ERR_EXPERT_ID, 1);
            continue;
        }
        bf16_gate_up_loads<NUD> q;
        bf16_gate_up_issue<NUD>(p.experts[e].gate.w, p.experts[e].up.w, row, pol, lane, q);
        const float2 gu = bf16_gate_up_finish<NUD, XM_PLAIN>(q, hs, lane);
        if (lane == 0) p.hbuf[int64_t(j) * F + row] = bf16_glu(p.c, gu.x, gu.y);
    }

    // ---- down task of this warp: rows r0, r0 + 1 (tasks numbered from the grid's last warp: those have the fewest
    // gate / up tasks); slots 0..K-1 routed, slot K shared. Its first two slots' loads before barrier B.
    const int dt = GW - 1 - gw, r0 = 2 * dt;
    const bool has_down = r0 < D;
    auto slot_w = [&](int s) -> const void * {
        if (s == K) return sh.w.down.w;
        const int32_t e = ids_s[s];
        return (e >= 0 && e < E) ? p.experts[e].down.w : nullptr;
    };
    auto issue = [&](int s, down_loads<NUF> & b) {
        const void * w = has_down && s <= K ? slot_w(s) : nullptr;
        if (!w) return;
        bf16_row_issue<NUF>(w, r0, pol, lane, b.q[0]);
        bf16_row_issue<NUF>(w, r0 + 1, pol, lane, b.q[1]);
    };
    down_loads<NUF> b0, b1;
    issue(0, b0);
    issue(1, b1);
    block_arrive(bar_h);
    block_wait_count(bar_h, unsigned(G), p.err);
    pdl_trigger();   // every block is resident (all counted): a dependent grid may be scheduled now

    if (has_down) {
        float o0 = 0.0f, o1 = 0.0f, d0 = 0.0f, d1 = 0.0f;
#pragma unroll
        for (int s = 0; s <= K; ++s) {
            down_loads<NUF> & b = (s & 1) ? b1 : b0;
            const bool ok = slot_w(s) != nullptr;
            float v0 = 0.0f, v1 = 0.0f;
            if (ok) {
                const float * hrow = s == K ? sh.act : p.hbuf + int64_t(s) * F;
                v0 = warp_sum(bf16_row_lane_dot<NUF, XM_L2>(b.q[0], hrow, lane));
                v1 = warp_sum(bf16_row_lane_dot<NUF, XM_L2>(b.q[1], hrow, lane));
            }
            if (s + 2 <= K) issue(s + 2, b);   // this buffer's next slot, while the other is in flight
            if (s < K) {   // the pair's combine: o += w[j] * v in slot order (an invalid id's v is 0)
                o0 += w_s[s] * v0;
                o1 += w_s[s] * v1;
            } else {
                d0 = v0;
                d1 = v1;
            }
        }
        if (lane < 2) {
            const int r = r0 + lane;
            const float o = lane ? o1 : o0, d = lane ? d1 : d0, sum = o + d;
            p.y[r] = o;
            sh.down[r] = d;
            sh.sum[r] = sum;
            if (sh.sum2) sh.sum2[r] = sum + sh.res[r];
        }
    }

    // ---- the last block out resets the counters for the next launch (every block has passed both barriers)
    grid_exit_reset(p.sync, 2, bar_exit);   // bar_route, bar_h
}

} // namespace

bool moe_layer_decode_supported(int64_t D, int64_t F, int64_t E, int64_t k, const droute & rc) {
    return D == 2304 && F == 1024 && k == 8 && rc.topk == k && rc.n_expert == E && route_small_supported(rc);
}

bool moe_layer_decode_supported_shape(int64_t D, int64_t d_ff, int64_t E, int64_t k, int64_t n_group, int64_t topk_group,
                                      bool softmax) {
    return moe_layer_decode_supported(D, d_ff, E, k, droute{E, k, n_group, topk_group, true, 1.0f, softmax ? 1 : 0});
}

cudaError_t launch_moe_layer_decode(const dmoe_layer & p, cudaStream_t st, int cfg) {
    const int64_t D = p.sh.w.gate.in, F = p.c.d_ff;
    if (!moe_layer_decode_supported(D, F, p.E, p.rc.topk, p.rc) || p.c.d_out != D) return cudaErrorInvalidValue;
    const dexpert & s = p.sh.w;
    if (s.gate.type != wtype::BF16 || s.up.type != wtype::BF16 || s.down.type != wtype::BF16 || s.gate.fmt != 0 ||
        s.up.fmt != 0 || s.down.fmt != 0 || s.gate.out != F || s.up.out != F || s.up.in != D || s.down.out != D ||
        s.down.in != F)
        return cudaErrorInvalidValue;
    if (!p.x || !p.router || !p.experts || !p.h || !p.logits || !p.ids || !p.w || !p.hbuf || !p.y || !p.sync || !p.err ||
        !p.sh.gate || !p.sh.up || !p.sh.act || !p.sh.down || !p.sh.sum || (p.sh.sum2 != nullptr) != (p.sh.res != nullptr))
        return cudaErrorInvalidValue;
    auto a16 = [](const void * q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; };
    for (const void * q : {static_cast<const void *>(p.x), p.router, static_cast<const void *>(p.hbuf),
                           static_cast<const void *>(p.sh.act), s.gate.w, s.up.w, s.down.w})
        if (!a16(q)) return cudaErrorInvalidValue;
    const int G = resident_grid<k_moe_layer_d1<9, 4, 8>, k_ml_threads>();
    // every phase's tasks fit one pass of the grid's warps (router + shared rows; down row pairs)
    if (G < 1 || int64_t(G) * k_ml_warps < p.E + F || int64_t(G) * k_ml_warps * 2 < D) return cudaErrorInvalidValue;
    const int fl = (cfg / 1000 % 10 == 1 ? 2 : 0) |   // the weights' L2 policy evict_first (as the pair's cfg digit)
                   (cfg % 10 == 9 ? 4 : 0);          // tests: the first barrier's target one too high (must time out)
    return launch_k(k_moe_layer_d1<9, 4, 8>, unsigned(G), k_ml_threads, 0, st, p, fl);
}

} // namespace perigee::cuda
