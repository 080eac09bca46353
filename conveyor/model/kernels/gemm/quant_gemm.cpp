// Quantized linear layers on CPU: y = x @ W^T with W kept in 32-element blocks (GGUF-style),
// for the small token counts of decode steps, where reading the weights is the cost.
//
// Python signatures (reference twins in conveyor/model/quant.py):
//   q4_linear(x: f32 (T, K), qs: u8 (N, K/2), d: i16 (N, K/32), m: i16 (N, K/32)) -> f32 (T, N)
//   q8_linear(x: f32 (T, K), qs: i8 (N, K),   d: i16 (N, K/32))                  -> f32 (T, N)
//   q4_dequantize(qs, d, m) -> f32 (N, K);  q8_dequantize(qs, d) -> f32 (N, K)
// d and m hold float16 bit patterns (stored as int16 so that Module.to(dtype) leaves them alone).
//
// Weight layout, per row n and block b (elements 32b .. 32b+31):
//   q4: 16 bytes qs[n, 16b : 16b+16]; byte j holds element 32b+j in its low nibble and element
//       32b+16+j in its high nibble (GGUF's Q4_0/Q4_1 order); value = q * d[n, b] + m[n, b].
//   q8: 32 signed bytes qs[n, 32b : 32b+32]; value = q * d[n, b].
//
// Activations are quantized once per call, per token and block, to int8 with a float scale
// (xd = max|x| / 127) and the block's scaled sum (xs = xd * sum(q)), so that a block's dot
// product is one integer dot product:
//   q4: sum_j (q_j d + m) x_j ~= d * xd * sum_j q_j xq_j + m * xs
//   q8: sum_j q_j d x_j      ~= d * xd * sum_j q_j xq_j
// The integer dot uses AVX2's maddubs (unsigned x signed bytes -> int16 pair sums): 4-bit
// weights are unsigned already; int8 weights take the sign trick (|w| times x with w's sign).
//
// Loop order: threads split the output rows (balanced_for, isa/balance.h); inside a thread, tokens
// are taken in tiles of TOKEN_TILE (their int8 rows stay in L1/L2), and for each weight row
// the unpacked block is reused for up to 4 tokens (4 accumulators).

#include <torch/extension.h>

#include "ops.h"

#if CONVEYOR_QUANT_KERNELS  // the x86 AVX2 + FMA + F16C code below; elsewhere, stubs at the end

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "isa/balance.h"

#include <cmath>
#include <cstdint>
#include <vector>
#include <cstring>

namespace conveyor::gemm::quant {

constexpr int64_t QK = 32;          // elements per block
constexpr int64_t TOKEN_TILE = 64;  // tokens whose int8 rows are reused across weight rows

inline float half_to_float(int16_t bits) { return _cvtsh_ss(static_cast<uint16_t>(bits)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of int8 products of 32 unsigned (a) and 32 signed (b) bytes, as 8 float lanes.
inline __m256 dot_u8_i8(__m256i a, __m256i b) {
  const __m256i pairs = _mm256_maddubs_epi16(a, b);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

struct QuantizedActs {
  at::Tensor q;   // int8 (T, K)
  at::Tensor d;   // float (T, K/32)
  at::Tensor s;   // float (T, K/32): d * sum of the block's int8 values
};

// gemm/panel_gemm.cpp's int8 rounding (the same values: round half to even of x * (127 / max|x|)).
void quantize_row(const float* x, int64_t num_blocks, int8_t* q, float* d, float* s) {
  conveyor::gemm::panel::quantize_token_avx2(x, num_blocks, q, d, s, nullptr);
}

QuantizedActs quantize_acts(const at::Tensor& x) {
  const int64_t T = x.size(0), K = x.size(1), nb = K / QK;
  QuantizedActs a{at::empty({T, K}, x.options().dtype(at::kChar)),
                  at::empty({T, nb}, x.options()), at::empty({T, nb}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.q.data_ptr<int8_t>();
  float* dp = a.d.data_ptr<float>();
  float* sp = a.s.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      quantize_row(xp + t * K, nb, qp + t * K, dp + t * nb, sp + t * nb);
    }
  });
  return a;
}

inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
  return _mm256_set_m128i(hi, lo);
}

inline __m256i load_block(const uint8_t* wq, int64_t b, bool q8) {
  return q8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QK))
            : unpack_q4(wq + b * (QK / 2));
}

inline __m256 broadcast_lane(__m256 v, int lane) {
  return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(lane));
}

// One weight row against NT consecutive tokens (NT <= 4). W_Q8: the row is int8, else 4-bit.
// Blocks go in groups of 8 so that the 8 weight scales convert in one instruction and the
// per-block scale products d * xd are one vector multiply; two accumulators per token (even
// and odd blocks) keep the FMA latency chain off the critical path.
template <bool W_Q8, int NT>
inline void row_dot(const uint8_t* wq, const int16_t* wd, const int16_t* wm, int64_t nb,
                    const int8_t* xq, const float* xd, const float* xs, int64_t K, float* out,
                    int64_t out_stride) {
  __m256 acc[NT][2];
  __m256 min_acc[NT];
  for (int t = 0; t < NT; ++t) {
    acc[t][0] = acc[t][1] = min_acc[t] = _mm256_setzero_ps();
  }
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b0)));
    __m256 scale[NT];
    for (int t = 0; t < NT; ++t) {
      scale[t] = _mm256_mul_ps(dw, _mm256_loadu_ps(xd + t * nb + b0));
      if constexpr (!W_Q8) {
        const __m256 mw =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + b0)));
        min_acc[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + t * nb + b0), min_acc[t]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load_block(wq, b0 + j, W_Q8);
      const __m256i w_abs = W_Q8 ? _mm256_sign_epi8(w, w) : w;
      for (int t = 0; t < NT; ++t) {
        __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + (b0 + j) * QK));
        if constexpr (W_Q8) xv = _mm256_sign_epi8(xv, w);
        acc[t][j & 1] =
            _mm256_fmadd_ps(broadcast_lane(scale[t], j), dot_u8_i8(w_abs, xv), acc[t][j & 1]);
      }
    }
  }
  float tail[NT] = {};
  for (int64_t b = b0; b < nb; ++b) {
    const float dw = half_to_float(wd[b]);
    const __m256i w = load_block(wq, b, W_Q8);
    const __m256i w_abs = W_Q8 ? _mm256_sign_epi8(w, w) : w;
    for (int t = 0; t < NT; ++t) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * QK));
      if constexpr (W_Q8) xv = _mm256_sign_epi8(xv, w);
      acc[t][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[t * nb + b]), dot_u8_i8(w_abs, xv),
                                      acc[t][b & 1]);
      if constexpr (!W_Q8) tail[t] += half_to_float(wm[b]) * xs[t * nb + b];
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), min_acc[t]);
    out[t * out_stride] = hsum(sum) + tail[t];
  }
}

template <bool W_Q8>
at::Tensor linear_impl(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                       const at::Tensor& m) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 (T, K)");
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), K = x.size(1), N = qs.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(qs.size(1) == (W_Q8 ? K : K / 2) && d.size(0) == N && d.size(1) == nb,
              "weight blocks do not match x");
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && (W_Q8 || m.is_contiguous()),
              "weight blocks must be contiguous");
  at::Tensor out = at::empty({T, N}, x.options());
  if (T == 0) return out;
  const QuantizedActs a = quantize_acts(x);
  const uint8_t* wq = static_cast<const uint8_t*>(qs.data_ptr());
  const int16_t* wd = d.data_ptr<int16_t>();
  const int16_t* wm = W_Q8 ? nullptr : m.data_ptr<int16_t>();
  const int8_t* xq = a.q.data_ptr<int8_t>();
  const float* xd = a.d.data_ptr<float>();
  const float* xs = a.s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = W_Q8 ? K : K / 2;
  conveyor::balance::balanced_for(N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = 0; t0 < T; t0 += TOKEN_TILE) {
      const int64_t t1 = std::min(T, t0 + TOKEN_TILE);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* wrow = wq + n * row_bytes;
        const int16_t* drow = wd + n * nb;
        const int16_t* mrow = W_Q8 ? nullptr : wm + n * nb;
        int64_t t = t0;
        for (; t + 4 <= t1; t += 4) {
          row_dot<W_Q8, 4>(wrow, drow, mrow, nb, xq + t * K, xd + t * nb, xs + t * nb, K,
                           op + t * N + n, N);
        }
        const int64_t left = t1 - t;
        const int8_t* xqt = xq + t * K;
        const float* xdt = xd + t * nb;
        const float* xst = xs + t * nb;
        float* ot = op + t * N + n;
        if (left == 3) row_dot<W_Q8, 3>(wrow, drow, mrow, nb, xqt, xdt, xst, K, ot, N);
        if (left == 2) row_dot<W_Q8, 2>(wrow, drow, mrow, nb, xqt, xdt, xst, K, ot, N);
        if (left == 1) row_dot<W_Q8, 1>(wrow, drow, mrow, nb, xqt, xdt, xst, K, ot, N);
      }
    }
  });
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m) {
  return linear_impl<false>(x, qs, d, m);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return linear_impl<true>(x, qs, d, d);
}

// Float rows of a block-quantized matrix; the prefill path multiplies them with MKL.
template <bool W_Q8>
at::Tensor dequantize_impl(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t N = qs.size(0), nb = d.size(1), K = nb * QK;
  at::Tensor out = at::empty({N, K}, d.options().dtype(at::kFloat));
  const uint8_t* wq = static_cast<const uint8_t*>(qs.data_ptr());
  const int16_t* wd = d.data_ptr<int16_t>();
  const int16_t* wm = W_Q8 ? nullptr : m.data_ptr<int16_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 256, [&](int64_t i0, int64_t i1) {
    alignas(32) int8_t q[QK];
    for (int64_t i = i0; i < i1; ++i) {
      const float dw = half_to_float(wd[i]);
      const float mw = W_Q8 ? 0.0f : half_to_float(wm[i]);
      if constexpr (W_Q8) {
        std::memcpy(q, wq + i * QK, QK);
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(q), unpack_q4(wq + i * (QK / 2)));
      }
      for (int j = 0; j < QK; j += 8) {
        const __m256 v = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j))));
        _mm256_storeu_ps(op + i * QK + j,
                         _mm256_fmadd_ps(v, _mm256_set1_ps(dw), _mm256_set1_ps(mw)));
      }
    }
  });
  return out;
}

// Large token counts: the step is compute-bound and MKL's float GEMM is faster than the
// integer blocks. Each thread dequantizes DEQUANT_ROWS weight rows into a buffer that stays
// in L2 and multiplies it there (the nested at::mm runs single-threaded inside parallel_for),
// so no float copy of the whole weight is ever made.
constexpr int64_t DEQUANT_ROWS = 256;

// A few float rows against block weights without rounding the activations: each block's
// values are widened once and multiplied with every token's float values,
//   sum_j (q_j d + m) x_j = d * sum_j q_j x_j + m * sum_j x_j,
// so the result is the float product with the dequantized weight (up to summation order), as
// the tiles give it, but the weight is read once as blocks (a tied Q8_0 lm_head: 30 MB, not
// 113 MB of float tiles through the caches). Tokens in groups of up to 4 per weight row.
constexpr int64_t FLOAT_ACTS_MAX_TOKENS = 16;

template <bool W_Q8, int NT>
inline void row_float(const uint8_t* wq, const int16_t* wd, const int16_t* wm, int64_t nb,
                      const float* x, const float* xsum, int64_t K, float* out, int64_t N) {
  __m256 acc[NT];
  float mins[NT] = {};
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  alignas(32) int8_t q[QK];
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 dw = _mm256_set1_ps(half_to_float(wd[b]));
    const int8_t* qb;
    if constexpr (W_Q8) {
      qb = reinterpret_cast<const int8_t*>(wq + b * QK);
    } else {
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), unpack_q4(wq + b * (QK / 2)));
      qb = q;
    }
    __m256 w[4];
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i))));
    }
    for (int t = 0; t < NT; ++t) {
      const float* xb = x + t * K + b * QK;
      __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
      for (int i = 1; i < 4; ++i) s = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), s);
      acc[t] = _mm256_fmadd_ps(dw, s, acc[t]);
      if constexpr (!W_Q8) mins[t] += half_to_float(wm[b]) * xsum[t * nb + b];
    }
  }
  for (int t = 0; t < NT; ++t) out[t * N] = hsum(acc[t]) + mins[t];
}

template <bool W_Q8>
at::Tensor linear_float_acts_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                                  const at::Tensor& m) {
  const int64_t T = x.size(0), K = x.size(1), N = qs.size(0), nb = K / QK;
  TORCH_CHECK(x.scalar_type() == at::kFloat && qs.size(1) == (W_Q8 ? K : K / 2) &&
                  d.size(0) == N && d.size(1) == nb,
              "weight blocks do not match x");
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && (W_Q8 || m.is_contiguous()),
              "weight blocks must be contiguous");
  at::Tensor out = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(T * nb);  // the m term's block sums (q4)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0;
      for (int64_t j = 0; j < QK; ++j) s += xp[t * K + b * QK + j];
      xsum[t * nb + b] = s;
    }
  const uint8_t* wq = static_cast<const uint8_t*>(qs.data_ptr());
  const int16_t* wd = d.data_ptr<int16_t>();
  const int16_t* wm = W_Q8 ? nullptr : m.data_ptr<int16_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = W_Q8 ? K : K / 2;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = wq + n * row_bytes;
      const int16_t* drow = wd + n * nb;
      const int16_t* mrow = W_Q8 ? nullptr : wm + n * nb;
      for (int64_t t = 0; t < T;) {
        const int64_t left = T - t;
        const float* xt = xp + t * K;
        const float* st = xsum.data() + t * nb;
        float* ot = op + t * N + n;
        if (left >= 4) {
          row_float<W_Q8, 4>(wrow, drow, mrow, nb, xt, st, K, ot, N);
          t += 4;
        } else if (left == 3) {
          row_float<W_Q8, 3>(wrow, drow, mrow, nb, xt, st, K, ot, N);
          t += 3;
        } else if (left == 2) {
          row_float<W_Q8, 2>(wrow, drow, mrow, nb, xt, st, K, ot, N);
          t += 2;
        } else {
          row_float<W_Q8, 1>(wrow, drow, mrow, nb, xt, st, K, ot, N);
          t += 1;
        }
      }
    }
  });
  return out;
}

template <bool W_Q8>
at::Tensor linear_dequant_impl(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                               const at::Tensor& m) {
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), N = qs.size(0);
  if (T <= FLOAT_ACTS_MAX_TOKENS && x.size(1) % QK == 0) {
    return linear_float_acts_impl<W_Q8>(x, qs, d, m);
  }
  at::Tensor out = at::empty({T, N}, x.options());
  // Tiles of at most DEQUANT_ROWS rows, as many as a multiple of the thread count and of even
  // size: 576 rows as 256 + 256 + 64 left one of 2 threads a ninth of the work, and the o and
  // down projections of a 512-token prefill took 2x the float32 time (1.1x once balanced).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t num_chunks = (N + DEQUANT_ROWS - 1) / DEQUANT_ROWS;
  num_chunks = std::min((num_chunks + threads - 1) / threads * threads, (N + 15) / 16);
  const int64_t chunk_rows = ((N + num_chunks - 1) / num_chunks + 15) / 16 * 16;
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * chunk_rows, rows = std::min(chunk_rows, N - n0);
      if (rows <= 0) continue;
      const at::Tensor w = dequantize_impl<W_Q8>(qs.narrow(0, n0, rows), d.narrow(0, n0, rows),
                                                 W_Q8 ? d : m.narrow(0, n0, rows));
      // Raw copy: worker threads do not inherit InferenceMode, so an in-place ATen op on an
      // inference-mode `out` would be refused there.
      const at::Tensor tile = at::mm(x, w.t()).contiguous();  // (T, rows)
      const float* src = tile.data_ptr<float>();
      float* dst = out.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(dst + t * N + n0, src + t * rows, rows * sizeof(float));
      }
    }
  });
  return out;
}

at::Tensor q4_linear_dequant(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                             const at::Tensor& m) {
  return linear_dequant_impl<false>(x, qs, d, m);
}

at::Tensor q8_linear_dequant(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return linear_dequant_impl<true>(x, qs, d, d);
}

at::Tensor q4_dequantize(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  return dequantize_impl<false>(qs.contiguous(), d.contiguous(), m.contiguous());
}

at::Tensor q8_dequantize(const at::Tensor& qs, const at::Tensor& d) {
  return dequantize_impl<true>(qs.contiguous(), d.contiguous(), d);
}

// Activations for fbgemm's per-tensor int8 route (quant.py int8_linear), in one pass over x:
// input channels where some token exceeds ratio x its RMS are the outliers; they are zeroed in
// the scaled copy and returned gathered (float), and every row is scaled to max|x| = 1 over the
// remaining channels. Returns (scaled (T, K), row max (T, 1), cols (C,) int64, outliers (T, C)).
std::vector<at::Tensor> int8_prepare(const at::Tensor& x_in, double ratio) {
  const at::Tensor x = x_in.contiguous();
  const int64_t t_count = x.size(0), k = x.size(1);
  const float* xp = x.data_ptr<float>();
  std::vector<uint8_t> outlier(k, 0);
  for (int64_t t = 0; t < t_count; ++t) {
    const float* row = xp + t * k;
    double sumsq = 0;
    for (int64_t i = 0; i < k; ++i) sumsq += row[i] * row[i];
    const float limit = static_cast<float>(ratio * std::sqrt(sumsq / k));
    for (int64_t i = 0; i < k; ++i) outlier[i] |= std::fabs(row[i]) > limit;
  }
  std::vector<int64_t> cols;
  for (int64_t i = 0; i < k; ++i)
    if (outlier[i]) cols.push_back(i);
  const int64_t c = static_cast<int64_t>(cols.size());
  at::Tensor scaled = at::empty_like(x), amax = at::empty({t_count, 1}, x.options());
  at::Tensor gathered = at::empty({t_count, c}, x.options());
  float *sp = scaled.data_ptr<float>(), *ap = amax.data_ptr<float>();
  float* gp = gathered.data_ptr<float>();
  for (int64_t t = 0; t < t_count; ++t) {
    const float* row = xp + t * k;
    float top = 1e-30f;
    for (int64_t i = 0; i < k; ++i)
      if (!outlier[i]) top = std::max(top, std::fabs(row[i]));
    const float inv = 1.0f / top;
    for (int64_t i = 0; i < k; ++i) sp[t * k + i] = outlier[i] ? 0.0f : row[i] * inv;
    for (int64_t j = 0; j < c; ++j) gp[t * c + j] = row[cols[j]];
    ap[t] = top;
  }
  at::Tensor col_tensor = at::empty({c}, x.options().dtype(at::kLong));
  if (c) std::memcpy(col_tensor.data_ptr<int64_t>(), cols.data(), c * sizeof(int64_t));
  return {scaled, amax, col_tensor, gathered};
}

// Float (N, C): the given input columns of a block matrix, dequantized (q4 when m is defined).
template <bool W_Q8>
at::Tensor columns_impl(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        const at::Tensor& cols) {
  const int64_t n = d.size(0), nb = d.size(1), c = cols.size(0);
  const int64_t row_bytes = W_Q8 ? nb * 32 : nb * 16;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const int16_t *dp = d.data_ptr<int16_t>(), *mp = m.data_ptr<int16_t>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  at::Tensor out = at::empty({n, c}, d.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < c; ++j) {
      const int64_t b = cp[j] / 32, pos = cp[j] % 32;
      const float dw = half_to_float(dp[r * nb + b]);
      if constexpr (W_Q8) {
        op[r * c + j] = static_cast<int8_t>(q[r * row_bytes + cp[j]]) * dw;
      } else {
        const uint8_t byte = q[r * row_bytes + b * 16 + pos % 16];
        const int v = pos < 16 ? (byte & 0x0F) : (byte >> 4);
        op[r * c + j] = v * dw + half_to_float(mp[r * nb + b]);
      }
    }
  }
  return out;
}

at::Tensor q4_columns(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                      const at::Tensor& cols) {
  return columns_impl<false>(qs.contiguous(), d.contiguous(), m.contiguous(), cols.contiguous());
}

at::Tensor q8_columns(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& cols) {
  return columns_impl<true>(qs.contiguous(), d.contiguous(), d.contiguous(), cols.contiguous());
}

}  // namespace conveyor::gemm::quant

#else  // not an AVX2 + FMA + F16C build: every op refuses (quant.py checks the CPU first)

namespace conveyor::gemm::quant {
#define CONVEYOR_NO_KERNEL(...) \
  { TORCH_CHECK(false, "conveyor: the quantized kernels need an x86 CPU with AVX2, FMA, F16C"); }
at::Tensor q4_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)
    CONVEYOR_NO_KERNEL()
at::Tensor q8_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&) CONVEYOR_NO_KERNEL()
at::Tensor q4_linear_dequant(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&) CONVEYOR_NO_KERNEL()
at::Tensor q8_linear_dequant(const at::Tensor&, const at::Tensor&, const at::Tensor&)
    CONVEYOR_NO_KERNEL()
at::Tensor q4_dequantize(const at::Tensor&, const at::Tensor&, const at::Tensor&)
    CONVEYOR_NO_KERNEL()
at::Tensor q8_dequantize(const at::Tensor&, const at::Tensor&) CONVEYOR_NO_KERNEL()
std::vector<at::Tensor> int8_prepare(const at::Tensor&, double) CONVEYOR_NO_KERNEL()
at::Tensor q4_columns(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)
    CONVEYOR_NO_KERNEL()
at::Tensor q8_columns(const at::Tensor&, const at::Tensor&, const at::Tensor&)
    CONVEYOR_NO_KERNEL()
#undef CONVEYOR_NO_KERNEL
}  // namespace conveyor::gemm::quant

#endif  // CONVEYOR_QUANT_KERNELS
