// MOE_EXPERTS grouped, T == 1, BF16 experts: the decode pair behind cuda_options::moe_decode_bf16 (Kimi-Linear-48B's
// routed experts: 256 experts, top-8, hidden 2304, moe_intermediate 1024). Dispatched by moe.cu's
// launch_moe_experts_grouped before the v4 kernels, where launch_moe_bf16_decode's shape conditions hold.
//
// Why (session 4 profile, H200, in isolation): v4's gate/up (k_moe_gate_up_v4<1,2,3>, 512 blocks of 8 warps) moves 75.6 MB
// in 24.9 us (3.0 TB/s) and its down + combine (k_moe_down_comb_v4<1,2,4,1>, 1152 blocks) 37.8 MB in 14.6 us (2.6 TB/s)
// against a 4.2 TB/s copy. What the v4 shapes cost on the 48B geometry:
//   - gate/up: each warp walks its 2 rows x 2 matrices in 3 dependent passes of 96 units (load 3 units per lane -> wait ->
//     math -> next); between passes the warp has nothing in flight, and every load carries the per-unit bounds and 64-bit
//     address math of the general loop.
//   - down + combine: 1152 blocks at 2 per SM are 4.36 waves of 264: the 5th wave runs 36% full (~13% of the kernel).
// This pair:
//   - gate/up: one warp per (slot, row): the lane's NU units of the gate row AND of the up row (nu = 32 NU units of 8
//     columns, 48B: NU = 9, 18 x 16 bytes per lane, 9.2 KB per warp) are all issued before any math, in one pass, with
//     compile-time offsets from one base (no bounds: the shapes are exact). Blocks of 4 warps, 4 per SM by the launch
//     bound: 2048 blocks for 48B = 3.88 "waves" of 528, with up to ~147 KB of weights in flight per SM.
//   - down + combine: v4's structure (the k slots on the 8 warps of a block, the combine summed in shared memory in slot
//     order) with R = 3 output rows per block where d_out % 3 == 0 (48B: 768 blocks = 2.91 waves of 264) and the same
//     lean loads; R = 2 with 3 blocks per SM otherwise (1152 blocks = 2.91 waves of 396 for 48B; bench cfg 1).
//   - weights loaded ld.global.nc.L1::no_allocate (streamed once: they must not evict x / h from L1), with the L2 policy
//     evict_first by default (cfg thousands digit, cuda_options::moe_bf16_evict_first: nor the step's other lines from L2).
// Arithmetic: exactly v4's (fp32; per lane the units lane + 32 i in increasing i, each unit an fma chain over its 8 columns
// from 0 added to the lane's sum; warp_sum; the activation; down's partial rows summed over slots in slot order), so y is
// bit for bit v4's (test-moe-cuda decode_bf16_t1 checks it).
//
// The shared expert as slot k (cuda_options::moe_shared_slot, launch_moe_bf16_decode_shared): the same pair with one more
// slot, SH = true. gate/up: grid (F / 4, k + 1), blockIdx.y == k (0 with early: cuda_options::moe_bf16_early, whose
// loads and, for the shared slot, whole computation come before the PDL wait; see the kernels) reads the shared expert's
// rows and writes its gate and up projections and the GLU product to the graph's own outputs (sh.gate / sh.up / sh.act;
// the down stage reads sh.act).
// down + combine: a ninth warp per block takes the shared slot's R rows (the 8 routed warps and their slots unchanged);
// the combine sums the routed slots exactly as before (y, written: the MOE_EXPERTS node), then adds the shared row last:
// sum = y + down_shared, and optionally sum2 = sum + res (the chained residual ADD). The shared expert's weights travel
// as a dexpert by value in the kernel arguments, not as entry E of the routed table: the table is cached per experts
// vector and uploaded once; an entry E would make id == E (the error the kernels flag) a valid read, and a table per
// (experts, shared expert) pair would be one more device allocation to keep in step with the weights. With SH false the
// kernels are the code above, unchanged (the template adds nothing), so the unfused path is bit for bit what it was.
// ptxas -v (sm_90a, session 6): every SH = false instantiation has the registers and spills of 235e12f^; SH = true at
// the 48B shapes: gate/up <9> 128 registers, down <4, 3, 1, 2> (R 3) 96, <4, 2, 1, 3> 72, no spills. Spills only at
// d_ff 2048 (NU 8): down <8, 3, 1, 2, true> 92 B (false: 16 B), <8, 2, 1, 3, true> 32 B (false: 36 B).
#include "backend/cuda/moe-bf16-rows.cuh"

namespace perigee::cuda {

namespace {

constexpr int k_bgu_warps = 4;   // gate/up: warps (rows) per block
constexpr int k_bdn_warps = 8;   // down: warps per block (slots j = warp + 8 s)

// hbuf [T k, F]: hbuf[j, row] = act(gate_e . x_t, up_e . x_t), e = ids[j], t = j / k; grid (F / 4, T k + SH), block 4
// warps, warp = row. Rows of nu = 32 NU units (Din = 256 NU), F % 4 == 0 (the launcher checks). SH (T == 1 only): slot k
// is the shared expert (sh).
template <int NU, bool SH>
__global__ void __launch_bounds__(k_bgu_warps * 32, 4) k_moe_bf16_gate_up_d1(const float * __restrict__ x,
                                                                         const int32_t * __restrict__ ids, int k,
                                                                         const dexpert * __restrict__ ex, int64_t E,
                                                                         dexperts_cfg c, float * __restrict__ hbuf,
                                                                         int * err, dmoe_shared sh, int fl,
                                                                         const int32_t * __restrict__ order) {
    const bool early = fl & 1;   // fl: bit 0 early (below), bit 1 the weights' L2 evict_first (l2_stream_policy)
    const uint64_t pol = l2_stream_policy(fl & 2);
    if (SH && sh.prefetch && blockIdx.y == 0 && threadIdx.x == 0) {   // weights only (dmoe_shared::prefetch)
        // block x of slot 0: the shared gate and up rows block x of the shared slot reads, and 1 / gridDim.x of down
        const int64_t rb = int64_t(k_bgu_warps) * (256 * NU) * 2;
        prefetch_l2_bulk(static_cast<const char *>(sh.w.gate.w) + blockIdx.x * rb, uint32_t(rb));
        prefetch_l2_bulk(static_cast<const char *>(sh.w.up.w) + blockIdx.x * rb, uint32_t(rb));
        const int64_t dn = sh.w.down.out * sh.w.down.in * 2, chunk = (dn / gridDim.x + 15) & ~int64_t(15);
        const int64_t off = blockIdx.x * chunk;
        if (off < dn) prefetch_l2_bulk(static_cast<const char *>(sh.w.down.w) + off, uint32_t(dn - off < chunk ? dn - off : chunk));
    }
    // early (SH only): the shared slot is blockIdx.y 0, the first blocks dispatched, so they are the ones resident while
    // the route still runs; it reads only x (the route's input: written before the launch before this one, so complete
    // once this grid runs at all under PDL) and its weights, so all of its work but the writes happens before the wait.
    int j = SH && early ? (blockIdx.y == 0 ? k : int(blockIdx.y) - 1) : int(blockIdx.y);
    const bool shared = SH && j == k;
    if (SH && early && shared) {
        const int lane = threadIdx.x & 31;
        const int row = int(blockIdx.x) * k_bgu_warps + int(threadIdx.x >> 5);
        const float2 gu = bf16_gate_up_row<NU, true>(sh.w.gate.w, sh.w.up.w, row, x, pol, lane);
        pdl_enter();   // nothing written before it
        if (lane == 0) {
            sh.gate[row] = gu.x;
            sh.up[row] = gu.y;
            sh.act[row] = bf16_glu(c, gu.x, gu.y);
        }
        return;
    }
    pdl_enter();
    if (!SH && order) j = order[blockIdx.y];      // the slots in expert order (launch_moe_bf16_decode)
    if (!SH) x += int64_t(j / k) * (256 * NU);   // the slot's token (the pair form, T > 1; T == 1: token 0)
    const int32_t e = shared ? 0 : ids[j];
    if (!shared && (e < 0 || e >= E)) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(err + ERR_EXPERT_ID, 1);
        return;
    }
    const int lane = threadIdx.x & 31;
    const int row = int(blockIdx.x) * k_bgu_warps + int(threadIdx.x >> 5);
    const float2 gu = bf16_gate_up_row<NU, false>(shared ? sh.w.gate.w : ex[e].gate.w, shared ? sh.w.up.w : ex[e].up.w, row,
                                                  x, pol, lane);
    const float ag = gu.x, au = gu.y;
    if (lane == 0) {
        const float h = bf16_glu(c, ag, au);
        if (shared) {   // the shared LINEARs' and the GLU node's outputs (the GLU product is the down stage's input)
            sh.gate[row] = ag;
            sh.up[row] = au;
            sh.act[row] = h;
        } else {
            hbuf[int64_t(j) * c.d_ff + row] = h;
        }
    }
}

// y [Dout] = sum_j w[j] down_{ids[j]} h_j in slot order (an invalid id contributes 0); grid (Dout / R, T): blockIdx.y is
// the token (ids, w, hbuf and y offset to its row: the pair form, T > 1, SH false), block of 8 warps:
// warp wd takes slots wd + 8 s (s < NS, k <= 8 NS) and R rows of each, every unit in flight together; the partial rows
// meet in shared memory and R threads sum them in slot order. Rows of nu = 32 NU units (F = 256 NU), Dout % R == 0.
// SH: a ninth warp computes the shared expert's R rows from sh.act; the combine then also writes sh.down, sh.sum = y +
// down_shared and (sh.sum2 != nullptr) sh.sum2 = sh.sum + sh.res.
template <int NU, int R, int NS, int MINB, bool SH>
__global__ void __launch_bounds__((k_bdn_warps + SH) * 32, MINB) k_moe_bf16_down_d1(const float * __restrict__ hbuf,
                                                                                const int32_t * __restrict__ ids,
                                                                                const float * __restrict__ w, int k,
                                                                                const dexpert * __restrict__ ex, int64_t E,
                                                                                dexperts_cfg c, float * __restrict__ y,
                                                                                dmoe_shared sh, int fl) {
    const bool early = fl & 1;   // fl as the gate/up kernel's
    const uint64_t pol = l2_stream_policy(fl & 2);
    // early: ids (the route's output, complete once this grid runs at all under PDL: the gate/up launch between waited
    // for it) and every weight load issued before the wait; h (the gate/up output) after it. Arithmetic unchanged.
    // h and the shared slot's act are read with __ldca (ld.global.ca: coherent, L1-cached), not __ldg: with the wait no
    // longer the kernel's first statement, the non-coherent read-only path read values the previous grid had not yet
    // written (session 9 call D: cfg 200, the shared slot written last by gate/up, gave a different shared down in
    // decode_bf16_shared_direct; a load the compiler may treat as invariant can be scheduled before the wait). __ldcg
    // (L2 only) fixed it at +0.05 ms on the 48B step (call E); __ldca fixed it at no cost (call G: 2.281 vs 2.330 ms,
    // every early form bitwise the run without over 10 repeats).
    if (!early) pdl_enter();
    if (!SH && blockIdx.y > 0) {   // the token's rows (pointer arithmetic only: nothing read before the wait)
        const int64_t t = blockIdx.y;
        ids += t * k;
        w += t * k;
        hbuf += t * k * c.d_ff;
        y += t * c.d_out;
    }
    __shared__ float part[k_bdn_warps * NS + SH][R];
    const int wd = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = int(blockIdx.x) * R;
    if (!SH || wd < k_bdn_warps) {   // the routed slots (SH false: the whole kernel body, as before)
        const uint4 * base[NS];
        bool ok[NS];
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            const int jj = wd + k_bdn_warps * s;
            const int32_t e = jj < k ? __ldcg(ids + jj) : -1;
            ok[s] = e >= 0 && e < E;
            base[s] = ok[s] ? static_cast<const uint4 *>(ex[e].down.w) + (r0 * (32 * NU) + lane) : nullptr;
        }
        uint4 q[NS][R][NU];
#pragma unroll
        for (int s = 0; s < NS; ++s)
            if (ok[s]) {
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < NU; ++i) q[s][r][i] = ld_stream_bf(base[s] + (r * (32 * NU) + 32 * i), pol);
            }
        if (early) pdl_enter();
#pragma unroll
        for (int s = 0; s < NS; ++s) {
            float acc[R];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.0f;
            if (ok[s]) {
                const float4 * hv = reinterpret_cast<const float4 *>(hbuf + int64_t(wd + k_bdn_warps * s) * c.d_ff) + 2 * lane;
#pragma unroll
                for (int i = 0; i < NU; ++i) {   // h by __ldca (coherent, ordered after the wait; see above)
                    const float4 x0 = __ldca(hv + 64 * i), x1 = __ldca(hv + 64 * i + 1);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += dot8_bf(q[s][r][i], x0, x1);
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < R; ++r) part[wd + k_bdn_warps * s][r] = acc[r];
            }
        }
    } else {   // SH: the shared slot, R rows of its down projection over the GLU product
        const uint4 * base = static_cast<const uint4 *>(sh.w.down.w) + (r0 * (32 * NU) + lane);
        uint4 q[R][NU];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < NU; ++i) q[r][i] = ld_stream_bf(base + (r * (32 * NU) + 32 * i), pol);
        if (early) pdl_enter();
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        const float4 * hv = reinterpret_cast<const float4 *>(sh.act) + 2 * lane;
#pragma unroll
        for (int i = 0; i < NU; ++i) {
            const float4 x0 = __ldca(hv + 64 * i), x1 = __ldca(hv + 64 * i + 1);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] += dot8_bf(q[r][i], x0, x1);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) part[k_bdn_warps * NS][r] = acc[r];
        }
    }
    __syncthreads();
    if (threadIdx.x < R) {
        float o = 0.0f;
        for (int jj = 0; jj < k; ++jj) {
            const int32_t e = ids[jj];
            const float v = (e >= 0 && e < E) ? part[jj][threadIdx.x] : 0.0f;
            o += w[jj] * v;
        }
        y[r0 + int(threadIdx.x)] = o;
        if (SH) {   // the shared expert added last, after the routed sum (forward.cpp moe_block: y = add(y, shared))
            const float d = part[k_bdn_warps * NS][threadIdx.x];
            const float sum = o + d;
            sh.down[r0 + int(threadIdx.x)] = d;
            sh.sum[r0 + int(threadIdx.x)] = sum;
            if (sh.sum2) sh.sum2[r0 + int(threadIdx.x)] = sum + sh.res[r0 + int(threadIdx.x)];
        }
    }
}

// sh: the shared slot when SH (else ignored: a zero dmoe_shared).
template <int NU, bool SH>
void launch_bf16_gate_up(const float * x, int64_t T, const int32_t * ids, int64_t k, const dexpert * ex, int64_t E,
                         const dexperts_cfg & c, float * hbuf, int * err, cudaStream_t st, const dmoe_shared & sh, int fl,
                         const int32_t * order) {
    launch_k(k_moe_bf16_gate_up_d1<NU, SH>, dim3(unsigned(c.d_ff / k_bgu_warps), unsigned(T * k + SH)), k_bgu_warps * 32, 0, st,
             x, ids, int(k), ex, E, c, hbuf, err, sh, fl, order);
}

template <int NU, int R, int NS, int MINB, bool SH>
void launch_bf16_down(const float * hbuf, int64_t T, const int32_t * ids, const float * w, int64_t k, const dexpert * ex,
                      int64_t E, const dexperts_cfg & c, float * y, cudaStream_t st, const dmoe_shared & sh, int fl) {
    launch_k(k_moe_bf16_down_d1<NU, R, NS, MINB, SH>, dim3(unsigned(c.d_out / R), unsigned(T)), (k_bdn_warps + SH) * 32, 0, st,
             hbuf, ids, w, int(k), ex, E, c, y, sh, fl);
}

// Down form for (k, d_out, cfg): 1 = R 3 / 2 blocks per SM (k <= 8, d_out % 3 == 0, cfg 0), 2 = R 2 / 3 blocks per SM
// (k <= 8), 3 = R 2 / NS 2 / 1 block per SM (k <= 16); 0: none.
int down_form(int64_t k, int64_t d_out, int cfg) {
    if (k <= k_bdn_warps) return (cfg == 0 && d_out % 3 == 0) ? 1 : d_out % 2 == 0 ? 2 : 0;
    if (k <= 2 * k_bdn_warps) return d_out % 2 == 0 ? 3 : 0;
    return 0;
}

template <int NU, bool SH>
void launch_bf16_down_nu(const float * hbuf, int64_t T, const int32_t * ids, const float * w, int64_t k, const dexpert * ex,
                         int64_t E, const dexperts_cfg & c, float * y, cudaStream_t st, int form, const dmoe_shared & sh, int fl) {
    if (form == 1) launch_bf16_down<NU, 3, 1, 2, SH>(hbuf, T, ids, w, k, ex, E, c, y, st, sh, fl);
    else if (form == 2) launch_bf16_down<NU, 2, 1, 3, SH>(hbuf, T, ids, w, k, ex, E, c, y, st, sh, fl);
    else launch_bf16_down<NU, 2, 2, 1, SH>(hbuf, T, ids, w, k, ex, E, c, y, st, sh, fl);
}

// Both stages (cfg's ones digit as in launch_moe_bf16_decode), routed only (SH false; T tokens) or with the shared slot
// (T == 1).
template <bool SH>
void launch_bf16_pair(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                      const dexpert * experts, int64_t E, const dexperts_cfg & c, float * hbuf, float * y, int * err,
                      cudaStream_t st, int cfg, const dmoe_shared & sh, const int32_t * order) {
    const int stage = cfg % 10;   // benchmarks: 1 gate/up alone, 2 down + combine alone
    // the loads before the PDL wait (cuda_options::moe_bf16_early): 1 = down and the shared slot, 2 = down only
    const int ed = cfg / 100 % 10;
    const bool early_sh = ed == 1, early_dn = ed == 1 || ed == 2;
    const int ef = cfg / 1000 % 10 == 1 ? 2 : 0;   // the weights' L2 policy evict_first (cuda_options::moe_bf16_evict_first)
    const int fl_gu = (early_sh ? 1 : 0) | ef, fl_dn = (early_dn ? 1 : 0) | ef;
    if (stage != 2) {
        switch (Din / 256) {
            case 4: launch_bf16_gate_up<4, SH>(x, T, ids, k, experts, E, c, hbuf, err, st, sh, fl_gu, order); break;
            case 8: launch_bf16_gate_up<8, SH>(x, T, ids, k, experts, E, c, hbuf, err, st, sh, fl_gu, order); break;
            default: launch_bf16_gate_up<9, SH>(x, T, ids, k, experts, E, c, hbuf, err, st, sh, fl_gu, order); break;
        }
    }
    if (stage != 1) {
        const int form = down_form(k, c.d_out, cfg % 100 / 10);
        if (c.d_ff / 256 == 4) launch_bf16_down_nu<4, SH>(hbuf, T, ids, w, k, experts, E, c, y, st, form, sh, fl_dn);
        else launch_bf16_down_nu<8, SH>(hbuf, T, ids, w, k, experts, E, c, y, st, form, sh, fl_dn);
    }
}

} // namespace

bool moe_bf16_decode_supported(int64_t Din, int64_t k, const dexperts_cfg & c, int cfg) {
    if (k < 1 || Din % 256 != 0 || c.d_ff % 256 != 0 || c.d_ff % k_bgu_warps != 0) return false;
    const int64_t nu_gu = Din / 256, nu_dn = c.d_ff / 256;
    if (nu_gu != 4 && nu_gu != 8 && nu_gu != 9) return false;
    if (nu_dn != 4 && nu_dn != 8) return false;
    // 32-bit offsets: rows * units of the largest matrix
    if (c.d_ff * (Din / 8) >= (int64_t(1) << 31) || c.d_out * (c.d_ff / 8) >= (int64_t(1) << 31)) return false;
    return down_form(k, c.d_out, cfg % 100 / 10) != 0;
}

bool launch_moe_bf16_decode(const float * x, int64_t T, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                            const dexpert * experts, int64_t E, const dexperts_cfg & c, float * hbuf, float * y, int * err,
                            cudaStream_t st, int cfg, const int32_t * order) {
    if (!moe_bf16_decode_supported(Din, k, c, cfg) || T < 1 || T * k > 65535) return false;
    launch_bf16_pair<false>(x, T, Din, ids, w, k, experts, E, c, hbuf, y, err, st, cfg, dmoe_shared{}, order);
    return true;
}

bool moe_bf16_shared_supported(int64_t Din, int64_t d_ff, int64_t d_out, int64_t k) {
    // the routed pair's shapes (the shared slot reuses its NU / R / NS instantiations) and 16-byte aligned rows
    const dexperts_cfg c{0, 1.0f, 0.0f, d_ff, d_out};
    return moe_bf16_decode_supported(Din, k, c, 0);
}

cudaError_t launch_moe_bf16_decode_shared(const float * x, int64_t Din, const int32_t * ids, const float * w, int64_t k,
                                          const dexpert * experts, int64_t E, const dexperts_cfg & c, const dmoe_shared & sh,
                                          float * hbuf, float * y, int * err, cudaStream_t st, int cfg) {
    if (!moe_bf16_decode_supported(Din, k, c, cfg)) return cudaErrorInvalidValue;   // (moe_bf16_shared_supported at cfg 0)
    if (sh.w.gate.type != wtype::BF16 || sh.w.up.type != wtype::BF16 || sh.w.down.type != wtype::BF16 || sh.w.gate.fmt != 0 ||
        sh.w.up.fmt != 0 || sh.w.down.fmt != 0 || !sh.w.gate.w || !sh.w.up.w || !sh.w.down.w)
        return cudaErrorInvalidValue;
    if (sh.w.gate.out != c.d_ff || sh.w.gate.in != Din || sh.w.up.out != c.d_ff || sh.w.up.in != Din || sh.w.down.out != c.d_out ||
        sh.w.down.in != c.d_ff)
        return cudaErrorInvalidValue;
    if (!sh.gate || !sh.up || !sh.act || !sh.down || !sh.sum || (sh.sum2 != nullptr) != (sh.res != nullptr))
        return cudaErrorInvalidValue;
    // The kernels read x, h, act and the weights as float4 / uint4 and write the outputs by float4 where they can.
    auto a16 = [](const void * p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
    for (const void * p : {static_cast<const void *>(x), static_cast<const void *>(hbuf), static_cast<const void *>(y),
                           static_cast<const void *>(sh.gate), static_cast<const void *>(sh.up),
                           static_cast<const void *>(sh.act), static_cast<const void *>(sh.down),
                           static_cast<const void *>(sh.sum), sh.w.gate.w, sh.w.up.w, sh.w.down.w})
        if (!a16(p)) return cudaErrorInvalidValue;
    if (sh.res && (!a16(sh.res) || !a16(sh.sum2))) return cudaErrorInvalidValue;
    launch_bf16_pair<true>(x, 1, Din, ids, w, k, experts, E, c, hbuf, y, err, st, cfg, sh, nullptr);
    return cudaGetLastError();
}

} // namespace perigee::cuda
