// Mamba2's selective state-space layer (model/recurrent.py Mamba2Mixer, its reference twin
// `mamba2_reference`): after the causal convolution (deltanet.cpp's causal_conv), the step's
// rows in three passes, each value's arithmetic in one order whatever else the step holds:
//   1. row by row: silu(conv + bias) of x, B and C (a value's bits depend on its column alone);
//   2. each (sequence, head) pair on its own thread, token by token: dt = softplus(dt_raw +
//      dt_bias) clamped, the state (P, N) decayed by exp(dt A) and added (dt x) B^T, the
//      output y = S C + D x;
//   3. row by row: y * silu(z), RMS-normed per group of heads, times the norm's weight.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "isa/vec.h"
#include "ops.h"

namespace conveyor::layer {

using vec::kLanes;
using vec::load;
using vec::store;
using vec::Vec;

namespace {

// silu(x + bias) over n values (float32 vectors by column, the tail and float64 scalar).
template <typename T>
void silu_biased(const T* x, const T* bias, T* out, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + kLanes<T> <= n; i += kLanes<T>) {
      const Vec<T> v = load(x + i) + load(bias + i);
      store(out + i, v / (T(1) + vec::vexp<T>(-v)));
    }
  }
  for (; i < n; ++i) {
    const T v = x[i] + bias[i];
    out[i] = v / (T(1) + std::exp(-v));
  }
}

// y *= silu(z) over n values (float32 vectors by column, the tail and float64 scalar).
template <typename T>
void silu_gate(T* y, const T* z, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + kLanes<T> <= n; i += kLanes<T>) {
      const Vec<T> g = load(z + i);
      store(y + i, load(y + i) * (g / (T(1) + vec::vexp<T>(-g))));
    }
  }
  for (; i < n; ++i) y[i] = y[i] * (z[i] / (T(1) + std::exp(-z[i])));
}

// The sum of a vector's lanes, in lane order.
template <typename T>
inline T lane_sum(Vec<T> v) {
  T s = v[0];
  for (int i = 1; i < kLanes<T>; ++i) s += v[i];
  return s;
}

// One (sequence, head) pair's `steps` tokens: S (P, N) updated in place; y (P per token,
// `y_stride` apart) = S C + D x. x, B, C: the activated rows (`row_stride` apart) at the head's
// and its group's columns; dt: the raw time steps (`dt_stride` apart).
template <typename T>
void pair_scan(T* S, int64_t P, int64_t N, int64_t steps, const T* x, const T* B, const T* C,
               int64_t row_stride, const T* dt, int64_t dt_stride, T A, T dt_bias, T D,
               T dt_min, T dt_max, T* y, int64_t y_stride) {
  constexpr int L = kLanes<T>;
  const bool vectors = N % L == 0;
  for (int64_t t = 0; t < steps; ++t) {
    const T raw = dt[t * dt_stride] + dt_bias;
    const T d = std::min(std::max(raw > T(20) ? raw : std::log1p(std::exp(raw)), dt_min), dt_max);
    const T dA = std::exp(d * A);
    const T *xt = x + t * row_stride, *Bt = B + t * row_stride, *Ct = C + t * row_stride;
    T* yt = y + t * y_stride;
    for (int64_t p = 0; p < P; ++p) {
      T* s = S + p * N;
      const T xd = xt[p] * d;
      T acc;
      if (vectors) {
        const Vec<T> decay = vec::broadcast(dA), input = vec::broadcast(xd);
        Vec<T> sum{};
        for (int64_t n = 0; n < N; n += L) {
          const Vec<T> v = vec::fmadd<T>(load(s + n), decay, input * load(Bt + n));
          store(s + n, v);
          sum = vec::fmadd<T>(v, load(Ct + n), sum);
        }
        acc = lane_sum<T>(sum);
      } else {
        acc = 0;
        for (int64_t n = 0; n < N; ++n) {
          const T v = std::fma(s[n], dA, xd * Bt[n]);
          s[n] = v;
          acc = std::fma(v, Ct[n], acc);
        }
      }
      yt[p] = acc + D * xt[p];
    }
  }
}

// A row's y * silu(z), RMS-normed per group of `size` values, times w (in place in y).
template <typename T>
void gated_norm_row(T* y, const T* z, const T* w, int64_t groups, int64_t size, T eps) {
  for (int64_t g = 0; g < groups; ++g) {
    T* yg = y + g * size;
    const T* zg = z + g * size;
    silu_gate(yg, zg, size);
    T ss = 0;
    int64_t i = 0;
    if (size % kLanes<T> == 0) {
      Vec<T> acc{};
      for (; i < size; i += kLanes<T>) acc = vec::fmadd<T>(load(yg + i), load(yg + i), acc);
      ss = lane_sum<T>(acc);
    } else {
      for (; i < size; ++i) ss = std::fma(yg[i], yg[i], ss);
    }
    const T r = T(1) / std::sqrt(ss / static_cast<T>(size) + eps);
    const T* wg = w + g * size;
    for (i = 0; i < size; ++i) yg[i] = yg[i] * r * wg[i];
  }
}

template <typename T>
void run_mamba2(at::Tensor& state, const int64_t* slot, const std::vector<int64_t>& starts,
                const at::Tensor& conv, const at::Tensor& conv_bias, const at::Tensor& dt,
                const at::Tensor& z, const at::Tensor& A_log, const at::Tensor& dt_bias,
                const at::Tensor& D, const at::Tensor& norm_weight, double eps, int64_t groups,
                double dt_min, double dt_max, at::Tensor& out) {
  const int64_t H = state.size(1), P = state.size(2), N = state.size(3);
  const int64_t T_rows = conv.size(0), width = conv.size(1), inner = H * P;
  const int64_t heads_per_group = H / groups;
  const int64_t num_seqs = static_cast<int64_t>(starts.size()) - 1;
  // 1. the activated x, B and C
  at::Tensor act = at::empty({T_rows, width}, conv.options());
  const T *cp = conv.data_ptr<T>(), *bias = conv_bias.data_ptr<T>();
  T* ap = act.data_ptr<T>();
  at::parallel_for(0, T_rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_biased<T>(cp + r * width, bias, ap + r * width, width);
  });
  // 2. the scan, (sequence, head) pairs
  T* S = state.data_ptr<T>();
  const T* dp = dt.data_ptr<T>();
  const int64_t dt_stride = dt.stride(0);
  const T *Al = A_log.data_ptr<T>(), *db = dt_bias.data_ptr<T>(), *Dp = D.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_seqs * H, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t s = q / H, h = q % H, g = h / heads_per_group, begin = starts[s];
      const T* row = ap + begin * width;
      pair_scan<T>(S + (slot[s] * H + h) * P * N, P, N, starts[s + 1] - begin, row + h * P,
                   row + inner + g * N, row + inner + (groups + g) * N, width,
                   dp + begin * dt_stride + h, dt_stride, -std::exp(Al[h]), db[h], Dp[h],
                   static_cast<T>(dt_min), static_cast<T>(dt_max), op + begin * inner + h * P,
                   inner);
    }
  });
  // 3. gated and normed, row by row
  const T *zp = z.data_ptr<T>(), *w = norm_weight.data_ptr<T>();
  const int64_t z_stride = z.stride(0);
  at::parallel_for(0, T_rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      gated_norm_row<T>(op + r * inner, zp + r * z_stride, w, groups, inner / groups,
                        static_cast<T>(eps));
  });
}

}  // namespace

at::Tensor mamba2_mix(at::Tensor& state, const at::Tensor& slots,
                      const std::vector<int64_t>& starts, const at::Tensor& conv,
                      const at::Tensor& conv_bias, const at::Tensor& dt, const at::Tensor& z,
                      const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& D,
                      const at::Tensor& norm_weight, double eps, int64_t groups, double dt_min,
                      double dt_max) {
  const auto dtype = state.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kDouble) && state.dim() == 4 &&
                  state.is_contiguous(),
              "mamba2_mix: state (slots, H, P, N), float32/64, contiguous");
  const int64_t H = state.size(1), P = state.size(2), N = state.size(3), inner = H * P;
  TORCH_CHECK(groups > 0 && H % groups == 0, "mamba2_mix: groups divide the heads");
  const int64_t T_rows = conv.size(0);
  TORCH_CHECK(conv.dim() == 2 && conv.size(1) == inner + 2 * groups * N && conv.is_contiguous(),
              "mamba2_mix: conv (T, H P + 2 G N), contiguous");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == T_rows && dt.size(1) == H && dt.stride(1) == 1,
              "mamba2_mix: dt (T, H), rows of unit stride");
  TORCH_CHECK(z.dim() == 2 && z.size(0) == T_rows && z.size(1) == inner && z.stride(1) == 1,
              "mamba2_mix: z (T, H P), rows of unit stride");
  TORCH_CHECK(conv_bias.numel() == conv.size(1), "mamba2_mix: conv_bias (H P + 2 G N,)");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == H && D.numel() == H &&
                  norm_weight.numel() == inner,
              "mamba2_mix: A_log, dt_bias, D (H,), norm_weight (H P,)");
  TORCH_CHECK(slots.scalar_type() == at::kLong &&
                  slots.numel() + 1 == static_cast<int64_t>(starts.size()) &&
                  starts.front() == 0 && starts.back() == T_rows,
              "mamba2_mix: slots (S,), starts (S + 1,) from 0 to conv's rows");
  for (const at::Tensor* t : {&conv, &conv_bias, &dt, &z, &A_log, &dt_bias, &D, &norm_weight})
    TORCH_CHECK(t->scalar_type() == dtype, "mamba2_mix: every tensor of the state's dtype");
  const at::Tensor sl = slots.contiguous(), bc = conv_bias.contiguous(), Ac = A_log.contiguous(),
                   dc = dt_bias.contiguous(), Dc = D.contiguous(), wc = norm_weight.contiguous();
  at::Tensor out = at::empty({T_rows, inner}, state.options());
  if (dtype == at::kFloat)
    run_mamba2<float>(state, sl.data_ptr<int64_t>(), starts, conv, bc, dt, z, Ac, dc, Dc, wc, eps,
                      groups, dt_min, dt_max, out);
  else
    run_mamba2<double>(state, sl.data_ptr<int64_t>(), starts, conv, bc, dt, z, Ac, dc, Dc, wc,
                       eps, groups, dt_min, dt_max, out);
  return out;
}

}  // namespace conveyor::layer
