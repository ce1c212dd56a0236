// The KDA block's decode tail in one launch (cuda_options::fuse_kda_decode, fuse-plan.h rule 7): for one head (K = V in
// {32, 64, 128}) of one sequence, per token in order,
//   q, k, v = SiLU(causal depthwise conv(x_q, x_k, x_v) with the conv state)        (SHORT_CONV x3)
//   qn, kn  = per-head L2 norm of q, k                                                 (L2_NORM x2)
//   f       = fa W_fb^T for the head's K rows (or f given)                             (LINEAR f_b_proj)
//   g       = KDA gate of f                                                            (KDA_GATE)
//   z       = ga W_gb^T for the head's V rows (or z given: K3's full-rank g_proj)      (LINEAR g_b_proj)
//   o       = delta-rule step of the fp32 state S [K, V] with qn, kn, v, g, beta       (KDA_SCAN)
//   on      = RMSNorm(o) * w * sigmoid(z) over the head's V values                     (GATED_RMS_NORM)
// and every one of those outputs is written (other consumers, node-by-node comparison). The 48B's KDA layer ran these as
// 8 launches of ~2.5-5 us each (Nsight Compute, session 4: 28.4 us for ~3 MB), latency, not bytes.
//
// Why the numbers equal the unfused kernels bit for bit when f and z are given: each stage repeats the unfused kernel's
// arithmetic in the same order with the same thread mapping: the conv as k_short_conv / k_short_conv_l2 (taps summed in
// order, SiLU); each head norm as block_sum over K / 32 warps of one element per thread (k_short_conv_l2, k_norm with
// threads_for(K) = K); the gate as k_kda_gate; the scan by k_kda_scan_v2's own step function (kda-step.cuh, one
// definition for both) in its layout (16 row groups of K / 16 rows, 8 column quads per 32-column tile); the gated norm
// as k_norm<2>. test-fuse-cuda kda_decode_tail checks that equality and the folded GEMVs against the CPU.
// The folded f_b / g_b GEMVs are NOT the GEMV kernels' summation order (4 threads per row, 8-element chunks), so with
// them folded the outputs agree with the unfused path to fp32 rounding (NMSE), not bitwise.
#include "backend/cuda/common.cuh"
#include "backend/cuda/fuse-ops.h"
#include "backend/cuda/grid-sync.cuh"
#include "backend/cuda/kda-step.cuh"
#include "backend/cuda/moe-bf16-rows.cuh"

namespace perigee::cuda {

namespace {

constexpr int kConvW = 4;               // conv taps (Kimi: short_conv_kernel_size 4)
constexpr int kMaxChunks = 4;           // f_b / g_b rows of up to 4 x 32 = 128 values (8 bf16 per 16-byte chunk)

__device__ __forceinline__ void prefetch_l2(const void * p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// block_sum (common.cuh) of an NW-warp group whose per-warp sums are in red[0..NW-1]: the same second stage.
template <int NW>
__device__ __forceinline__ float group_sum(const float * red, int lane) { return warp_sum(lane < NW ? red[lane] : 0.0f); }

// One row of a bf16 low-rank projection: the thread's chunks p, p + 4, ... of 8 values each, summed in order, then
// the 4 threads of the row (adjacent lanes) by two shuffles.
__device__ __forceinline__ float lowrank_row(const uint4 (&w)[kMaxChunks], int nch, int p, const float * xs) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
        if (i >= nch) break;
        const int c0 = (p + 4 * i) * 8;
        const uint32_t u[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc += __uint_as_float(u[j] << 16) * xs[c0 + 2 * j];
            acc += __uint_as_float(u[j] & 0xffff0000u) * xs[c0 + 2 * j + 1];
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    return acc;
}

// The tail of head h of sequence s on a block of 4 KD threads (every thread of the block calls it). TRIGGER: the PDL
// prologue is pdl_enter (wait, then let the next kernel be scheduled: the plain launch); else pdl_wait only (the
// persistent launch with o_proj triggers after its barrier, when all its blocks are resident).
template <int KD, bool TRIGGER>
__device__ __forceinline__ void kda_tail(const kda_decode_args & a, const dbatch & b, int h, int s) {
    constexpr int kD = KD, kNW = KD / 32;   // warps per head-wide group (the unfused norms' blocks of KD threads)
    constexpr int kRows = KD / 16;           // scan rows per thread (16 row groups)
    __shared__ float s_fa[32 * kMaxChunks], s_ga[32 * kMaxChunks];
    __shared__ float s_q[kD], s_k[kD], s_v[kD], s_g[kD], s_z[kD], s_o[kD];
    __shared__ float red_l2[2][kNW], red_n[kNW], s_beta;
    constexpr int kTiles = KD / 32;          // scan tiles of 32 value columns
    __shared__ float4 red_pred[kTiles][4][8], red_out[kTiles][4][8];   // [tile][warp of the tile][column quad]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int H = a.H;
    const int64_t HD = int64_t(H) * kD;

    // ---- weights (constants) before the PDL wait: they load while the previous kernel finishes ----
    const int part = tid / kD, c = tid % kD;   // conv: part 0 q, 1 k, 2 v (threads 0 .. 3 KD - 1), channel c of the head
    const int64_t ch = int64_t(h) * kD + c;
    const dweight cw = part == 0 ? a.conv_q : part == 1 ? a.conv_k : a.conv_v;
    float wc[kConvW];
#pragma unroll
    for (int j = 0; j < kConvW; ++j) wc[j] = part < 3 ? wload(cw, ch * kConvW + j) : 0.0f;
    const int row = tid >> 2, rp = tid & 3;          // low-rank GEMVs: row (of KD) and quarter of the row
    const int nf = a.Rf / 32, ng = a.Rg / 32;        // 16-byte chunks per thread
    const uint4 * wf_p = a.f_b ? reinterpret_cast<const uint4 *>(a.f_b) + ((int64_t(h) * kD + row) * a.Rf) / 8 + rp : nullptr;
    const uint4 * wg_p = a.g_b ? reinterpret_cast<const uint4 *>(a.g_b) + ((int64_t(h) * kD + row) * a.Rg) / 8 + rp : nullptr;
    // Into L2 now, into registers per token (held across the token loop they cost 32 registers and the kernel spilled).
#pragma unroll
    for (int i = 0; i < kMaxChunks; ++i) {
        if (wf_p && i < nf) prefetch_l2(wf_p + 4 * i);
        if (wg_p && i < ng) prefetch_l2(wg_p + 4 * i);
    }
    const float a_exp = expf(wload(a.a_log, h));
    const float dtb = tid < kD ? wload(a.dt_bias, int64_t(h) * kD + tid) : 0.0f;
    // the gate's dt_bias of the thread's low-rank row (read per token on the f_b path: a memory round trip between the
    // first barrier and the gate when it was loaded there)
    const float dtb_row = a.f_b && rp == 0 ? wload(a.dt_bias, int64_t(h) * kD + row) : 0.0f;
    const float onw = tid < kD ? wload(a.o_norm, tid) : 0.0f;
    // The head's state and the conv histories, read before the wait too (into registers, not only into L2 as the first
    // form did: the conv history's round trip to HBM came after the wait). They were last written by this layer's tail
    // in an EARLIER step, i.e. by a kernel that completed before this one's predecessor began: this grid starts only
    // once every block of its predecessor has triggered, which every launch_k kernel does only after its own wait
    // (pdl_enter), so all kernels before the predecessor have completed (graph replays and runs follow one another on
    // the stream). b.slot likewise: written by the step's batch upload, a copy that completed before the step's first
    // kernel began (copies are not programmatic launches). No kernel of the step writes the state, the conv histories
    // or b.slot before this one.
    const int tile = warp >> 2, wl = warp & 3, cq = lane & 7, rl = lane >> 3;
    const int d0 = (wl * 4 + rl) * kRows, e = tile * 32 + 4 * cq;
    // ---- state: S rows [d0, d0 + 8) x columns [e, e + 4) of the thread's tile (k_kda_scan_v2's layout) ----
    float4 * S = reinterpret_cast<float4 *>(a.state + ((int64_t(b.slot[s]) * H + h) * kD) * kD + e);
    float4 r[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) r[i] = S[int64_t(d0 + i) * (kD / 4)];
    // conv history of the thread's channel (oldest first)
    float * convst = part == 0 ? a.conv_state_q : part == 1 ? a.conv_state_k : a.conv_state_v;
    float * hist = part < 3 ? convst + (int64_t(b.slot[s]) * HD + ch) * (kConvW - 1) : nullptr;
    float win[kConvW - 1];
#pragma unroll
    for (int j = 0; j < kConvW - 1; ++j) win[j] = part < 3 ? hist[j] : 0.0f;

    if (TRIGGER) pdl_enter();
    else pdl_wait();

    const float * xin = part == 0 ? a.q : part == 1 ? a.k : a.v;
    float * yconv = part == 0 ? a.y_q : part == 1 ? a.y_k : a.y_v;
    float * ynorm = part == 0 ? a.y_qn : a.y_kn;

    const int64_t t0 = b.seq_start[s], t1 = b.seq_start[s + 1];
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t tc = t * HD + ch;   // [T, H * KD] index of the thread's channel
        // 1. conv + SiLU (threads 0 .. 3 KD - 1); the low-rank inputs to shared memory; beta. The low-rank weights are
        // loaded first so that they are in flight during the conv.
        uint4 wf[kMaxChunks], wg[kMaxChunks];
#pragma unroll
        for (int i = 0; i < kMaxChunks; ++i) {
            wf[i] = wf_p && i < nf ? wf_p[4 * i] : make_uint4(0, 0, 0, 0);
            wg[i] = wg_p && i < ng ? wg_p[4 * i] : make_uint4(0, 0, 0, 0);
        }
        float val = 0.0f;
        if (part < 3) {
            const float xi = xin[tc];
            float acc = 0.0f;   // taps in order, the current input last (k_short_conv)
#pragma unroll
            for (int j = 0; j < kConvW - 1; ++j) acc += wc[j] * win[j];
            acc += wc[kConvW - 1] * xi;
            val = silu_d(acc);
            yconv[tc] = val;
#pragma unroll
            for (int j = 0; j + 1 < kConvW - 1; ++j) win[j] = win[j + 1];
            win[kConvW - 2] = xi;
            if (part == 2) s_v[c] = val;
            else {
                const float ss = warp_sum(val * val);
                if (lane == 0) red_l2[part][warp % kNW] = ss;
            }
        }
        if (a.f_b)
            for (int i = tid; i < a.Rf; i += 4 * kD) s_fa[i] = a.fa[t * a.Rf + i];
        if (a.g_b)
            for (int i = tid; i < a.Rg; i += 4 * kD) s_ga[i] = a.ga[t * a.Rg + i];
        if (tid == 0) s_beta = a.beta[t * H + h];
        __syncthreads();
        // 2. head L2 norms (q, k); f and the gate; z
        if (part < 2) {
            const float qk = val * rsqrtf(group_sum<kNW>(red_l2[part], lane) + a.l2_eps);
            ynorm[tc] = qk;
            (part == 0 ? s_q : s_k)[c] = qk;
        }
        const int64_t hrow = t * HD + int64_t(h) * kD;   // [T, H * KD] index of the head's first row
        if (a.f_b) {
            const float f = lowrank_row(wf, nf, rp, s_fa);
            if (rp == 0) {
                a.y_f[hrow + row] = f;
                const float g = kda_gate_value_d(a_exp, f + dtb_row, a.lower_bound);
                a.y_g[hrow + row] = g;
                s_g[row] = g;
            }
        } else if (tid < kD) {
            const float g = kda_gate_value_d(a_exp, a.f[hrow + tid] + dtb, a.lower_bound);
            a.y_g[hrow + tid] = g;
            s_g[tid] = g;
        }
        if (a.g_b) {
            const float z = lowrank_row(wg, ng, rp, s_ga);
            if (rp == 0) {
                a.y_z[hrow + row] = z;
                s_z[row] = z;
            }
        } else if (tid < kD) {
            s_z[tid] = a.z[hrow + tid];
        }
        __syncthreads();
        // 3. the delta-rule step (kda-step.cuh, as k_kda_scan_v2<KD / 16> with this tile as its blockIdx.x)
        {
            float kd[kRows], qd[kRows], ad[kRows];
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                kd[i] = s_k[d0 + i];
                qd[i] = s_q[d0 + i] * a.scale;
                ad[i] = expf(s_g[d0 + i]);
            }
            const float4 vv = make_float4(s_v[e], s_v[e + 1], s_v[e + 2], s_v[e + 3]);
            const float4 o = kda_v2_step<kRows>(r, kd, qd, ad, s_beta, vv, true, red_pred[tile], red_out[tile], wl, rl, cq);
            if (wl == 0 && rl == 0) {
                *reinterpret_cast<float4 *>(a.y_o + hrow + e) = o;
                s_o[e] = o.x;
                s_o[e + 1] = o.y;
                s_o[e + 2] = o.z;
                s_o[e + 3] = o.w;
            }
            __syncthreads();
        }
        // 4. gated RMSNorm over the head's KD values (k_norm<2> with KD threads)
        if (tid < kD) {
            const float o = s_o[tid];
            const float ss = warp_sum(o * o);
            if (lane == 0) red_n[warp] = ss;
        }
        __syncthreads();
        if (tid < kD) {
            const float inv = rsqrtf(group_sum<kNW>(red_n, lane) / float(kD) + a.norm_eps);
            a.y_on[hrow + tid] = s_o[tid] * inv * onw * sigmoid_d(s_z[tid]);
        }
        // The next token writes shared memory only after its first barrier, which every thread reaches after all of
        // its reads above: s_fa/s_ga/red_l2/s_v/s_beta/s_q/s_k/s_g/red_pred/red_out are read before this token's later
        // barriers, and s_z/s_o/red_n (read in 4, after the last barrier) are rewritten only after the next token's
        // barrier 1 (s_z) or later ones (s_o, red_n).
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) S[int64_t(d0 + i) * (kD / 4)] = r[i];
    if (part < 3) {
#pragma unroll
        for (int j = 0; j < kConvW - 1; ++j) hist[j] = win[j];
    }
}

// Grid (H, n_seq), 4 KD threads: KD / 32 scan tiles of 32 columns x 128 threads (k_kda_scan_v2's block), 3 KD conv
// channels, KD low-rank rows of 4 threads each. KD = K = V in {32, 64, 128}.
template <int KD>
__global__ void __launch_bounds__(4 * KD, 1) k_kda_decode_fused(kda_decode_args a, dbatch b) {
    kda_tail<KD, true>(a, b, int(blockIdx.x), int(blockIdx.y));
}

// ---- the tail and the layer's output projection in one persistent launch (kda_oproj_fused; one token) ----
// Why: in the graph the tail (32 blocks, latency-bound: ~6.5 us, the HBM idle) is followed by the o_proj GEMV, which
// can only start streaming its 18.9 MB (the 48B: [2304, 4096] BF16) once the tail has ended: ~14 us for the pair
// (session 23 H100 timeline: 6.5 + 7.8 exposed, with 8 MiB of o_proj asked into L2 by a side prefetch). Here the grid
// is every co-resident block of 4 KD threads; blocks 0 .. H - 1 run the tail of one head each while every warp of the
// other blocks holds one o_proj row in registers (loaded before the PDL wait: weights) and asks one more into L2, so
// most of the projection's bytes are on chip when the heads' counter completes. Then every block stages the gated norm's
// output (C floats) in shared memory, the preloaded rows are finished and the rest are strided over every warp.
// Arithmetic: the tail is kda_tail, so its outputs are the plain launch's bit for bit; each o_proj row is one warp's
// sum (moe-bf16-rows.cuh), not the GEMV kernel's order, then the epilogue's adds in the GEMV's order (y + r0, + r1).
constexpr int k_ko_threads = 4 * 128;   // the tail's block at K = V = 128
constexpr int k_ko_warps = k_ko_threads / 32;

template <int NU>
__global__ void __launch_bounds__(k_ko_threads, 1) k_kda_oproj_d1(kda_decode_args a, kda_oproj_args o, dbatch b, int fl) {
    constexpr int C = 256 * NU;   // the o_proj row: H * V values, 8 BF16 per lane per unit
    __shared__ __align__(16) float xs[C];
    const int tid = int(threadIdx.x), lane = tid & 31, wid = tid >> 5;
    const int G = int(gridDim.x), H = a.H, D = int(o.D), blk = int(blockIdx.x);
    const uint64_t pol = l2_stream_policy(fl & 2);
    unsigned * bar_heads = o.sync, * bar_exit = o.sync + 1;
    const unsigned heads_target = unsigned(H) + unsigned((fl & 4) != 0);   // fl bit 2: the timeout's control (tests)
    const int NT = G - H;                          // blocks without a head
    const int P = min(D, NT * k_ko_warps);         // rows held in registers before the wait (one per such warp)

    auto dot_store = [&](int r, const uint4 (&q)[NU]) {
        const float v = warp_sum(bf16_row_lane_dot<NU, XM_PLAIN>(q, xs, lane));
        if (lane == 0) {
            o.y[r] = v;
            if (o.z0) {
                const float z = v + o.res0[r];
                o.z0[r] = z;
                if (o.z1) o.z1[r] = z + o.res1[r];
            }
        }
    };
    // after the heads' counter: the gated norm's output (written by the head blocks) into shared memory, read past L1
    auto stage = [&]() {
        for (int i = tid; i < C / 4; i += k_ko_threads)
            reinterpret_cast<float4 *>(xs)[i] = __ldcg(reinterpret_cast<const float4 *>(a.y_on) + i);
        __syncthreads();
    };
    // rows P .. D - 1, strided over every warp of the grid (numbered across the SMs first)
    auto rest = [&]() {
        for (int r = P + wid * G + blk; r < D; r += G * k_ko_warps) {
            uint4 q[NU];
            bf16_row_issue<NU>(o.w, r, pol, lane, q);
            dot_store(r, q);
        }
    };

    if (blk < H) {
        kda_tail<128, false>(a, b, blk, 0);
        block_arrive(bar_heads);
        block_wait_count(bar_heads, heads_target, o.err);
        pdl_trigger();   // every block is resident by now or never triggers: the next grid waits for all of them
        stage();
        rest();
    } else {
        const int row = wid * NT + (blk - H);   // this warp's preloaded row
        uint4 q[NU];
        if (row < P) bf16_row_issue<NU>(o.w, row, pol, lane, q);
        // the rows after P into L2 (one bulk prefetch of a row per warp), so `rest` reads them from L2
        if (lane == 0 && P + row < D) prefetch_l2_bulk(static_cast<const char *>(o.w) + int64_t(P + row) * C * 2, C * 2);
        pdl_wait();
        block_wait_count(bar_heads, heads_target, o.err);
        pdl_trigger();
        stage();
        if (row < P) dot_store(row, q);
        rest();
    }
    grid_exit_reset(o.sync, 1, bar_exit);   // bar_heads
}

} // namespace

bool kda_decode_fused_supported(const kda_decode_args & a) {
    auto a16 = [](const void * p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
    const bool f_ok = a.f_b ? (a.fa && a.Rf >= 32 && a.Rf <= 32 * kMaxChunks && a.Rf % 32 == 0 && a16(a.f_b) && a.y_f)
                            : a.f != nullptr;
    const bool z_ok = a.g_b ? (a.ga && a.Rg >= 32 && a.Rg <= 32 * kMaxChunks && a.Rg % 32 == 0 && a16(a.g_b) && a.y_z)
                            : a.z != nullptr;
    return (a.K == 32 || a.K == 64 || a.K == 128) && a.V == a.K && a.W == kConvW && a.H >= 1 && f_ok && z_ok && a16(a.state) &&
           a16(a.y_o) && a.q && a.k && a.v && a.beta && a.conv_state_q && a.conv_state_k && a.conv_state_v && a.y_q && a.y_qn &&
           a.y_k && a.y_kn && a.y_v && a.y_g && a.y_on;
}

cudaError_t launch_kda_decode_fused(const kda_decode_args & a, const dbatch & b, cudaStream_t st) {
    if (!kda_decode_fused_supported(a)) return cudaErrorInvalidValue;
    if (b.n_seq == 0) return cudaGetLastError();
    const dim3 grid(unsigned(a.H), unsigned(b.n_seq));
    if (a.K == 128) launch_k(k_kda_decode_fused<128>, grid, 4 * 128, 0, st, a, b);
    else if (a.K == 64) launch_k(k_kda_decode_fused<64>, grid, 4 * 64, 0, st, a, b);
    else launch_k(k_kda_decode_fused<32>, grid, 4 * 32, 0, st, a, b);
    return cudaGetLastError();
}

bool kda_oproj_fused_supported_shape(int64_t H, int64_t K, int64_t V, int64_t D) {
    return K == 128 && V == 128 && H == 32 && D >= 1 && D <= (int64_t(1) << 20);
}

bool kda_oproj_fused_supported(const kda_decode_args & a, const kda_oproj_args & o) {
    auto a16 = [](const void * p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
    return kda_decode_fused_supported(a) && kda_oproj_fused_supported_shape(a.H, a.K, a.V, o.D) &&
           a16(a.y_on) && o.w && a16(o.w) && o.y && o.sync && o.err && (o.z0 != nullptr) == (o.res0 != nullptr) &&
           (o.z1 != nullptr) == (o.res1 != nullptr) && (!o.z1 || o.z0);
}

cudaError_t launch_kda_oproj_fused(const kda_decode_args & a, const kda_oproj_args & o, const dbatch & b, cudaStream_t st,
                                   int cfg) {
    if (!kda_oproj_fused_supported(a, o) || b.n_seq != 1) return cudaErrorInvalidValue;
    const int G = resident_grid<k_kda_oproj_d1<16>, k_ko_threads>();
    if (G < a.H + 1) return cudaErrorInvalidValue;   // at least one block beside the heads
    const int fl = (cfg / 1000 % 10 == 1 ? 2 : 0) |   // the weights' L2 policy evict_first (gemv_cfg's digit)
                   (cfg % 10 == 9 ? 4 : 0);          // tests: the heads' counter target one too high (must time out)
    return launch_k(k_kda_oproj_d1<16>, unsigned(G), k_ko_threads, 0, st, a, o, b, fl);
}

} // namespace perigee::cuda
