// INDEXER_TOPK (K3.1 Lightning Indexer): write ki into the key pages, score every position 0..pos, then the
// exact top-k with the tie rule. Position p is selected iff its rank (positions with a larger score, plus
// positions with an equal score and a lower index) is below topk: that is the set {score > theta} followed by
// {score == theta} by ascending position, cut at topk, as ir/op.h states. O(n^2) per token: correct first.
#include "backend/cuda/common.cuh"

namespace perigee::cuda {

namespace {

__device__ __forceinline__ int64_t key_row(const dbatch & b, int s, int64_t pos) {
    const int32_t page = b.block_table[int64_t(s) * b.max_pages + pos / b.page_size];
    return int64_t(page) * b.page_size + pos % b.page_size;
}

__global__ void k_indexer_write(const float * __restrict__ ki, int64_t d, float * __restrict__ kcache, dbatch b) {
    pdl_enter();
    const int64_t t = blockIdx.x;
    const int s = b.tok_seq[t];
    const int64_t pos = b.pos0[s] + t - b.seq_start[s];
    float * row = kcache + key_row(b, s, pos) * d;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) row[i] = ki[t * d + i];
}

// score [T, max_pos]: warp per (t, p).
__global__ void k_indexer_score(const float * __restrict__ qi, const float * __restrict__ wi, int64_t I, int64_t d,
                                float scale, const float * __restrict__ kcache, dbatch b, float * __restrict__ score) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int64_t t = blockIdx.y;
    const int64_t p = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int s = b.tok_seq[t];
    const int64_t pos = b.pos0[s] + t - b.seq_start[s];
    if (p > pos) return;
    const float * kp = kcache + key_row(b, s, p) * d;
    float acc = 0.0f;
    for (int64_t h = 0; h < I; ++h) {   // fixed head order
        const float * qh = qi + (t * I + h) * d;
        float dot = 0.0f;
        for (int64_t i = lane; i < d; i += 32) dot += qh[i] * kp[i];
        dot = warp_sum(dot);
        acc += wi[t * I + h] * fmaxf(dot, 0.0f);
    }
    if (lane == 0) score[t * b.max_pos + p] = scale * acc;
}

constexpr int k_sel_threads = 256;

__global__ void __launch_bounds__(k_sel_threads) k_indexer_select(const float * __restrict__ score, int64_t topk, dbatch b,
                                                                  int32_t * __restrict__ sel) {
    pdl_enter();
    __shared__ int warp_cnt[k_sel_threads / 32];
    __shared__ int base;
    const int64_t t = blockIdx.x;
    const int s = b.tok_seq[t];
    const int64_t n = b.pos0[s] + t - b.seq_start[s] + 1;
    const float * sc = score + t * b.max_pos;
    int32_t * out = sel + t * topk;
    for (int64_t j = threadIdx.x; j < topk; j += blockDim.x) out[j] = -1;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
        const int64_t p = c0 + threadIdx.x;
        bool take = false;
        if (p < n) {
            if (n <= topk) {
                take = true;
            } else {
                const float sp = sc[p];
                int64_t rank = 0;
                for (int64_t q2 = 0; q2 < n && rank < topk; ++q2) {
                    const float sq = sc[q2];
                    rank += (sq > sp) || (sq == sp && q2 < p);
                }
                take = rank < topk;
            }
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, take);
        if (lane == 0) warp_cnt[wid] = __popc(ballot);
        __syncthreads();
        int before = base;
        for (int w = 0; w < wid; ++w) before += warp_cnt[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (take && before < topk) out[before] = int32_t(p);
        __syncthreads();
        if (threadIdx.x == 0) {
            int tot = 0;
            for (int w = 0; w < int(blockDim.x >> 5); ++w) tot += warp_cnt[w];
            base += tot;
        }
        __syncthreads();
    }
}

} // namespace

cudaError_t launch_indexer_topk(const float * qi, const float * ki, const float * wi, int64_t n_head, int64_t head_dim,
                                int64_t topk, float scale, float * kcache, const dbatch & b, float * scratch, int32_t * sel,
                                cudaStream_t st) {
    const int64_t T = b.n_tok;
    if (T == 0) return cudaGetLastError();
    launch_k(k_indexer_write, unsigned(T), 128, 0, st, ki, head_dim, kcache, b);
    launch_k(k_indexer_score, dim3(grid_for(b.max_pos, 8), unsigned(T)), 256, 0, st, qi, wi, n_head, head_dim, scale, kcache, b,
                                                                              scratch);
    launch_k(k_indexer_select, unsigned(T), k_sel_threads, 0, st, scratch, topk, b, sel);
    return cudaGetLastError();
}

} // namespace perigee::cuda
