// y = x @ W.T for the few rows of a decode step (CPU, float32 and float64).
//
// A decode step multiplies 1 to ~16 token rows by every weight matrix of the model. At those
// widths the step is a stream of the weights from memory, and a good kernel reads each weight
// once at the memory's pace. MKL's sgemm does not at 2 to 16 rows on the CPUs measured here
// (an 8-row product costs 2-2.5x the time of a 1-row one for the same weight bytes), so the
// model's `linear` measures this kernel against MKL's two forms once per process and token
// count, and uses whichever is fastest (conveyor/model/layers.py).
//
// Shapes: x (N, K) contiguous, W (O, K) contiguous (torch's Linear layout), y (N, O).
// Work split: the output rows O are cut into one contiguous share per thread, so each thread
// streams its own part of W once, front to back (the hardware prefetcher sees one sequential
// stream); a thread done early takes over the back of another's (isa/balance.h).
// Register tile: R weight rows x TT token rows of vector accumulators. Per step of kLanes input
// columns: TT vectors of x (from L1: x is a few KiB), R vectors of W (from memory, once), R*TT
// FMAs. When N > TT the R weight rows are revisited for the next TT tokens from L1 (R rows of
// K values: at most 4 x 1536 x 4 B = 24 KiB here). The sums are reduced horizontally once per
// output value, after all K columns.
// Tiles: with 32 vector registers (AVX-512), R x TT = 8 x 1 for one row (8 independent FMA
// chains hide the FMA latency), 6 x 2, 4 x 3, 4 x 4 (+ 4 x and 4 W registers); with 16 (AVX2),
// 8 x 1, 4 x 2, 3 x 3. Vectors are 32 bytes (GCC vector extensions, -march=native), as in
// attention/paged_attention.cpp.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa/balance.h"
#include "ops.h"
#include "isa/vec.h"

namespace conveyor::gemm {

namespace {

using namespace conveyor::vec;
constexpr bool kManyRegisters = kRegisters >= 32;

// The lanes' sum as a tree (halves added): log2(kLanes) dependent adds, not kLanes.
template <typename T>
inline T reduce(Vec<T> v) {
  T lanes[kLanes<T>];
  std::memcpy(lanes, &v, sizeof(v));
  for (int width = kLanes<T> / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

// y[t][o] for o in [o0, o0 + R), t in [t0, t0 + TT).
template <typename T, int R, int TT>
inline void tile(const T* __restrict x, const T* __restrict w, T* __restrict y, int64_t k_dim,
                 int64_t out_dim, int64_t o0, int64_t t0) {
  Vec<T> acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = Vec<T>{};
  const T* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (o0 + r) * k_dim;
  const T* xr[TT];
  for (int t = 0; t < TT; ++t) xr[t] = x + (t0 + t) * k_dim;
  const int64_t k_vec = k_dim - k_dim % kLanes<T>;
  // The next tile's weight rows are prefetched during the first token group: with several
  // FMAs per weight value the loads come too slowly for the hardware prefetcher alone to keep
  // the memory busy (an 8-row product streamed 8.6 GB/s per core without this, 14 with).
  const int64_t ahead = t0 == 0 ? R * k_dim : 0;
  for (int64_t k = 0; k < k_vec; k += kLanes<T>) {
    if (ahead != 0 && k % (64 / sizeof(T)) == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(wr[r] + ahead + k);
    Vec<T> xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = load(xr[t] + k);
    for (int r = 0; r < R; ++r) {
      const Vec<T> wv = load(wr[r] + k);
      for (int t = 0; t < TT; ++t) acc[r][t] += wv * xv[t];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TT; ++t) {
      T sum = reduce<T>(acc[r][t]);
      for (int64_t k = k_vec; k < k_dim; ++k) sum += wr[r][k] * xr[t][k];
      y[(t0 + t) * out_dim + o0 + r] = sum;
    }
  }
}

// All N token rows against weight rows [o0, o0 + R): token groups of TT, then the rest.
template <typename T, int R, int TT>
inline void rows(const T* x, const T* w, T* y, int64_t n, int64_t k_dim, int64_t out_dim,
                 int64_t o0) {
  int64_t t = 0;
  for (; t + TT <= n; t += TT) tile<T, R, TT>(x, w, y, k_dim, out_dim, o0, t);
  for (; t < n; ++t) tile<T, R, 1>(x, w, y, k_dim, out_dim, o0, t);
}

template <typename T, int R, int TT>
void range(const T* x, const T* w, T* y, int64_t n, int64_t k_dim, int64_t out_dim, int64_t begin,
           int64_t end) {
  int64_t o = begin;
  for (; o + R <= end; o += R) rows<T, R, TT>(x, w, y, n, k_dim, out_dim, o);
  for (; o < end; ++o) rows<T, 1, TT>(x, w, y, n, k_dim, out_dim, o);
}

// range() over all output rows through balanced_for (isa/balance.h), in pieces of whole tiles of at
// least 8 rows: each thread streams its own contiguous share of W, and one that finishes first
// takes over the back of another's.
template <typename T, int R, int TT>
void balanced(const T* x, const T* w, T* y, int64_t n, int64_t k_dim, int64_t out_dim) {
  constexpr int64_t piece = R * ((8 + R - 1) / R);
  conveyor::balance::balanced_for(out_dim, piece, [&](int64_t begin, int64_t end) {
    range<T, R, TT>(x, w, y, n, k_dim, out_dim, begin, end);
  });
}

template <typename T>
void run(const T* x, const T* w, T* y, int64_t n, int64_t k_dim, int64_t out_dim) {
  if (n == 1) {
    balanced<T, 8, 1>(x, w, y, n, k_dim, out_dim);
  } else if (n == 2) {
    if constexpr (kManyRegisters) {
      balanced<T, 6, 2>(x, w, y, n, k_dim, out_dim);
    } else {
      balanced<T, 4, 2>(x, w, y, n, k_dim, out_dim);
    }
  } else if (n == 3 || !kManyRegisters) {
    if constexpr (kManyRegisters) {
      balanced<T, 4, 3>(x, w, y, n, k_dim, out_dim);
    } else {
      balanced<T, 3, 3>(x, w, y, n, k_dim, out_dim);
    }
  } else {
    balanced<T, 4, 4>(x, w, y, n, k_dim, out_dim);
  }
}

}  // namespace

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_gemm: x (N, K), weight (O, K)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && weight.is_contiguous() &&
                  x.device().is_cpu() && weight.device().is_cpu(),
              "small_gemm: CPU tensors of one dtype, contiguous weight");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "small_gemm", [&] {
    run<scalar_t>(xc.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), weight.size(0));
  });
  return y;
}

}  // namespace conveyor::gemm
