// On-device sampling (issue 7 item 2): one id per logits row, so the host reads R ids per step instead of
// R x V floats. The math is the host sampler's step 3 (runtime/sampler.h; backend.h sample_row_reference):
//   temperature == 0: argmax, ties to the lower id;
//   otherwise: rows sorted by (logit descending, id ascending); top-k keeps the first k; p_i = exp(l_i / T - l_0 / T)
//   in double, normalised by their sum; top-p keeps the smallest prefix whose cumulative mass reaches top_p; min-p
//   keeps the prefix of p_i >= min_p * p_0 (at least one); the pick is the first i with u * mass < c_i (c the
//   cumulative of the normalised p, mass = c at the last kept index), else the last kept token.
// Kernels: k_sample_argmax (one block per row: the greedy id and the row's finiteness), a CUB segmented radix sort
// (stable, descending; -0.0 == +0.0 like the host's comparison) of the sampled rows' (logit, id) pairs, then
// k_sample_pick (one block per sampled row: sum, block scans of the cumulative mass, the cut and the pick).
// AGREEMENT WITH THE HOST. Greedy: bitwise the same id. Sampled: the same sorted order (exact), the same p_i up to
// CUDA's exp (<= 1 ulp in double vs glibc); the sums and the cumulative c_i are a parallel scan in double instead of
// the host's sequential loop (relative differences ~1e-16). So the ids agree unless top_p or u * mass lies within
// ~1e-13 (relative) of a cumulative boundary c_i: an exact floating tie in practice (test-sample-cuda counts them).
#include "backend/cuda/common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <vector>

namespace perigee::cuda {
namespace {

constexpr int k_threads = 1024;
constexpr int k_items = 4;   // per thread per tile of the scans
constexpr int k_tile = k_threads * k_items;

struct arg_best {
    float v;
    int i;
    int bad;   // a non-finite value was seen
};

struct arg_op {
    __device__ arg_best operator()(const arg_best & a, const arg_best & b) const {
        arg_best r;
        r.bad = a.bad | b.bad;
        const bool take_b = b.i >= 0 && (a.i < 0 || b.v > a.v || (b.v == a.v && b.i < a.i));
        r.v = take_b ? b.v : a.v;
        r.i = take_b ? b.i : a.i;
        return r;
    }
};

// ids[r] = argmax of row r (ties to the lower id), or -1 when the row holds a NaN/Inf.
__global__ void __launch_bounds__(k_threads) k_sample_argmax(const float * __restrict__ x, int64_t V, int32_t * ids) {
    pdl_enter();
    using reduce = cub::BlockReduce<arg_best, k_threads>;
    __shared__ typename reduce::TempStorage tmp;
    const float * row = x + int64_t(blockIdx.x) * V;
    arg_best b{0.0f, -1, 0};
    for (int64_t i = threadIdx.x; i < V; i += k_threads) {
        const float v = row[i];
        if (!isfinite(v)) b.bad = 1;
        else if (b.i < 0 || v > b.v) b = {v, int(i), b.bad};   // strided ascending: the first max wins per thread
    }
    const arg_best r = reduce(tmp).Reduce(b, arg_op{});
    if (threadIdx.x == 0) ids[blockIdx.x] = r.bad ? -1 : r.i;
}

__global__ void k_sample_iota(int32_t * v, int64_t V, int n_rows) {
    pdl_enter();
    const int64_t n = V * n_rows;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        v[i] = int32_t(i % V);
}

struct pick_param {
    float temperature, top_p, min_p;
    int top_k;
    double u;
};

// Block j samples logits row rows_out[j]: keys/vals [R, V] hold that row's logits and ids sorted (descending, stable)
// at the row's own offset. Writes ids[rows_out[j]] unless k_sample_argmax marked the row non-finite (-1).
__global__ void __launch_bounds__(k_threads) k_sample_pick(const float * __restrict__ keys, const int32_t * __restrict__ vals,
                                                           int64_t V, const pick_param * __restrict__ prm,
                                                           const int32_t * __restrict__ rows_out, int32_t * ids) {
    pdl_enter();
    using reduce_d = cub::BlockReduce<double, k_threads>;
    using reduce_i = cub::BlockReduce<int64_t, k_threads>;
    using scan_d = cub::BlockScan<double, k_threads>;
    __shared__ union {
        typename reduce_d::TempStorage rd;
        typename reduce_i::TempStorage ri;
        typename scan_d::TempStorage sc;
    } tmp;
    __shared__ double s_sum, s_carry;
    __shared__ int64_t s_first;
    const pick_param P = prm[blockIdx.x];
    const int out = rows_out[blockIdx.x];
    if (ids[out] < 0) return;   // non-finite row (k_sample_argmax): the engine fails the request
    const float * key = keys + int64_t(out) * V;
    const int32_t * val = vals + int64_t(out) * V;
    const int64_t n = (P.top_k > 0 && P.top_k < V) ? int64_t(P.top_k) : V;
    const double inv_t = 1.0 / double(P.temperature);
    const double mx = double(key[0]) * inv_t;
    auto e = [&](int64_t i) { return exp(double(key[i]) * inv_t - mx); };

    // 1. sum of the unnormalised p over the first n.
    double part = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += k_threads) part += e(i);
    double tot = reduce_d(tmp.rd).Sum(part);
    if (threadIdx.x == 0) s_sum = tot;
    __syncthreads();
    const double sum = s_sum;
    const double p0 = 1.0 / sum;   // p_0 = exp(0) / sum

    // The first index in [0, lim) at which pred(i, c_i, p_i) holds (c = the inclusive cumulative of the normalised
    // p, recomputed by the same tiled scan every time so every pass sees the same c_i); lim when none.
    auto first_where = [&](int64_t lim, auto pred) -> int64_t {
        if (threadIdx.x == 0) {
            s_carry = 0.0;
            s_first = lim;
        }
        __syncthreads();
        for (int64_t t0 = 0; t0 < lim; t0 += k_tile) {
            double p[k_items], c[k_items];
            for (int k = 0; k < k_items; ++k) {
                const int64_t i = t0 + int64_t(threadIdx.x) * k_items + k;
                p[k] = i < lim ? e(i) / sum : 0.0;
            }
            double agg;
            scan_d(tmp.sc).InclusiveSum(p, c, agg);
            const double carry = s_carry;
            int64_t mine = lim;
            for (int k = 0; k < k_items; ++k) {
                const int64_t i = t0 + int64_t(threadIdx.x) * k_items + k;
                if (i < lim && mine == lim && pred(i, carry + c[k], p[k])) mine = i;
            }
            __syncthreads();   // everyone has read s_carry; tmp is reused
            const int64_t f = reduce_i(tmp.ri).Reduce(mine, [](int64_t a, int64_t b) { return a < b ? a : b; });
            if (threadIdx.x == 0) {
                s_carry = carry + agg;
                if (f < s_first) s_first = f;
            }
            __syncthreads();
            if (s_first < lim) break;
        }
        const int64_t r = s_first;
        __syncthreads();
        return r;
    };
    // 2. top-p: keep i + 1 where i is the first index with c_i >= top_p.
    int64_t keep = n;
    if (P.top_p < 1.0f) {
        const double tp = double(P.top_p);
        const int64_t i = first_where(n, [&](int64_t, double c, double) { return c >= tp; });
        if (i < n) keep = i + 1;
    }
    // 3. min-p: the prefix of p_i >= min_p * p_0 (index 0 always kept).
    if (P.min_p > 0.0f && keep > 1) {
        const double floor = double(P.min_p) * p0;
        const int64_t i = first_where(keep, [&](int64_t j, double, double p) { return j >= 1 && p < floor; });
        keep = i;   // i >= 1 (index 0 never matches); keep when none
    }
    // 4. mass = c_{keep-1}; the pick: the first i < keep with u * mass < c_i, else keep - 1.
    double mass = 0.0;
    {
        // c_{keep-1} by the same scan: the first index at or after keep-1 (pred true only there) reports it.
        __shared__ double s_mass;
        first_where(keep, [&](int64_t j, double c, double) {
            if (j == keep - 1) s_mass = c;
            return false;
        });
        mass = s_mass;
    }
    const double target = P.u * mass;
    const int64_t i = first_where(keep, [&](int64_t, double c, double) { return target < c; });
    if (threadIdx.x == 0) ids[out] = val[i < keep ? i : keep - 1];
}

} // namespace

cudaError_t sample_rows(const float * logits, int R, int64_t V, const sample_row_param * prm, int32_t * ids_host,
                        cudaStream_t st) {
    if (R <= 0) return cudaSuccess;
    int32_t * d_ids = nullptr;
    cudaError_t err = cudaMallocAsync(&d_ids, sizeof(int32_t) * size_t(R), st);
    if (err != cudaSuccess) return err;
    launch_k(k_sample_argmax, R, k_threads, 0, st, logits, V, d_ids);
    std::vector<pick_param> pp;
    std::vector<int32_t> rows_out;
    std::vector<int> begin;
    for (int r = 0; r < R; ++r)
        if (prm[r].temperature != 0.0f) {
            pp.push_back({prm[r].temperature, prm[r].top_p, prm[r].min_p, prm[r].top_k, prm[r].u});
            rows_out.push_back(r);
            begin.push_back(int(int64_t(r) * V));
        }
    const int S = int(pp.size());
    void * scratch = nullptr;
    if (S > 0 && (err = cudaGetLastError()) == cudaSuccess) {
        // Segment j is row rows_out[j] of the logits ([R, V]); CUB's segments need not be contiguous, but in and out
        // share the offsets, so the sorted buffers are [R, V] too and the picks read them at the row's own offset
        // (rows that sample nothing are untouched there).
        std::vector<int> end(begin);
        for (auto & x : end) x += int(V);
        size_t tmp_bytes = 0;
        err = cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, tmp_bytes, logits, (float *)nullptr,
                                                                 (const int32_t *)nullptr, (int32_t *)nullptr, int(R * V),
                                                                 S, (int *)nullptr, (int *)nullptr, 0, 32, st);
        const size_t kv = size_t(R) * size_t(V);
        const size_t off_vals_in = kv * sizeof(float), off_vals_out = off_vals_in + kv * sizeof(int32_t),
                     off_begin = off_vals_out + kv * sizeof(int32_t), off_end = off_begin + sizeof(int) * S,
                     off_pp = (off_end + sizeof(int) * S + 15) / 16 * 16, off_rows = off_pp + sizeof(pick_param) * S,
                     off_tmp = (off_rows + sizeof(int32_t) * S + 255) / 256 * 256;
        if (err == cudaSuccess) err = cudaMallocAsync(&scratch, off_tmp + tmp_bytes, st);
        if (err == cudaSuccess) {
            char * b = static_cast<char *>(scratch);
            float * keys_out = reinterpret_cast<float *>(b);
            int32_t * vals_in = reinterpret_cast<int32_t *>(b + off_vals_in);
            int32_t * vals_out = reinterpret_cast<int32_t *>(b + off_vals_out);
            int * d_begin = reinterpret_cast<int *>(b + off_begin);
            int * d_end = reinterpret_cast<int *>(b + off_end);
            pick_param * d_pp = reinterpret_cast<pick_param *>(b + off_pp);
            int32_t * d_rows = reinterpret_cast<int32_t *>(b + off_rows);
            // The uploads come from host vectors that live until the synchronize below.
            cudaMemcpyAsync(d_begin, begin.data(), sizeof(int) * S, cudaMemcpyHostToDevice, st);
            cudaMemcpyAsync(d_end, end.data(), sizeof(int) * S, cudaMemcpyHostToDevice, st);
            cudaMemcpyAsync(d_pp, pp.data(), sizeof(pick_param) * S, cudaMemcpyHostToDevice, st);
            cudaMemcpyAsync(d_rows, rows_out.data(), sizeof(int32_t) * S, cudaMemcpyHostToDevice, st);
            launch_k(k_sample_iota, 264, 256, 0, st, vals_in, V, R);
            err = cub::DeviceSegmentedRadixSort::SortPairsDescending(b + off_tmp, tmp_bytes, logits, keys_out, vals_in,
                                                                     vals_out, int(R * V), S, d_begin, d_end, 0, 32, st);
            if (err == cudaSuccess) {
                launch_k(k_sample_pick, S, k_threads, 0, st, keys_out, vals_out, V, d_pp, d_rows, d_ids);
                err = cudaGetLastError();
            }
        }
    }
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpyAsync(ids_host, d_ids, sizeof(int32_t) * size_t(R), cudaMemcpyDeviceToHost, st);
    if (scratch) cudaFreeAsync(scratch, st);
    cudaFreeAsync(d_ids, st);
    const cudaError_t sync = cudaStreamSynchronize(st);
    return err != cudaSuccess ? err : sync;
}

} // namespace perigee::cuda
