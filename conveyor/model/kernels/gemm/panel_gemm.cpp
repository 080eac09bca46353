// y = x @ W^T for every row count with one reduction order per output value: the projections
// of a batch-invariant model (CPU; float32 and float64 dense weights, GGUF-style q4/q8 blocks).
//
// Why one kernel for every row count: a row's result must not depend on how many other rows
// share its step, where it sits in the step, or how its prompt was chunked (a prefix-cache
// hit computes the same positions in another chunk). MKL, fbgemm and the earlier small-row and
// block kernels each sum in their own order, and the model picked between them by row count,
// so a warm request differed from a cold one in the last bits and then in its greedy tokens.
// Here each output value y[t][n] is one chain of fused multiply-adds over k in increasing
// order, whatever the tile, the thread or the instruction set computes it:
//   dense:        acc = fma(x[t][k], W[n][k], acc)                      for k = 0 .. K-1
//   blocks (int8 activations, per block b of 32: xq = round(x / xd), xd = max|x| / 127):
//                 isum = sum_j q[n][j] xq[t][j]            (an exact integer dot product)
//                 acc = fma(dw[n][b] * xd[t][b], float(isum), acc)
//                 q4: acc = fma(mw[n][b], xs[t][b], acc)   (xs = xd * sum_j xq[t][j])
//   blocks, float activations (the lm_head: logits pick the token, so its inputs stay float):
//                 part = fma(x[t][k], q[n][k], part)     for k in block b, part from 0
//                 acc = fma(part, dw[n][b], acc)
//                 q4: acc = fma(xsum[t][b], mw[n][b], acc)   (xsum: the block's x summed in order)
// The vector lanes hold output columns, never parts of k: there is no horizontal sum, so the
// order is the same on AVX-512 (16 lanes), AVX2 (two 8-lane halves) and the scalar fallback
// (std::fma), and the three give the same bits (the tests compare them).
//
// Weights are packed once at load into panels of 64 bytes of output columns (16 floats,
// 8 doubles, 16 block columns):
//   dense   (P, K, L)          panel p holds columns [pL, pL + L) for every k, zero-padded;
//   blocks  (P, nb, C, 64) u8  per panel and block, C chunks of 64 bytes = 16 columns x 4 k:
//             q8: chunk g holds k = 4g .. 4g+3 (C = 8), bytes q ^ 0x80 (unsigned, q + 128);
//             q4: chunk g holds k = 4g .. 4g+3 in its low nibbles and k = 16+4g .. 19+4g in
//                 its high ones (C = 4);
//           (P, nb, 16) int16  dw and mw as float16 bits (converted exactly when used);
//   blocks for float activations (pack_blocks(..., float_acts=True)): (P, K, 16) int8, the
//           values q of 16 columns for each k (q4: 0..15), and the same dw, mw.
// The integer dot products: AVX-512 VNNI's vpdpbusd (unsigned weight bytes x signed
// activations; q8's + 128 is taken off by starting the sum at -128 * sum_j xq[j]); AVX2's
// maddubs + madd (q8 with the signed weights and the sign trick, so no pair sum overflows; q4
// sums a whole block in int16 lanes first, which cannot overflow: Avx2Blocks::dot_q4).
//
// Work split: threads take groups of NP panels (balanced_for); inside, tokens in tiles of TT
// rows. A tile keeps TT x NP vector accumulators in registers and reads each weight vector
// once for its TT rows. The instruction set is chosen at run time: AVX-512 where the CPU and
// the build have it, unless set_isa (called once at load with the kernel plan's choice,
// model/plan.py) asks for a narrower one. isa_runs counts the calls each set ran.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <limits>
#include <map>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_PANEL_AVX2 1
#else
#define CONVEYOR_PANEL_AVX2 0
#endif
#if CONVEYOR_PANEL_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define CONVEYOR_PANEL_AVX512 1
#else
#define CONVEYOR_PANEL_AVX512 0
#endif

#include "isa/balance.h"
#include "ops.h"

namespace conveyor::gemm::panel {

constexpr int64_t kPanelBytes = 64;
constexpr int64_t QK = 32;
constexpr int64_t kCols = 16;  // block columns per panel

// ------------------------------------------------------------------------ instruction sets

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int best_isa() {
#if CONVEYOR_PANEL_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return kAvx512;
#endif
#if CONVEYOR_PANEL_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{best_isa()};
  return isa;
}

// Calls of dense_linear and block_linear per instruction set (tests: the plan is what runs).
std::array<std::atomic<int64_t>, 3>& runs() {
  static std::array<std::atomic<int64_t>, 3> counts{};
  return counts;
}

// The instruction set a kernel call runs, counted once per call.
int running_isa() {
  const int isa = current_isa().load();
  runs()[isa].fetch_add(1, std::memory_order_relaxed);
  return isa;
}

const char* isa_name(int isa) {
  return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar";
}

std::string get_isa() { return isa_name(current_isa().load()); }

std::string best_isa_name() { return isa_name(best_isa()); }

std::map<std::string, int64_t> isa_runs() {
  std::map<std::string, int64_t> out;
  for (int isa = kScalar; isa <= kAvx512; ++isa) out[isa_name(isa)] = runs()[isa].load();
  return out;
}

std::string set_isa(const std::string& name) {
  const int best = best_isa();
  int want = name == "scalar" ? kScalar : name == "avx2" ? kAvx2 : name == "avx512" ? kAvx512 : -1;
  TORCH_CHECK(want >= 0 || name == "auto", "set_isa: auto, avx512, avx2 or scalar");
  if (want < 0) want = best;
  TORCH_CHECK(want <= best, "set_isa: this CPU or build runs at most ", isa_name(best));
  current_isa().store(want);
  return isa_name(want);
}

// ------------------------------------------------------------------------ float lanes
// A panel row of L = 64 / sizeof(T) values as one "vector": F::fma(a, w, acc) is acc + a * w,
// fused, lane by lane.

template <typename T, int Isa>
struct Lanes;

template <typename T>
struct Lanes<T, kScalar> {
  static constexpr int L = kPanelBytes / sizeof(T);
  using V = std::array<T, L>;
  static V zero() { return V{}; }
  static V load(const T* p) {
    V v;
    std::memcpy(v.data(), p, sizeof(v));
    return v;
  }
  static void store(T* p, const V& v) { std::memcpy(p, v.data(), sizeof(v)); }
  static V fma(T a, const V& w, V acc) {
    for (int i = 0; i < L; ++i) acc[i] = std::fma(a, w[i], acc[i]);
    return acc;
  }
};

#if CONVEYOR_PANEL_AVX2
template <>
struct Lanes<float, kAvx2> {
  static constexpr int L = 16;
  struct V {
    __m256 a, b;
  };
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, const V& v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  static V fma(float a, const V& w, const V& acc) {
    const __m256 s = _mm256_set1_ps(a);
    return {_mm256_fmadd_ps(s, w.a, acc.a), _mm256_fmadd_ps(s, w.b, acc.b)};
  }
};
template <>
struct Lanes<double, kAvx2> {
  static constexpr int L = 8;
  struct V {
    __m256d a, b;
  };
  static V zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static V load(const double* p) { return {_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)}; }
  static void store(double* p, const V& v) {
    _mm256_storeu_pd(p, v.a);
    _mm256_storeu_pd(p + 4, v.b);
  }
  static V fma(double a, const V& w, const V& acc) {
    const __m256d s = _mm256_set1_pd(a);
    return {_mm256_fmadd_pd(s, w.a, acc.a), _mm256_fmadd_pd(s, w.b, acc.b)};
  }
};
#endif

#if CONVEYOR_PANEL_AVX512
template <>
struct Lanes<float, kAvx512> {
  static constexpr int L = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(float a, V w, V acc) { return _mm512_fmadd_ps(_mm512_set1_ps(a), w, acc); }
};
template <>
struct Lanes<double, kAvx512> {
  static constexpr int L = 8;
  using V = __m512d;
  static V zero() { return _mm512_setzero_pd(); }
  static V load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
  static V fma(double a, V w, V acc) { return _mm512_fmadd_pd(_mm512_set1_pd(a), w, acc); }
};
#endif

// Stores a tile's NP panels of one row into y[n0 ..), the last panel cut at n_out.
template <typename T, typename F>
inline void store_row(T* y, int64_t n0, int64_t n_out, const typename F::V& v) {
  if (n0 + F::L <= n_out) {
    F::store(y + n0, v);
  } else if (n0 < n_out) {
    T tmp[F::L];
    F::store(tmp, v);
    std::memcpy(y + n0, tmp, (n_out - n0) * sizeof(T));
  }
}

// ------------------------------------------------------------------------ the work split

// fn(panel0, num_panels, t0, num_tokens) over groups of np panels and tiles of tt tokens;
// threads take groups (balanced_for), tokens in blocks of kTokenBlock so that a group's
// panels stay in L2 while a block of token rows passes over them.
constexpr int64_t kTokenBlock = 128;

// The groups [g0, g1) of for_tiles' work, on the calling thread.
template <typename Fn>
void tiles_of(int64_t g0, int64_t g1, int64_t num_panels, int64_t np, int64_t tokens, int64_t tt,
              const Fn& fn) {
  for (int64_t tb = 0; tb < tokens; tb += kTokenBlock) {
    const int64_t te = std::min(tokens, tb + kTokenBlock);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * np, pn = std::min(np, num_panels - p0);
      for (int64_t t = tb; t < te; t += tt) fn(p0, pn, t, std::min(tt, te - t));
    }
  }
}

// Panels [p0, p1) of a call, run on the calling thread (block_linear_group's pieces); p1 < 0:
// all of its panels, split over the threads.
struct PanelSlice {
  int64_t p0 = 0, p1 = -1;
};

template <typename Fn>
void for_tiles(int64_t num_panels, int64_t np, int64_t tokens, int64_t tt, const Fn& fn,
               PanelSlice slice = {}) {
  const int64_t groups = (num_panels + np - 1) / np;
  if (slice.p1 >= 0) {  // p0 a multiple of np: the groups of the whole call, the same tiles
    TORCH_CHECK(slice.p0 % np == 0, "for_tiles: a slice starts at a group");
    return tiles_of(slice.p0 / np, (slice.p1 + np - 1) / np, num_panels, np, tokens, tt, fn);
  }
  conveyor::balance::balanced_for(groups, 1, [&](int64_t g0, int64_t g1) {
    tiles_of(g0, g1, num_panels, np, tokens, tt, fn);
  });
}

// Calls K<TT, NP>::run(args...) for runtime tt <= MaxTT, np <= MaxNP.
template <template <int, int> class K, int MaxTT, int MaxNP, int TT = MaxTT, int NP = MaxNP>
struct Dispatch {
  template <typename... A>
  static void run(int tt, int np, A&&... args) {
    if constexpr (TT > 1) {
      if (tt < TT) return Dispatch<K, MaxTT, MaxNP, TT - 1, NP>::run(tt, np, args...);
    }
    if constexpr (NP > 1) {
      if (np < NP) return Dispatch<K, MaxTT, MaxNP, TT, NP - 1>::run(tt, np, args...);
    }
    K<TT, NP>::run(args...);
  }
};

// ------------------------------------------------------------------------ dense weights

template <typename T, int Isa>
struct Dense {
  using F = Lanes<T, Isa>;
  template <int TT, int NP>
  struct Tile {
    static void run(const T* x, int64_t k_dim, const T* w, int64_t p0, T* y, int64_t n_out) {
      typename F::V acc[TT][NP];
      for (int t = 0; t < TT; ++t)
        for (int p = 0; p < NP; ++p) acc[t][p] = F::zero();
      const T* wp = w + p0 * k_dim * F::L;
      for (int64_t k = 0; k < k_dim; ++k) {
        typename F::V wv[NP];
        for (int p = 0; p < NP; ++p) wv[p] = F::load(wp + (p * k_dim + k) * F::L);
        for (int t = 0; t < TT; ++t) {
          const T a = x[t * k_dim + k];
          for (int p = 0; p < NP; ++p) acc[t][p] = F::fma(a, wv[p], acc[t][p]);
        }
      }
      for (int t = 0; t < TT; ++t)
        for (int p = 0; p < NP; ++p)
          store_row<T, F>(y + t * n_out, (p0 + p) * F::L, n_out, acc[t][p]);
    }
  };
  static constexpr int kTT = Isa == kAvx512 ? 6 : Isa == kAvx2 ? 6 : 2;
  static constexpr int kNP = Isa == kAvx512 ? 4 : 1;

  static void run(const T* x, int64_t tokens, int64_t k_dim, const T* w, int64_t panels, T* y,
                  int64_t n_out, PanelSlice slice = {}) {
    for_tiles(
        panels, kNP, tokens, kTT,
        [&](int64_t p0, int64_t pn, int64_t t, int64_t tt) {
          Dispatch<Tile, kTT, kNP>::run(tt, pn, x + t * k_dim, k_dim, w, p0, y + t * n_out, n_out);
        },
        slice);
  }
};

at::Tensor pack_dense(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kDouble),
              "pack_dense: a float32 or float64 (out, in) CPU matrix");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t lanes = kPanelBytes / weight.element_size();
  const int64_t panels = (n + lanes - 1) / lanes;
  at::Tensor padded = at::zeros({panels * lanes, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // (P, L, K) -> (P, K, L)
  return padded.view({panels, lanes, k}).transpose(1, 2).contiguous();
}

// A slice runs on the calling thread and is not counted (dense_linear_group counts its calls).
template <typename T>
void dense_dispatch(const T* x, int64_t tokens, int64_t k, const T* w, int64_t panels, T* y,
                    int64_t n, PanelSlice slice = {}) {
  switch (slice.p1 >= 0 ? current_isa().load() : running_isa()) {
#if CONVEYOR_PANEL_AVX512
    case kAvx512:
      return Dense<T, kAvx512>::run(x, tokens, k, w, panels, y, n, slice);
#endif
#if CONVEYOR_PANEL_AVX2
    case kAvx2:
      return Dense<T, kAvx2>::run(x, tokens, k, w, panels, y, n, slice);
#endif
    default:
      return Dense<T, kScalar>::run(x, tokens, k, w, panels, y, n, slice);
  }
}

// Splits the panels of several calls into pieces of kGroupPiece panels (a multiple of every
// tile's panel count, so that each piece's tiles are the whole call's) and runs
// fn(call, slice) over all the pieces in one parallel region (balanced_for).
constexpr int64_t kGroupPiece = 4;

template <typename Fn>
void for_pieces(const std::vector<int64_t>& num_panels, const Fn& fn) {
  std::vector<int64_t> starts{0};  // the pieces of call i: [starts[i], starts[i + 1])
  for (int64_t p : num_panels) starts.push_back(starts.back() + (p + kGroupPiece - 1) / kGroupPiece);
  conveyor::balance::balanced_for(starts.back(), 1, [&](int64_t u0, int64_t u1) {
    size_t i = std::upper_bound(starts.begin(), starts.end(), u0) - starts.begin() - 1;
    for (int64_t u = u0; u < u1; ++u) {
      while (starts[i + 1] <= u) ++i;
      const int64_t first = (u - starts[i]) * kGroupPiece;
      fn(i, PanelSlice{first, std::min(num_panels[i], first + kGroupPiece)});
    }
  });
}

// dense_linear(xs[i], panels[i], n_outs[i]) for every i (float32), the same bits, in one
// parallel region: block_linear_group's twin for float weights.
std::vector<at::Tensor> dense_linear_group(const std::vector<at::Tensor>& xs,
                                           const std::vector<at::Tensor>& panels,
                                           const std::vector<int64_t>& n_outs) {
  const size_t calls = xs.size();
  TORCH_CHECK(panels.size() == calls && n_outs.size() == calls,
              "dense_linear_group: as many panels and n_outs as xs");
  std::vector<at::Tensor> ys(calls), contiguous(calls);
  std::vector<int64_t> num_panels(calls, 0);
  const int isa = current_isa().load();
  for (size_t i = 0; i < calls; ++i) {
    const at::Tensor &x = xs[i], &w = panels[i];
    TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1) &&
                    x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                    w.is_contiguous() && w.size(2) * w.element_size() == kPanelBytes &&
                    n_outs[i] >= 0 && n_outs[i] <= w.size(0) * w.size(2) && x.device().is_cpu() &&
                    w.device().is_cpu(),
                "dense_linear_group: float32 x (T, K) and panels (P, K, L) from pack_dense");
    contiguous[i] = x.contiguous();
    ys[i] = at::empty({x.size(0), n_outs[i]}, contiguous[i].options());
    if (x.size(0) > 0 && n_outs[i] > 0) num_panels[i] = w.size(0);
    runs()[isa].fetch_add(1, std::memory_order_relaxed);
  }
  for_pieces(num_panels, [&](size_t i, PanelSlice slice) {
    const at::Tensor& x = contiguous[i];
    dense_dispatch<float>(x.data_ptr<float>(), x.size(0), x.size(1), panels[i].data_ptr<float>(),
                          num_panels[i], ys[i].data_ptr<float>(), n_outs[i], slice);
  });
  return ys;
}

at::Tensor dense_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n_out) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 3 && x_in.size(1) == packed.size(1) &&
                  x_in.scalar_type() == packed.scalar_type() && packed.is_contiguous() &&
                  packed.size(2) * packed.element_size() == kPanelBytes &&
                  n_out >= 0 && n_out <= packed.size(0) * packed.size(2) &&
                  x_in.device().is_cpu() && packed.device().is_cpu(),
              "dense_linear: x (T, K) and panels (P, K, L) from pack_dense, one dtype");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), n_out}, x.options());
  if (x.size(0) == 0 || n_out == 0) return y;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dense_linear", [&] {
    dense_dispatch<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1),
                             packed.data_ptr<scalar_t>(), packed.size(0), y.data_ptr<scalar_t>(),
                             n_out);
  });
  return y;
}

// ------------------------------------------------------------------------ block weights

inline float half_bits_to_float(int16_t bits) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
}

// Packs GGUF-style blocks (quant.py BlockWeight: q4 qs u8 (N, K/2), d, m int16 (N, K/32); q8 qs
// i8 (N, K)) into panels: returns (wq (P, nb, C * 64) uint8, dw (P, nb, 16) int16, mw (same, q4)
// or an empty tensor); with float_acts the values as (P, K, 16) int8 for the float-activation
// kernel instead of wq.
std::vector<at::Tensor> pack_blocks(const at::Tensor& qs_in, const at::Tensor& d_in,
                                    const std::optional<at::Tensor>& m_in, bool float_acts) {
  const bool q4 = m_in.has_value() && m_in->defined();
  TORCH_CHECK(d_in.dim() == 2 && qs_in.dim() == 2 && d_in.scalar_type() == at::kShort &&
                  (qs_in.scalar_type() == at::kByte || qs_in.scalar_type() == at::kChar) &&
                  d_in.device().is_cpu() && qs_in.device().is_cpu(),
              "pack_blocks: qs uint8/int8 (N, bytes) and d int16 (N, K/32) on the CPU");
  TORCH_CHECK(!q4 || (m_in->scalar_type() == at::kShort && m_in->sizes() == d_in.sizes()),
              "pack_blocks: m must be int16 of d's shape");
  const at::Tensor qs = qs_in.contiguous(), d = d_in.contiguous();
  const int64_t n = d.size(0), nb = d.size(1);
  TORCH_CHECK(qs.size(0) == n && qs.size(1) == (q4 ? nb * 16 : nb * 32),
              "pack_blocks: qs does not fit d");
  const int64_t panels = (n + kCols - 1) / kCols, chunks = q4 ? 4 : 8;
  at::Tensor wq = at::zeros({panels, nb, chunks * kPanelBytes}, qs.options().dtype(at::kByte));
  at::Tensor dw = at::zeros({panels, nb, kCols}, d.options());
  at::Tensor mw = q4 ? at::zeros({panels, nb, kCols}, d.options()) : at::Tensor();
  if (!q4) wq.fill_(0x80);  // padded columns: q = 0
  const uint8_t* src = static_cast<const uint8_t*>(qs.data_ptr());
  uint8_t* dst = wq.data_ptr<uint8_t>();
  const int16_t* dsrc = d.data_ptr<int16_t>();
  int16_t* ddst = dw.data_ptr<int16_t>();
  const at::Tensor m = q4 ? m_in->contiguous() : at::Tensor();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t p = r / kCols, c = r % kCols;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* block = dst + (p * nb + b) * chunks * kPanelBytes;
        for (int64_t j = 0; j < QK; ++j) {
          if (q4) {
            const uint8_t byte = src[r * nb * 16 + b * 16 + j % 16];
            const uint8_t v = j < 16 ? (byte & 0x0F) : (byte >> 4);
            const int64_t g = (j % 16) / 4, at = g * kPanelBytes + c * 4 + j % 4;
            block[at] |= j < 16 ? v : static_cast<uint8_t>(v << 4);
          } else {
            const int64_t g = j / 4;
            block[g * kPanelBytes + c * 4 + j % 4] = src[r * nb * 32 + b * 32 + j] ^ 0x80;
          }
        }
        ddst[(p * nb + b) * kCols + c] = dsrc[r * nb + b];
        if (q4) mw.data_ptr<int16_t>()[(p * nb + b) * kCols + c] = m.data_ptr<int16_t>()[r * nb + b];
      }
    }
  });
  at::Tensor mw_out = q4 ? mw : at::empty({0}, d.options());
  if (!float_acts) return {wq, dw, mw_out};
  // (P, nb, C, 16 columns, 4 k) -> (P, K, 16): each value once, as int8 (q4: 0..15).
  at::Tensor wk = at::empty({panels, nb * QK, kCols}, qs.options().dtype(at::kChar));
  const uint8_t* packed = wq.data_ptr<uint8_t>();
  int8_t* out = wk.data_ptr<int8_t>();
  at::parallel_for(0, panels, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = packed + (p * nb + b) * chunks * kPanelBytes;
        for (int64_t j = 0; j < QK; ++j)
          for (int64_t c = 0; c < kCols; ++c) {
            int v;
            if (q4) {
              const uint8_t byte = block[((j % 16) / 4) * kPanelBytes + c * 4 + j % 4];
              v = j < 16 ? (byte & 0x0F) : (byte >> 4);
            } else {
              v = static_cast<int>(block[(j / 4) * kPanelBytes + c * 4 + j % 4]) - 128;
            }
            out[(p * nb * QK + b * QK + j) * kCols + c] = static_cast<int8_t>(v);
          }
      }
  });
  return {wk, dw, mw_out};
}

// Activations of a call, per token and block: int8 values, their scale xd = max|x| / 127,
// xs = xd * sum(xq), and the integer sum (q8's -128 correction).
// An array that quantize writes in full: left uninitialised rather than zeroed first (a
// std::vector's resize zeroed ~1 MB per projection of a 512-token chunk, 3% of its time).
template <typename T>
struct Uninit {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) { p.reset(new T[n]); }
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  const T& operator[](int64_t i) const { return p[i]; }
};

struct Acts {
  Uninit<int8_t> q;
  Uninit<float> d, s;
  Uninit<int32_t> isum;
};

// One token's blocks, as quantize_row in gemm/quant_gemm.cpp (the same values: round half to even
// of x * (127 / max|x|)), written portably; the rounding is elementwise, so any order gives
// the same bits.
void quantize_token(const float* x, int64_t nb, int8_t* q, float* d, float* s, int32_t* isum) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    float max_abs = 0.0f;
    for (int j = 0; j < QK; ++j) max_abs = std::max(max_abs, std::fabs(xb[j]));
    const float scale = max_abs / 127.0f;
    const float inv = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[b * QK + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    isum[b] = sum;
    s[b] = scale * static_cast<float>(sum);
  }
}

#if CONVEYOR_PANEL_AVX2
// quantize_token in AVX2: the same values (|x| max, the same scale and reciprocal, x * inv
// rounded half to even, an exact integer sum), 8 lanes at a time. A 512-token prompt chunk
// quantizes 4 x 512 rows per layer, and the scalar loop took ~1/3 of the projections' time.
void quantize_token_avx2(const float* x, int64_t nb, int8_t* q, float* d, float* s,
                         int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float max_abs = _mm_cvtss_f32(m);
    const __m256 inv = _mm256_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
    __m256i sum = _mm256_setzero_si256();
    __m256i r[4];
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      sum = _mm256_add_epi32(sum, r[i]);
    }
    // The 32 values (all within +-127, so the saturating packs keep them) to bytes: the packs
    // interleave 4-byte groups by 128-bit lane (r0 r1 r2 r3 lows, then highs); the permute
    // puts each vector's two groups back together.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                             _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    int32_t lanes[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), sum);
    int32_t total = 0;
    for (int j = 0; j < 8; ++j) total += lanes[j];
    const float scale = max_abs / 127.0f;
    d[b] = scale;
    if (isum != nullptr) isum[b] = total;
    s[b] = scale * static_cast<float>(total);
  }
}
#endif

#if CONVEYOR_PANEL_AVX512
// quantize_token in AVX-512: the same values again (|x| max, scale, reciprocal, x * inv
// rounded half to even, an exact integer sum), a block of 32 in two vectors, its bytes by
// two narrowing stores.
void quantize_token_avx512(const float* x, int64_t nb, int8_t* q, float* d, float* s,
                           int32_t* isum) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(max_abs > 0.0f ? 127.0f / max_abs : 0.0f);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i r0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inv), kRound);
    const __m512i r1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inv), kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK), _mm512_cvtsepi32_epi8(r0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK + 16), _mm512_cvtsepi32_epi8(r1));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
    const float scale = max_abs / 127.0f;
    d[b] = scale;
    isum[b] = total;
    s[b] = scale * static_cast<float>(total);
  }
}
#endif

// rows: tokens, or more (the AMX tiles' multiple of 16): the rows past tokens are zeros.
Acts quantize(const float* x, int64_t tokens, int64_t k, int64_t rows = 0) {
  const int64_t nb = k / QK;
  rows = std::max(rows, tokens);
  Acts a;
  a.q.resize(rows * k);
  a.d.resize(rows * nb);
  a.s.resize(rows * nb);
  a.isum.resize(rows * nb);
  if (rows > tokens) {
    std::memset(a.q.data() + tokens * k, 0, (rows - tokens) * k);
    std::fill(a.d.data() + tokens * nb, a.d.data() + rows * nb, 0.0f);
    std::fill(a.s.data() + tokens * nb, a.s.data() + rows * nb, 0.0f);
    std::fill(a.isum.data() + tokens * nb, a.isum.data() + rows * nb, 0);
  }
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#if CONVEYOR_PANEL_AVX512
      if (current_isa().load() == kAvx512) {
        quantize_token_avx512(x + t * k, nb, a.q.data() + t * k, a.d.data() + t * nb,
                              a.s.data() + t * nb, a.isum.data() + t * nb);
        continue;
      }
#endif
#if CONVEYOR_PANEL_AVX2
      if (current_isa().load() != kScalar) {
        quantize_token_avx2(x + t * k, nb, a.q.data() + t * k, a.d.data() + t * nb,
                            a.s.data() + t * nb, a.isum.data() + t * nb);
        continue;
      }
#endif
      quantize_token(x + t * k, nb, a.q.data() + t * k, a.d.data() + t * nb, a.s.data() + t * nb,
                     a.isum.data() + t * nb);
    }
  });
  return a;
}

struct BlockArgs {
  const int8_t* xq;
  const float* xd;
  const float* xs;
  const int32_t* xi;
  const float* x;     // float activations (the float-acts kernel)
  const int8_t* wk;   // its weights, (P, K, 16)
  int64_t k, nb;
  const uint8_t* wq;
  const int16_t* dw;
  const int16_t* mw;  // null for q8
  float* y;
  int64_t n_out;
  // block_argmax's bounds in place of y (int8 activations, when lo is set): for row t and
  // panel p, the largest of y_n - c_t wmax_n (lo) and of y_n + c_t wmax_n (hi) over the
  // panel's columns n < n_out, at [t * panels + p]
  const float* c;
  const float* wmax;
  float* lo;
  float* hi;
};

// One row's bounds over one panel from its values v (kCols of them, those past n_out unused):
// the scalar kernel's, and the vector ones' on a panel that n_out cuts.
inline void panel_bounds(const BlockArgs& a, int64_t row, int64_t panel, const float* v) {
  const int64_t n0 = panel * kCols, cols = std::min<int64_t>(kCols, a.n_out - n0);
  const int64_t at = row * ((a.n_out + kCols - 1) / kCols) + panel;
  const float c = a.c[row];
  float lo = -std::numeric_limits<float>::infinity(), hi = lo;
  for (int64_t j = 0; j < cols; ++j) {
    lo = std::max(lo, std::fma(-c, a.wmax[n0 + j], v[j]));
    hi = std::max(hi, std::fma(c, a.wmax[n0 + j], v[j]));
  }
  a.lo[at] = lo;
  a.hi[at] = hi;
}

template <typename T>
inline T read_as(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The scalar reference of both block kernels (kScalar): the same order as the vector ones.
template <bool Q4>
struct BlockScalar {
  template <int TT, int NP>
  struct IntTile {
    static void run(const BlockArgs& a, int64_t p0, int64_t t0) {
      constexpr int64_t chunks = Q4 ? 4 : 8;
      for (int t = 0; t < TT; ++t) {
        for (int p = 0; p < NP; ++p) {
          float acc[kCols] = {};
          for (int64_t b = 0; b < a.nb; ++b) {
            const uint8_t* blk = a.wq + ((p0 + p) * a.nb + b) * chunks * kPanelBytes;
            const int8_t* xq = a.xq + (t0 + t) * a.k + b * QK;
            const int64_t base = ((p0 + p) * a.nb + b) * kCols;
            const float xd = a.xd[(t0 + t) * a.nb + b];
            for (int c = 0; c < kCols; ++c) {
              int32_t isum = 0;
              for (int j = 0; j < QK; ++j) {
                int w;
                if (Q4) {
                  const uint8_t byte = blk[((j % 16) / 4) * kPanelBytes + c * 4 + j % 4];
                  w = j < 16 ? (byte & 0x0F) : (byte >> 4);
                } else {
                  w = static_cast<int>(blk[(j / 4) * kPanelBytes + c * 4 + j % 4]) - 128;
                }
                isum += w * xq[j];
              }
              const float s = half_bits_to_float(a.dw[base + c]) * xd;
              acc[c] = std::fma(s, static_cast<float>(isum), acc[c]);
              if (Q4)
                acc[c] = std::fma(half_bits_to_float(a.mw[base + c]),
                                  a.xs[(t0 + t) * a.nb + b], acc[c]);
            }
          }
          if (a.lo != nullptr) {
            panel_bounds(a, t0 + t, p0 + p, acc);
            continue;
          }
          for (int c = 0; c < kCols; ++c) {
            const int64_t col = (p0 + p) * kCols + c;
            if (col < a.n_out) a.y[(t0 + t) * a.n_out + col] = acc[c];
          }
        }
      }
    }
  };
  template <int TT, int NP>
  struct FloatTile {
    static void run(const BlockArgs& a, int64_t p0, int64_t t0) {
      for (int t = 0; t < TT; ++t) {
        for (int p = 0; p < NP; ++p) {
          float acc[kCols] = {};
          for (int64_t b = 0; b < a.nb; ++b) {
            const int64_t base = ((p0 + p) * a.nb + b) * kCols;
            for (int c = 0; c < kCols; ++c) {
              float part = 0.0f;
              for (int64_t k = b * QK; k < (b + 1) * QK; ++k)
                part = std::fma(a.x[(t0 + t) * a.k + k],
                                static_cast<float>(a.wk[((p0 + p) * a.k + k) * kCols + c]), part);
              acc[c] = std::fma(part, half_bits_to_float(a.dw[base + c]), acc[c]);
              if (Q4)
                acc[c] = std::fma(a.xs[(t0 + t) * a.nb + b], half_bits_to_float(a.mw[base + c]),
                                  acc[c]);
            }
          }
          for (int c = 0; c < kCols; ++c) {
            const int64_t col = (p0 + p) * kCols + c;
            if (col < a.n_out) a.y[(t0 + t) * a.n_out + col] = acc[c];
          }
        }
      }
    }
  };
};

#if CONVEYOR_PANEL_AVX2
// 16 block columns in two 8-lane halves.
struct Avx2Blocks {
  struct I {
    __m256i a, b;
  };
  struct V {
    __m256 a, b;
  };
  static V fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V half16(const int16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static V fma(V s, V v, V acc) {
    return {_mm256_fmadd_ps(s.a, v.a, acc.a), _mm256_fmadd_ps(s.b, v.b, acc.b)};
  }
  static V fma1(float s, V v, V acc) {
    const __m256 sv = _mm256_set1_ps(s);
    return {_mm256_fmadd_ps(sv, v.a, acc.a), _mm256_fmadd_ps(sv, v.b, acc.b)};
  }
  static V mul1(V v, float s) {
    const __m256 sv = _mm256_set1_ps(s);
    return {_mm256_mul_ps(v.a, sv), _mm256_mul_ps(v.b, sv)};
  }
  static V to_float(I i) { return {_mm256_cvtepi32_ps(i.a), _mm256_cvtepi32_ps(i.b)}; }
  static void store(float* p, V v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  static I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I load_bytes(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
  }
  static I low_nibbles(I v) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
  }
  static I high_nibbles(I v) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(v.a, 4), m),
            _mm256_and_si256(_mm256_srli_epi16(v.b, 4), m)};
  }
  static __m256i quad(const int8_t* x) { return _mm256_set1_epi32(read_as<int32_t>(x)); }
  // q4: acc + per column the dots of 4 unsigned weight bytes (0..15) with 4 signed activations,
  // the low nibbles' and the high ones'. The sums stay in int16 lanes until the block ends
  // (finish_q4): per column pair maddubs gives at most 2 * 15 * 127 = 3810 (int8 activations
  // are within +-127), a block's 8 of them at most 30480 < 32767, so they are exact, the
  // integers of an int32 sum, with one widening madd a block instead of one a chunk.
  static I dot_q4(I acc, I lo, __m256i xl, I hi, __m256i xh) {
    return {_mm256_add_epi16(acc.a, _mm256_add_epi16(_mm256_maddubs_epi16(lo.a, xl),
                                                     _mm256_maddubs_epi16(hi.a, xh))),
            _mm256_add_epi16(acc.b, _mm256_add_epi16(_mm256_maddubs_epi16(lo.b, xl),
                                                     _mm256_maddubs_epi16(hi.b, xh)))};
  }
  static I finish_q4(I s) {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(s.a, one), _mm256_madd_epi16(s.b, one)};
  }
  // q8 stored as q ^ 0x80: back to signed, then |w| times x with w's sign (pair sums fit).
  static I signed_q8(I w) {
    const __m256i f = _mm256_set1_epi8(static_cast<char>(0x80));
    return {_mm256_xor_si256(w.a, f), _mm256_xor_si256(w.b, f)};
  }
  static I dot_q8(I acc, I w_signed, __m256i x) {
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i pa = _mm256_maddubs_epi16(_mm256_sign_epi8(w_signed.a, w_signed.a),
                                            _mm256_sign_epi8(x, w_signed.a));
    const __m256i pb = _mm256_maddubs_epi16(_mm256_sign_epi8(w_signed.b, w_signed.b),
                                            _mm256_sign_epi8(x, w_signed.b));
    return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(pa, one)),
            _mm256_add_epi32(acc.b, _mm256_madd_epi16(pb, one))};
  }
  static I q8_start(int32_t) { return izero(); }
  // 16 int8 values as floats.
  static V i8_as_float(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
  }
  static V mul(V a, V b) { return {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
  static V loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static V neg_fma1(float s, V v, V acc) {  // acc - s v, rounded once
    const __m256 sv = _mm256_set1_ps(s);
    return {_mm256_fnmadd_ps(sv, v.a, acc.a), _mm256_fnmadd_ps(sv, v.b, acc.b)};
  }
  static float hmax(V v) {
    __m256 m = _mm256_max_ps(v.a, v.b);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
};
#endif

#if CONVEYOR_PANEL_AVX512
struct Avx512Blocks {
  using I = __m512i;
  using V = __m512;
  static V fzero() { return _mm512_setzero_ps(); }
  static V half16(const int16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V fma(V s, V v, V acc) { return _mm512_fmadd_ps(s, v, acc); }
  static V fma1(float s, V v, V acc) { return _mm512_fmadd_ps(_mm512_set1_ps(s), v, acc); }
  static V mul1(V v, float s) { return _mm512_mul_ps(v, _mm512_set1_ps(s)); }
  static V to_float(I i) { return _mm512_cvtepi32_ps(i); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static I izero() { return _mm512_setzero_si512(); }
  static I load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  }
  static I quad(const int8_t* x) { return _mm512_set1_epi32(read_as<int32_t>(x)); }
  static I dot_q4(I acc, I lo, I xl, I hi, I xh) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xl), hi, xh);
  }
  static I finish_q4(I s) { return s; }  // vpdpbusd sums into int32 lanes
  static I signed_q8(I w) { return w; }  // vpdpbusd takes the stored unsigned q + 128
  static I dot_q8(I acc, I w_plus_128, I x) { return _mm512_dpbusd_epi32(acc, w_plus_128, x); }
  static I q8_start(int32_t xsum) { return _mm512_set1_epi32(-128 * xsum); }
  static V i8_as_float(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static V neg_fma1(float s, V v, V acc) { return _mm512_fnmadd_ps(_mm512_set1_ps(s), v, acc); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
};
#endif

template <typename B, bool Q4>
struct BlockVec {
  // int8 activations: TT tokens x NP panels, the integer sums per block then the float chain.
  template <int TT, int NP>
  struct IntTile {
    static void run(const BlockArgs& a, int64_t p0, int64_t t0) {
      constexpr int64_t chunks = Q4 ? 4 : 8;
      typename B::V acc[TT][NP];
      for (int t = 0; t < TT; ++t)
        for (int p = 0; p < NP; ++p) acc[t][p] = B::fzero();
      for (int64_t b = 0; b < a.nb; ++b) {
        typename B::I isum[TT][NP];
        for (int t = 0; t < TT; ++t)
          for (int p = 0; p < NP; ++p)
            isum[t][p] = Q4 ? B::izero() : B::q8_start(a.xi[(t0 + t) * a.nb + b]);
        const uint8_t* blk[NP];
        for (int p = 0; p < NP; ++p) blk[p] = a.wq + ((p0 + p) * a.nb + b) * chunks * kPanelBytes;
        if constexpr (Q4) {
          for (int g = 0; g < 4; ++g) {
            typename B::I lo[NP], hi[NP];
            for (int p = 0; p < NP; ++p) {
              const typename B::I v = B::load_bytes(blk[p] + g * kPanelBytes);
              lo[p] = B::low_nibbles(v);
              hi[p] = B::high_nibbles(v);
            }
            for (int t = 0; t < TT; ++t) {
              const int8_t* xq = a.xq + (t0 + t) * a.k + b * QK;
              const auto xl = B::quad(xq + 4 * g), xh = B::quad(xq + 16 + 4 * g);
              for (int p = 0; p < NP; ++p) isum[t][p] = B::dot_q4(isum[t][p], lo[p], xl, hi[p], xh);
            }
          }
          for (int t = 0; t < TT; ++t)
            for (int p = 0; p < NP; ++p) isum[t][p] = B::finish_q4(isum[t][p]);
        } else {
          for (int g = 0; g < 8; ++g) {
            typename B::I w[NP];
            for (int p = 0; p < NP; ++p) w[p] = B::signed_q8(B::load_bytes(blk[p] + g * kPanelBytes));
            for (int t = 0; t < TT; ++t) {
              const auto xv = B::quad(a.xq + (t0 + t) * a.k + b * QK + 4 * g);
              for (int p = 0; p < NP; ++p) isum[t][p] = B::dot_q8(isum[t][p], w[p], xv);
            }
          }
        }
        for (int p = 0; p < NP; ++p) {
          const int64_t base = ((p0 + p) * a.nb + b) * kCols;
          const typename B::V dw = B::half16(a.dw + base);
          typename B::V mw;
          if constexpr (Q4) mw = B::half16(a.mw + base);
          for (int t = 0; t < TT; ++t) {
            const int64_t tb = (t0 + t) * a.nb + b;
            acc[t][p] = B::fma(B::mul1(dw, a.xd[tb]), B::to_float(isum[t][p]), acc[t][p]);
            if constexpr (Q4) acc[t][p] = B::fma1(a.xs[tb], mw, acc[t][p]);
          }
        }
      }
      if (a.lo != nullptr) return bounds(a, p0, t0, acc);
      store(a, p0, t0, acc);
    }
  };

  // block_argmax: each row's lo and hi over each panel (BlockArgs), instead of its values.
  template <int TT, int NP>
  static void bounds(const BlockArgs& a, int64_t p0, int64_t t0, typename B::V (&acc)[TT][NP]) {
    const int64_t panels = (a.n_out + kCols - 1) / kCols;
    for (int p = 0; p < NP; ++p) {
      const int64_t n0 = (p0 + p) * kCols;
      if (n0 + kCols > a.n_out) {
        for (int t = 0; t < TT; ++t) {
          float v[kCols];
          B::store(v, acc[t][p]);
          panel_bounds(a, t0 + t, p0 + p, v);
        }
        continue;
      }
      const typename B::V w = B::loadf(a.wmax + n0);
      for (int t = 0; t < TT; ++t) {
        const float c = a.c[t0 + t];
        const int64_t at = (t0 + t) * panels + p0 + p;
        a.lo[at] = B::hmax(B::neg_fma1(c, w, acc[t][p]));
        a.hi[at] = B::hmax(B::fma1(c, w, acc[t][p]));
      }
    }
  }

  // Float activations (the lm_head): per block, the float dot product of x and the weights'
  // int8 values (converted exactly), then scaled by dw (q4: plus mw times the block's sum of
  // x); no weight is dequantized, so a weight costs one conversion and one FMA.
  template <int TT, int NP>
  struct FloatTile {
    static void run(const BlockArgs& a, int64_t p0, int64_t t0) {
      typename B::V acc[TT][NP];
      for (int t = 0; t < TT; ++t)
        for (int p = 0; p < NP; ++p) acc[t][p] = B::fzero();
      for (int64_t b = 0; b < a.nb; ++b) {
        typename B::V part[TT][NP];
        for (int t = 0; t < TT; ++t)
          for (int p = 0; p < NP; ++p) part[t][p] = B::fzero();
        for (int64_t k = b * QK; k < (b + 1) * QK; ++k) {
          typename B::V q[NP];
          for (int p = 0; p < NP; ++p) q[p] = B::i8_as_float(a.wk + ((p0 + p) * a.k + k) * kCols);
          for (int t = 0; t < TT; ++t) {
            const float xv = a.x[(t0 + t) * a.k + k];
            for (int p = 0; p < NP; ++p) part[t][p] = B::fma1(xv, q[p], part[t][p]);
          }
        }
        for (int p = 0; p < NP; ++p) {
          const int64_t base = ((p0 + p) * a.nb + b) * kCols;
          const typename B::V dw = B::half16(a.dw + base);
          typename B::V mw;
          if constexpr (Q4) mw = B::half16(a.mw + base);
          for (int t = 0; t < TT; ++t) {
            acc[t][p] = B::fma(part[t][p], dw, acc[t][p]);
            if constexpr (Q4) acc[t][p] = B::fma1(a.xs[(t0 + t) * a.nb + b], mw, acc[t][p]);
          }
        }
      }
      store(a, p0, t0, acc);
    }
  };

  template <int TT, int NP>
  static void store(const BlockArgs& a, int64_t p0, int64_t t0, typename B::V (&acc)[TT][NP]) {
    for (int t = 0; t < TT; ++t) {
      for (int p = 0; p < NP; ++p) {
        const int64_t n0 = (p0 + p) * kCols;
        float* row = a.y + (t0 + t) * a.n_out;
        if (n0 + kCols <= a.n_out) {
          B::store(row + n0, acc[t][p]);
        } else if (n0 < a.n_out) {
          float tmp[kCols];
          B::store(tmp, acc[t][p]);
          std::memcpy(row + n0, tmp, (a.n_out - n0) * sizeof(float));
        }
      }
    }
  }
};

#if CONVEYOR_PANEL_AVX2
// AVX2, q4, int8 activations: TT rows x one panel (16 columns in two halves), the chunk loop
// kept rolled and the int16 sums pinned to registers. BlockVec's IntTile with Avx2Blocks'
// own steps, in the same order, so the same integers and bits. BlockVec's IntTile at 6 rows
// needs 18 registers and spilled its sums (a load and a store a chunk for each); at 4 rows GCC
// unrolled its chunks and stored every maddubs' result before adding it. Here 4 rows take 15
// registers: on a Zen 3 1.09-1.13x the 6-row tile's rate at 8-512 rows (30 layers of SmolLM2's
// q4 projections), a 512-token chunk's projections 344-366 -> 309-324 ms.
template <int TT, int NP>
struct Avx2Q4Tile {
  static_assert(NP == 1, "one panel a tile");
  static void run(const BlockArgs& a, int64_t p0, int64_t t0) {
    using B = Avx2Blocks;
    B::V acc[TT][1];
    for (int t = 0; t < TT; ++t) acc[t][0] = B::fzero();
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* blk = a.wq + (p0 * a.nb + b) * 4 * kPanelBytes;
      B::I isum[TT];
      for (int t = 0; t < TT; ++t) isum[t] = B::izero();
      const int8_t* xq0 = a.xq + t0 * a.k + b * QK;
#pragma GCC unroll 1
      for (int g = 0; g < 4; ++g) {
        const B::I v = B::load_bytes(blk + g * kPanelBytes);
        const B::I lo = B::low_nibbles(v), hi = B::high_nibbles(v);
        for (int t = 0; t < TT; ++t) {
          const int8_t* xq = xq0 + t * a.k;
          isum[t] = B::dot_q4(isum[t], lo, B::quad(xq + 4 * g), hi, B::quad(xq + 16 + 4 * g));
        }
        if constexpr (TT == 4)  // the sums stay in registers from chunk to chunk
          asm volatile("" : "+x"(isum[0].a), "+x"(isum[1].a), "+x"(isum[2].a), "+x"(isum[3].a),
                       "+x"(isum[0].b), "+x"(isum[1].b), "+x"(isum[2].b), "+x"(isum[3].b));
      }
      const int64_t base = (p0 * a.nb + b) * kCols;
      const B::V dw = B::half16(a.dw + base);
      const B::V mw = B::half16(a.mw + base);
      for (int t = 0; t < TT; ++t) {
        const int64_t tb = (t0 + t) * a.nb + b;
        acc[t][0] = B::fma(B::mul1(dw, a.xd[tb]), B::to_float(B::finish_q4(isum[t])), acc[t][0]);
        acc[t][0] = B::fma1(a.xs[tb], mw, acc[t][0]);
      }
    }
    using Vec = BlockVec<Avx2Blocks, true>;
    if (a.lo != nullptr) return Vec::bounds(a, p0, t0, acc);
    Vec::store(a, p0, t0, acc);
  }
};
#endif

// Binds a tile template's BlockArgs to Dispatch's (TT, NP) parameters.
template <template <int, int> class Tile, int TT, int NP>
void run_tiles(const BlockArgs& a, int64_t tokens, int64_t panels, PanelSlice slice = {}) {
  for_tiles(
      panels, NP, tokens, TT,
      [&](int64_t p0, int64_t pn, int64_t t, int64_t tt) { Dispatch<Tile, TT, NP>::run(tt, pn, a, p0, t); },
      slice);
}

// A slice runs on the calling thread and is not counted (block_linear_group counts its calls).
template <bool Q4, bool FloatActs>
void block_dispatch(const BlockArgs& a, int64_t tokens, int64_t panels, PanelSlice slice = {}) {
  switch (slice.p1 >= 0 ? current_isa().load() : running_isa()) {
#if CONVEYOR_PANEL_AVX512
    case kAvx512:
      if constexpr (FloatActs) {
        // Few rows: one panel's contiguous stream per tile (measured faster than several
        // panels at once below 8 rows); more rows: 4 x 4 tiles.
        if (tokens < 8)
          return run_tiles<BlockVec<Avx512Blocks, Q4>::template FloatTile, 8, 1>(a, tokens, panels, slice);
        return run_tiles<BlockVec<Avx512Blocks, Q4>::template FloatTile, 4, 4>(a, tokens, panels, slice);
      } else {
        return run_tiles<BlockVec<Avx512Blocks, Q4>::template IntTile, 6, 2>(a, tokens, panels, slice);
      }
#endif
#if CONVEYOR_PANEL_AVX2
    case kAvx2:
      if constexpr (FloatActs) {
        return run_tiles<BlockVec<Avx2Blocks, Q4>::template FloatTile, 6, 1>(a, tokens, panels, slice);
      } else {
        // q4: its int16 sums leave room for 6 rows (a Zen 3, SmolLM2's 30 layers of q4
        // projections: 5 rows 1.26x, 8-64 rows 1.35-1.43x faster than 2 rows a tile), and
        // 4 rows held in registers are faster still (Avx2Q4Tile). q8's sign trick keeps 2.
        if constexpr (Q4) return run_tiles<Avx2Q4Tile, 4, 1>(a, tokens, panels, slice);
        return run_tiles<BlockVec<Avx2Blocks, Q4>::template IntTile, 2, 1>(a, tokens, panels, slice);
      }
#endif
    default:
      if constexpr (FloatActs) {
        return run_tiles<BlockScalar<Q4>::template FloatTile, 1, 1>(a, tokens, panels, slice);
      } else {
        return run_tiles<BlockScalar<Q4>::template IntTile, 1, 1>(a, tokens, panels, slice);
      }
  }
}

// Each block's sum of x (T, K), in order of k: the float-activation kernel's q4 term.
std::vector<float> block_sums(const float* x, int64_t tokens, int64_t k) {
  const int64_t nb = k / QK;
  std::vector<float> sums(tokens * nb);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int64_t j = 0; j < QK; ++j) s += x[t * k + b * QK + j];
      sums[t * nb + b] = s;
    }
  return sums;
}

// That x (T, K) and the panels from pack_blocks(..., float_acts) match.
void check_block_panels(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& dw,
                        const at::Tensor& mw, int64_t n_out, bool float_acts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "block_linear: x must be float32 (T, K) on the CPU");
  const int64_t k = x.size(1), nb = k / QK;
  const bool q4 = mw.numel() > 0;
  const bool layout = float_acts ? wq.dim() == 3 && wq.size(1) == k && wq.size(2) == kCols &&
                                        wq.scalar_type() == at::kChar
                                  : wq.dim() == 3 && wq.size(1) == nb &&
                                        wq.size(2) == (q4 ? 4 : 8) * kPanelBytes &&
                                        wq.scalar_type() == at::kByte;
  TORCH_CHECK(k % QK == 0 && layout && wq.is_contiguous() && dw.dim() == 3 &&
                  dw.size(0) == wq.size(0) && dw.size(1) == nb && dw.size(2) == kCols &&
                  dw.scalar_type() == at::kShort && dw.is_contiguous() &&
                  (!q4 || (mw.sizes() == dw.sizes() && mw.scalar_type() == at::kShort &&
                           mw.is_contiguous())) &&
                  n_out >= 0 && n_out <= wq.size(0) * kCols,
              "block_linear: panels from pack_blocks that match x");
}

// The weights' part of BlockArgs: panels from pack_blocks(..., float_acts) over K = k.
BlockArgs panel_args(const at::Tensor& wq, const at::Tensor& dw, const at::Tensor& mw,
                     int64_t k, int64_t n_out, bool float_acts) {
  BlockArgs a{};
  a.k = k;
  a.nb = k / QK;
  a.wq = float_acts ? nullptr : wq.data_ptr<uint8_t>();
  a.wk = float_acts ? wq.data_ptr<int8_t>() : nullptr;
  a.dw = dw.data_ptr<int16_t>();
  a.mw = mw.numel() > 0 ? mw.data_ptr<int16_t>() : nullptr;
  a.n_out = n_out;
  return a;
}

// The int8 activations' part.
void set_acts(BlockArgs& a, const Acts& acts) {
  a.xq = acts.q.data();
  a.xd = acts.d.data();
  a.xs = acts.s.data();
  a.xi = acts.isum.data();
}

// The int8 route on AMX tiles (gemm/amx_gemm.cpp): the same activations, rows padded to a
// tile's 16, and the same panels; the same bits as block_dispatch.
// Whether a call of this many int8-activation rows takes the AMX-INT8 tiles: the amx rung above
// avx512, where the plan allows both and the call has enough rows.
bool tiles_take(int64_t tokens, int isa = current_isa().load()) {
  return isa == kAvx512 && conveyor::gemm::amx::int8_takes(tokens);
}

// Rows of the activations the tiles read: the call's, padded to a tile's 16 with zero rows.
int64_t tile_rows(int64_t tokens) { return (tokens + 15) / 16 * 16; }

// The tiles' arguments: activations quantized with rows padded to 16, and a's panels, output
// (y) and, for block_argmax, bounds (c, wmax, lo, hi).
conveyor::gemm::amx::Int8Blocks tile_args(const Acts& acts, const BlockArgs& a, int64_t tokens,
                                          int64_t panels) {
  conveyor::gemm::amx::Int8Blocks t{};
  t.xq = acts.q.data();
  t.xd = acts.d.data();
  t.xs = acts.s.data();
  t.xi = acts.isum.data();
  t.wq = a.wq;
  t.dw = a.dw;
  t.mw = a.mw;
  t.tokens = tokens;
  t.k = a.k;
  t.nb = a.nb;
  t.panels = panels;
  t.n_out = a.n_out;
  t.y = a.y;
  t.c = a.c;
  t.wmax = a.wmax;
  t.lo = a.lo;
  t.hi = a.hi;
  return t;
}

void amx_int8(const at::Tensor& x, int64_t tokens, int64_t panels, const BlockArgs& a) {
  const Acts acts = quantize(x.data_ptr<float>(), tokens, a.k, tile_rows(tokens));
  conveyor::gemm::amx::int8_block_linear(tile_args(acts, a, tokens, panels));
}

// y (T, n_out) = x (T, K) @ W^T for panel-packed blocks (pack_blocks with the same
// float_acts): int8 activations (float_acts false) or float ones.
at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& dw,
                        const at::Tensor& mw, int64_t n_out, bool float_acts) {
  check_block_panels(x_in, wq, dw, mw, n_out, float_acts);
  const at::Tensor x = x_in.contiguous();
  const int64_t tokens = x.size(0), k = x.size(1);
  const bool q4 = mw.numel() > 0;
  at::Tensor y = at::empty({tokens, n_out}, x.options());
  if (tokens == 0 || n_out == 0) return y;
  BlockArgs a = panel_args(wq, dw, mw, k, n_out, float_acts);
  a.y = y.data_ptr<float>();
  const int64_t panels = wq.size(0);
  if (float_acts) {
    a.x = x.data_ptr<float>();
    std::vector<float> sums;  // q4: each block's sum of x, in order of k
    if (q4) {
      sums = block_sums(a.x, tokens, k);
      a.xs = sums.data();
    }
    if (q4) return block_dispatch<true, true>(a, tokens, panels), y;
    return block_dispatch<false, true>(a, tokens, panels), y;
  }
  if (tiles_take(tokens)) return amx_int8(x, tokens, panels, a), y;
  const Acts quantized = quantize(x.data_ptr<float>(), tokens, k);
  set_acts(a, quantized);
  if (q4) return block_dispatch<true, false>(a, tokens, panels), y;
  return block_dispatch<false, false>(a, tokens, panels), y;
}

// block_linear(xs[i], panels[i] = (wq, dw, mw), n_outs[i], false) for every i, the same bits,
// in one parallel region: the threads share all the calls' panels, a few at a time. For a
// mixture of experts' step (layer/decoder_layer.cpp: MoE), whose experts each take a few rows:
// a region per expert, two per expert and layer, cost more than the arithmetic of a few rows.
// Calls whose rows take the AMX tiles run alone, as block_linear runs them.
constexpr int64_t kSpread = 128;

std::vector<at::Tensor> block_linear_group(const std::vector<at::Tensor>& xs,
                                           const std::vector<std::vector<at::Tensor>>& panels,
                                           const std::vector<int64_t>& n_outs) {
  const size_t calls = xs.size();
  TORCH_CHECK(panels.size() == calls && n_outs.size() == calls,
              "block_linear_group: as many panels and n_outs as xs");
  std::vector<at::Tensor> ys(calls), contiguous(calls);
  std::vector<BlockArgs> args(calls);
  std::vector<Acts> acts(calls);
  std::vector<int64_t> num_panels(calls, 0);  // 0: a call run alone, or of no rows
  const int isa = current_isa().load();
  for (size_t i = 0; i < calls; ++i) {
    TORCH_CHECK(panels[i].size() == 3, "block_linear_group: panels are (wq, dw, mw)");
    const at::Tensor &wq = panels[i][0], &dw = panels[i][1], &mw = panels[i][2];
    const int64_t tokens = xs[i].size(0);
    const bool alone = tiles_take(tokens, isa);
    if (alone || tokens == 0) {
      ys[i] = block_linear(xs[i], wq, dw, mw, n_outs[i], false);
      continue;
    }
    check_block_panels(xs[i], wq, dw, mw, n_outs[i], false);
    contiguous[i] = xs[i].contiguous();
    ys[i] = at::empty({tokens, n_outs[i]}, contiguous[i].options());
    args[i] = panel_args(wq, dw, mw, contiguous[i].size(1), n_outs[i], false);
    args[i].y = ys[i].data_ptr<float>();
    num_panels[i] = n_outs[i] > 0 ? wq.size(0) : 0;
    runs()[isa].fetch_add(1, std::memory_order_relaxed);
  }
  // The calls' activations, a call per thread at a time (each one's rows quantize as alone);
  // on this thread below kSpread rows in all, where a region costs more than they do.
  int64_t rows = 0;
  for (const at::Tensor& x : contiguous) rows += x.defined() ? x.size(0) : 0;
  const int64_t grain = rows >= kSpread ? 1 : std::max<int64_t>(1, calls);
  at::parallel_for(0, static_cast<int64_t>(calls), grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (!contiguous[i].defined()) continue;
      acts[i] = quantize(contiguous[i].data_ptr<float>(), contiguous[i].size(0), args[i].k);
      set_acts(args[i], acts[i]);
    }
  });
  for_pieces(num_panels, [&](size_t i, PanelSlice slice) {
    const int64_t tokens = contiguous[i].size(0);
    if (args[i].mw) return block_dispatch<true, false>(args[i], tokens, num_panels[i], slice);
    block_dispatch<false, false>(args[i], tokens, num_panels[i], slice);
  });
  return ys;
}

// ------------------------------------------------------------------------ greedy argmax
// The argmax of each row of the float-activations product (what block_linear(..., float_acts
// = true) returns, bit for bit, and torch.argmax would pick from it: the first of equal
// maxima), for a fraction of its cost. The int8 kernel computes every value approximately
// (approx, ~2.6x faster at 9-64 rows); the float kernel then computes exactly only the
// columns that can still be the maximum.
//
// Why that is exact: activations quantize per block b of 32 to xq = round(x / xd) with
// xd = max|x| / 127, so |x_k - xd xq_k| <= xd / 2 (plus ulps); a value's error is then at most
//   bound_n = sum_b xd_b (|dw_nb| sum_k |q_nk| + 32 |mw_nb|) / 2  <=  sum_b xd_b * wmax_n / 2,
// wmax_n = max_b (|dw_nb| sum_k |q_nk| + 32 |mw_nb|) (q4: q in 0..15), and both kernels' float
// rounding adds less than 2 * 1024 ulps of sum_b 127 xd_b wmax_n, 0.016 of the same sum; kSlack
// (0.55) covers both with room, and the bound's own arithmetic too (|approx_n| <= 127 sum_b
// xd_b wmax_n, so its roundings are below 1e-4 of bound_n). With M = max_n (approx_n -
// bound_n), a column with approx_n + bound_n < M has an exact value below that of the column
// that set M: it can be neither the maximum nor tied with it. The others (the candidates:
// 1-2 per row at the median on SmolLM2's outputs, ~3-5 on average) are computed exactly by
// the float kernel's own tile code, one panel of 16 columns at a time, so their values are
// block_linear's.
// The approximate values never leave the int8 kernel's registers: each tile reduces them to
// its rows' largest approx_n - bound_n and approx_n + bound_n per panel (lo, hi), and a panel
// whose hi is below M = max lo holds no candidate. The exact values of a panel that does are
// all compared: the columns in it that are not candidates are below the value that set M, so
// they change nothing. (Writing every approximate value and scanning the columns twice,
// as before, took a third of the call: 64 rows 9.5 ms against 6.5 for the values alone.)
// Returns -1 for a row whose values or bounds are not all finite (the caller computes that
// step's logits in full).
constexpr float kSlack = 0.55f;

template <bool Q4>
void float_panel(const BlockArgs& a, int64_t panel) {
  switch (current_isa().load()) {
#if CONVEYOR_PANEL_AVX512
    case kAvx512:
      return BlockVec<Avx512Blocks, Q4>::template FloatTile<1, 1>::run(a, panel, 0);
#endif
#if CONVEYOR_PANEL_AVX2
    case kAvx2:
      return BlockVec<Avx2Blocks, Q4>::template FloatTile<1, 1>::run(a, panel, 0);
#endif
    default:
      return BlockScalar<Q4>::template FloatTile<1, 1>::run(a, panel, 0);
  }
}

at::Tensor block_argmax(const at::Tensor& x_in, const at::Tensor& wk, const at::Tensor& wq,
                        const at::Tensor& dw, const at::Tensor& mw, const at::Tensor& wmax,
                        int64_t n_out) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(wmax.scalar_type() == at::kFloat && wmax.is_contiguous() && wmax.dim() == 1 &&
                  wmax.size(0) == n_out,
              "block_argmax: wmax must be float32 (n_out,)");
  check_block_panels(x, wq, dw, mw, n_out, false);
  TORCH_CHECK(wk.dim() == 3 && wk.size(0) == wq.size(0) && wk.size(1) == x.size(1) &&
                  wk.size(2) == kCols && wk.scalar_type() == at::kChar && wk.is_contiguous(),
              "block_argmax: float-activation panels that match the int8 ones");
  const int64_t tokens = x.size(0), k = x.size(1), nb = k / QK;
  const int64_t panels = (n_out + kCols - 1) / kCols;
  const bool q4 = mw.numel() > 0;
  at::Tensor out = at::empty({tokens}, x.options().dtype(at::kLong));
  if (tokens == 0 || n_out == 0) return out.fill_(-1);
  const float* xp = x.data_ptr<float>();
  // The int8 activations behind the approximate values: their scales xd bound the error. Rows
  // padded to a tile's 16 where the AMX-INT8 tiles take the call (the same values: amx_int8).
  const bool tiles = tiles_take(tokens);
  const Acts acts = quantize(xp, tokens, k, tiles ? tile_rows(tokens) : 0);
  std::vector<float> c(tokens);  // per row: kSlack * sum_b xd_b
  for (int64_t t = 0; t < tokens; ++t) {
    float scale_sum = 0.0f;
    for (int64_t b = 0; b < nb; ++b) scale_sum += acts.d[t * nb + b];
    c[t] = kSlack * scale_sum;
  }
  // The int8 kernel's tiles reduce their approximate values to each panel's lo and hi.
  std::vector<float> lo(tokens * panels), hi(tokens * panels);
  BlockArgs a = panel_args(wq, dw, mw, k, n_out, false);
  set_acts(a, acts);
  a.c = c.data();
  a.wmax = wmax.data_ptr<float>();
  a.lo = lo.data();
  a.hi = hi.data();
  if (tiles) {
    conveyor::gemm::amx::int8_block_linear(tile_args(acts, a, tokens, panels));
  } else if (q4) {
    block_dispatch<true, false>(a, tokens, panels);
  } else {
    block_dispatch<false, false>(a, tokens, panels);
  }
  int64_t* op = out.data_ptr<int64_t>();
  // Each block's sum of x: the float kernel's q4 term, and a finite check (a NaN in x slips
  // through the scales' max|x|).
  const std::vector<float> sums = block_sums(xp, tokens, k);
  at::parallel_for(0, tokens, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> exact(n_out);  // the candidate panels' exact values
    for (int64_t t = t0; t < t1; ++t) {
      bool finite = std::isfinite(c[t]);
      for (int64_t b = 0; b < nb; ++b) finite = finite && std::isfinite(sums[t * nb + b]);
      const float* lo_t = lo.data() + t * panels;
      const float* hi_t = hi.data() + t * panels;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < panels; ++p) {
        m = std::max(m, lo_t[p]);
        finite = finite && std::isfinite(lo_t[p]) && std::isfinite(hi_t[p]);
      }
      if (!finite) {
        op[t] = -1;
        continue;
      }
      BlockArgs f = panel_args(wk, dw, mw, k, n_out, true);
      f.x = xp + t * k;
      f.xs = q4 ? sums.data() + t * nb : nullptr;
      f.y = exact.data();
      int64_t best = -1;
      float best_value = 0.0f;
      for (int64_t p = 0; p < panels; ++p) {
        if (hi_t[p] < m) continue;
        if (q4) float_panel<true>(f, p); else float_panel<false>(f, p);
        for (int64_t n = p * kCols; n < std::min(n_out, (p + 1) * kCols); ++n)
          if (best < 0 || exact[n] > best_value) best = n, best_value = exact[n];
      }
      op[t] = best;
    }
  });
  return out;
}

// ------------------------------------------------------------------------ peak rates
// What the kernels' own instructions can do on this machine, for `python -m benchmarks step`'s
// compute roof: kChains independent chains per thread in registers, no memory traffic, on
// every torch thread at once. Returns operations per second (a multiply-add counts 2):
//   f32_fma, f64_fma   FMA on the instruction set's float lanes (the dense and lm_head kernels);
//   int8_dot           the int8 dot product of the block kernels (VNNI's vpdpbusd on AVX-512;
//                      AVX2's maddubs + int16 add: the q4 route's, whose block sums stay in
//                      int16 lanes; q8's sign trick, a madd and an int32 add more per maddubs,
//                      makes about half of it);
//   bf16_dot           AVX512-BF16's vdpbf16ps where the CPU and the build have it (else 0).
constexpr int kChains = 12;

template <typename Body>
double run_chains(int64_t iters, double ops_per_iter, const Body& body) {
  const int threads = at::get_num_threads();
  std::vector<double> sink(threads, 0.0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) sink[t] = body(iters);
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile double keep = 0.0;  // the chains' results are used, so they are computed
  for (double v : sink) keep = keep + v;
  return ops_per_iter * static_cast<double>(iters) * threads / seconds;
}

// acc = c + w * acc in kChains chains on the float lanes the dense kernel uses (Lanes<T, Isa>),
// ops per second; converges since |w| < 1.
template <typename T, int Isa>
double fma_peak(int64_t iters, T w) {
  using F = Lanes<T, Isa>;
  // AVX2's vector is two registers: 12 chains of them overflowed its 16 registers, and GCC's
  // spills halved the rate measured (a Zen 3: 134 GFLOP/s float32 on 2 threads, 6 chains 200+).
  constexpr int chains = Isa == kAvx2 ? kChains / 2 : kChains;
  return run_chains(iters, chains * F::L * 2, [w](int64_t n) {
    T start[F::L];
    std::fill(start, start + F::L, T(1e-3));
    const typename F::V c = F::load(start);
    typename F::V acc[chains];
    for (int i = 0; i < chains; ++i) acc[i] = c;
    for (int64_t it = 0; it < n; ++it)
      for (int i = 0; i < chains; ++i) acc[i] = F::fma(w, acc[i], c);
    double total = 0.0;
    for (int i = 0; i < chains; ++i) {
      F::store(start, acc[i]);
      for (T x : start) total += x;
    }
    return total;
  });
}

template <typename T>
double fma_peak_at(int isa, int64_t iters, T w) {
  switch (isa) {
#if CONVEYOR_PANEL_AVX512
    case kAvx512:
      return fma_peak<T, kAvx512>(iters, w);
#endif
#if CONVEYOR_PANEL_AVX2
    case kAvx2:
      return fma_peak<T, kAvx2>(iters, w);
#endif
    default:
      return fma_peak<T, kScalar>(iters, w);
  }
}

double peak_rate(const std::string& kind, int64_t iters) {
  TORCH_CHECK(iters > 0, "peak_rate: iters must be > 0");
  const int isa = current_isa().load();
  volatile float wf = 0.999f;
  if (kind == "amx_bf16") return conveyor::gemm::amx::peak(iters);  // 0 where there is none
  if (kind == "f32_fma") return fma_peak_at<float>(isa, iters, wf);
  if (kind == "f64_fma") return fma_peak_at<double>(isa, iters, 0.999);
#if CONVEYOR_PANEL_AVX512
  if (isa == kAvx512) {
    if (kind == "int8_dot")
      return run_chains(iters, kChains * 64 * 2, [&](int64_t n) {
        const __m512i a = _mm512_set1_epi8(static_cast<char>(3 + int(wf)));
        const __m512i b = _mm512_set1_epi8(-2);
        __m512i acc[kChains];
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_si512();
        for (int64_t it = 0; it < n; ++it)
          for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        double total = 0.0;
        for (int i = 0; i < kChains; ++i) total += _mm512_reduce_add_epi32(acc[i]);
        return total;
      });
#if defined(__AVX512BF16__)
    if (kind == "bf16_dot" && __builtin_cpu_supports("avx512bf16"))
      return run_chains(iters, kChains * 32 * 2, [&](int64_t n) {
        const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(wf), _mm512_set1_ps(wf));
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
        __m512 acc[kChains];
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t it = 0; it < n; ++it)
          for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        double total = 0.0;
        for (int i = 0; i < kChains; ++i) total += _mm512_reduce_add_ps(acc[i]);
        return total;
      });
#endif
  }
#endif
#if CONVEYOR_PANEL_AVX2
  if (isa >= kAvx2) {
    if (kind == "int8_dot")
      return run_chains(iters, kChains * 32 * 2, [&](int64_t n) {
        // The chain's own bytes are the unsigned operand, so nothing can be hoisted. (Measured
        // as maddubs + madd + int32 add until 2026-12-06: on a Zen 3 that is half the rate of
        // the q4 kernel's own mix, and a prompt chunk's step then read 111-115% of its floor.)
        // The asm statement keeps the chains in registers: GCC held some of them on the stack,
        // and a chain through memory waits for its store at every step (this measured half
        // the rate of the kernels' own loops).
        const __m256i b = _mm256_set1_epi8(static_cast<char>(-2 + int(wf)));
        __m256i acc[kChains];
        for (int i = 0; i < kChains; ++i) acc[i] = _mm256_setzero_si256();
        for (int64_t it = 0; it < n; ++it) {
          for (int i = 0; i < kChains; ++i)
            acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(acc[i], b));
          asm volatile("" : "+x"(acc[0]), "+x"(acc[1]), "+x"(acc[2]), "+x"(acc[3]), "+x"(acc[4]),
                       "+x"(acc[5]), "+x"(acc[6]), "+x"(acc[7]), "+x"(acc[8]), "+x"(acc[9]),
                       "+x"(acc[10]), "+x"(acc[11]));
        }
        double total = 0.0;
        for (int i = 0; i < kChains; ++i) {
          int32_t lanes[8];
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), acc[i]);
          for (int32_t x : lanes) total += x;
        }
        return total;
      });
  }
#endif
  TORCH_CHECK(kind == "int8_dot" || kind == "bf16_dot",
              "peak_rate: kind is f32_fma, f64_fma, int8_dot, bf16_dot or amx_bf16");
  if (kind == "bf16_dot") return 0.0;  // not on this CPU, build or instruction set
  // The scalar path: one integer multiply-add per operation.
  return run_chains(iters, kChains * 2, [&](int64_t n) {
    uint32_t acc[kChains] = {};
    const uint32_t a = 3 + int(wf), b = 7;
    for (int64_t it = 0; it < n; ++it)
      for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * a + b;
    double total = 0.0;
    for (uint32_t x : acc) total += x;
    return total;
  });
}

}  // namespace conveyor::gemm::panel
