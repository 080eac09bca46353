// Gated delta nets (model/recurrent.py, its reference twin `delta_rule_reference`): the delta
// rule over L steps of N sequences, each (sequence, value head) pair on its own thread, so a
// token's values never depend on what else the step holds; and row-wise activations whose
// bits do not depend on the row count (ATen's sigmoid and silu take a vector path or a scalar
// one by a value's place in the whole tensor).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "isa/vec.h"
#include "ops.h"

namespace conveyor::layer {

using vec::kLanes;
using vec::load;
using vec::madd;
using vec::store;
using vec::Vec;

namespace {

template <typename T>
inline T silu(T x) {
  return x / (T(1) + std::exp(-x));
}

// A token's inputs to the rule: q and k (silu, L2-normed, q scaled), v (silu), the decay and
// beta (from a and b: softplus, exp, sigmoid).
template <typename T>
inline void token_inputs(const T* m, T a, T b, int64_t head, int64_t key_head, int64_t keys,
                         int64_t Dk, int64_t Dv, T A, T dt_bias, T* q, T* k, T* v, T* decay,
                         T* beta) {
  const T scale = T(1) / std::sqrt(static_cast<T>(Dk));
  T qq = 0, kk = 0;
  for (int64_t i = 0; i < Dk; ++i) {
    q[i] = silu(m[key_head * Dk + i]);
    k[i] = silu(m[keys + key_head * Dk + i]);
    qq += q[i] * q[i];
    kk += k[i] * k[i];
  }
  const T q_inv = T(1) / std::sqrt(qq + T(1e-6)), k_inv = T(1) / std::sqrt(kk + T(1e-6));
  for (int64_t i = 0; i < Dk; ++i) {
    q[i] = q[i] * q_inv * scale;
    k[i] = k[i] * k_inv;
  }
  for (int64_t j = 0; j < Dv; ++j) v[j] = silu(m[2 * keys + head * Dv + j]);
  const T x = a + dt_bias;
  const T softplus = x > T(20) ? x : std::log1p(std::exp(x));
  *decay = std::exp(-A * softplus);
  *beta = T(1) / (T(1) + std::exp(-b));
}

// The value columns a register block holds: kBlock vectors (the columns of S are independent:
// column j's kv, delta and output read column j of S alone).
template <typename T>
constexpr int kBlock = vec::kRegisters >= 32 ? 4 : 2;

// The rule over `steps` tokens for one block of kBlock vectors of value columns, S (Dk rows of
// `Dv` values, the block at its columns): one pass over the block per token, which adds the
// token's correction, reads its output, then decays the block by the next token's decay and
// reads the next token's kv; each value's operations in the two-pass order (decay, then
// correct), each sum over the key dims in one order.
template <typename T>
void column_block(T* S, int64_t Dk, int64_t Dv, int64_t steps, const T* q, const T* k,
                  const T* v, const T* decay, const T* beta, T* o) {
  constexpr int W = kBlock<T>, L = kLanes<T>;
  Vec<T> kv[W], next[W], acc[W], delta[W];
  for (int w = 0; w < W; ++w) kv[w] = Vec<T>{};
  const Vec<T> d0 = vec::broadcast(decay[0]);
  for (int64_t i = 0; i < Dk; ++i) {  // the first token's decay and kv
    T* row = S + i * Dv;
    const Vec<T> ki = vec::broadcast(k[i]);
    for (int w = 0; w < W; ++w) {
      const Vec<T> s = load(row + w * L) * d0;
      store(row + w * L, s);
      kv[w] = madd<T>(s, ki, kv[w]);
    }
  }
  for (int64_t t = 0; t < steps; ++t) {
    const T* kt = k + t * Dk;
    const T* qt = q + t * Dk;
    const Vec<T> bt = vec::broadcast(beta[t]);
    for (int w = 0; w < W; ++w) {
      delta[w] = (load(v + t * Dv + w * L) - kv[w]) * bt;
      acc[w] = next[w] = Vec<T>{};
    }
    const bool more = t + 1 < steps;
    const Vec<T> dn = vec::broadcast(more ? decay[t + 1] : T(1));
    const T* kn = more ? k + (t + 1) * Dk : kt;
    for (int64_t i = 0; i < Dk; ++i) {
      T* row = S + i * Dv;
      const Vec<T> ki = vec::broadcast(kt[i]), qi = vec::broadcast(qt[i]);
      const Vec<T> kni = vec::broadcast(kn[i]);
      for (int w = 0; w < W; ++w) {
        Vec<T> s = madd<T>(delta[w], ki, load(row + w * L));
        acc[w] = madd<T>(s, qi, acc[w]);
        if (more) {
          s = s * dn;
          next[w] = madd<T>(s, kni, next[w]);
        }
        store(row + w * L, s);
      }
    }
    for (int w = 0; w < W; ++w) {
      store(o + t * Dv + w * L, acc[w]);
      kv[w] = next[w];
    }
  }
}

// One (sequence, value head) pair's L steps: S (Dk, Dv) updated in place, out (L rows of Dv,
// `out_stride` apart) its gated, normed outputs. Value dims that are a whole number of register
// blocks run column_block; others (tiny test models) a plain loop of the same arithmetic.
template <typename T>
void pair_steps(T* S, const T* mixed, int64_t mixed_stride, const T* a, const T* b,
                const T* z, int64_t ab_stride, int64_t z_stride, T* out, int64_t out_stride,
                int64_t steps, int64_t head, int64_t key_head, int64_t keys, int64_t Dk,
                int64_t Dv, T A, T dt_bias, const T* norm_weight, T eps) {
  std::vector<T> q(steps * Dk), k(steps * Dk), v(steps * Dv), o(steps * Dv);
  std::vector<T> decay(steps), beta(steps);
  for (int64_t t = 0; t < steps; ++t)
    token_inputs(mixed + t * mixed_stride, a[t * ab_stride], b[t * ab_stride], head, key_head,
                 keys, Dk, Dv, A, dt_bias, &q[t * Dk], &k[t * Dk], &v[t * Dv], &decay[t],
                 &beta[t]);
  constexpr int64_t block = kBlock<T> * kLanes<T>;
  if (Dv % block == 0) {
    for (int64_t c = 0; c < Dv; c += block)
      column_block<T>(S + c, Dk, Dv, steps, q.data(), k.data(), v.data() + c, decay.data(),
                      beta.data(), o.data() + c);
  } else {
    std::vector<T> kv(Dv);
    for (int64_t t = 0; t < steps; ++t) {
      const T *qt = &q[t * Dk], *kt = &k[t * Dk], *vt = &v[t * Dv];
      T* ot = &o[t * Dv];
      std::fill(kv.begin(), kv.end(), T(0));
      for (int64_t i = 0; i < Dk; ++i) {
        T* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] = row[j] * decay[t];
          kv[j] = kv[j] + row[j] * kt[i];
        }
      }
      for (int64_t j = 0; j < Dv; ++j) kv[j] = (vt[j] - kv[j]) * beta[t];  // the delta
      std::fill(ot, ot + Dv, T(0));
      for (int64_t i = 0; i < Dk; ++i) {
        T* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] = row[j] + kv[j] * kt[i];
          ot[j] = ot[j] + row[j] * qt[i];
        }
      }
    }
  }
  // each token's RMSNorm of the head's output, times w, times silu(z)
  for (int64_t t = 0; t < steps; ++t) {
    const T* ot = &o[t * Dv];
    T ss = 0;
    for (int64_t j = 0; j < Dv; ++j) ss += ot[j] * ot[j];
    const T r = T(1) / std::sqrt(ss / static_cast<T>(Dv) + eps);
    const T* zt = z + t * z_stride;
    T* dst = out + t * out_stride;
    for (int64_t j = 0; j < Dv; ++j) dst[j] = ot[j] * r * norm_weight[j] * silu(zt[j]);
  }
}

template <typename T>
void run_rule(at::Tensor& state, const at::Tensor& slots, const at::Tensor& mixed,
              const at::Tensor& a, const at::Tensor& b, const at::Tensor& z,
              const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
              double eps, int64_t key_heads, at::Tensor& out) {
  const int64_t steps = mixed.size(0), n = mixed.size(1);
  const int64_t Hv = state.size(1), Dk = state.size(2), Dv = state.size(3);
  const int64_t keys = key_heads * Dk, groups = Hv / key_heads;
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* S = state.data_ptr<T>();
  const T* mp = mixed.data_ptr<T>();
  const T *ap = a.data_ptr<T>(), *bp = b.data_ptr<T>(), *zp = z.data_ptr<T>();
  const T *A = A_log.data_ptr<T>(), *dt = dt_bias.data_ptr<T>(), *w = norm_weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t C = mixed.size(2);
  at::parallel_for(0, n * Hv, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t s = p / Hv, h = p % Hv;
      pair_steps<T>(S + (slot[s] * Hv + h) * Dk * Dv, mp + s * C, n * C, ap + s * Hv + h,
                    bp + s * Hv + h, zp + (s * Hv + h) * Dv, n * Hv, n * Hv * Dv,
                    op + (s * Hv + h) * Dv, n * Hv * Dv, steps, h, h / groups, keys, Dk, Dv,
                    std::exp(A[h]), dt[h], w, static_cast<T>(eps));
    }
  });
}

}  // namespace

at::Tensor gated_delta_rule(at::Tensor& state, const at::Tensor& slots, const at::Tensor& mixed,
                            const at::Tensor& a, const at::Tensor& b, const at::Tensor& z,
                            const at::Tensor& A_log, const at::Tensor& dt_bias,
                            const at::Tensor& norm_weight, double eps, int64_t key_heads) {
  const auto dtype = state.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "gated_delta_rule: float32/64 state");
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous(), "gated_delta_rule: state (slots, Hv, "
              "Dk, Dv), contiguous");
  const int64_t Hv = state.size(1), Dk = state.size(2), Dv = state.size(3);
  TORCH_CHECK(mixed.dim() == 3 && mixed.size(2) == 2 * key_heads * Dk + Hv * Dv &&
                  key_heads > 0 && Hv % key_heads == 0,
              "gated_delta_rule: mixed (L, N, 2 Hk Dk + Hv Dv)");
  const int64_t steps = mixed.size(0), n = mixed.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == n, "gated_delta_rule: slots");
  TORCH_CHECK(a.sizes() == b.sizes() && a.size(0) == steps && a.size(1) == n && a.size(2) == Hv,
              "gated_delta_rule: a, b (L, N, Hv)");
  TORCH_CHECK(z.dim() == 4 && z.size(0) == steps && z.size(1) == n && z.size(2) == Hv &&
                  z.size(3) == Dv,
              "gated_delta_rule: z (L, N, Hv, Dv)");
  for (const at::Tensor* t : {&mixed, &a, &b, &z, &A_log, &dt_bias, &norm_weight})
    TORCH_CHECK(t->scalar_type() == dtype, "gated_delta_rule: every tensor of the state's dtype");
  const at::Tensor sl = slots.contiguous(), mc = mixed.contiguous(), ac = a.contiguous(),
                   bc = b.contiguous(), zc = z.contiguous(), Ac = A_log.contiguous(),
                   dc = dt_bias.contiguous(), wc = norm_weight.contiguous();
  at::Tensor out = at::empty({steps, n, Hv, Dv}, state.options());
  if (dtype == at::kFloat)
    run_rule<float>(state, sl, mc, ac, bc, zc, Ac, dc, wc, eps, key_heads, out);
  else
    run_rule<double>(state, sl, mc, ac, bc, zc, Ac, dc, wc, eps, key_heads, out);
  return out;
}

namespace {

template <typename T>
void run_conv(at::Tensor& state, const int64_t* slot, const std::vector<int64_t>& starts,
              const T* x, int64_t x_stride, const T* w, T* out) {
  const int64_t C = state.size(1), H = state.size(2), K = H + 1;  // H: the inputs kept
  T* st_all = state.data_ptr<T>();
  const int64_t num_seqs = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, C, 64, [&](int64_t c0, int64_t c1) {
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t begin = starts[s], length = starts[s + 1] - begin;
      for (int64_t c = c0; c < c1; ++c) {
        T* st = st_all + (slot[s] * C + c) * H;
        // the window: the H inputs kept, then the sequence's rows
        auto at = [&](int64_t i) { return i < H ? st[i] : x[(begin + i - H) * x_stride + c]; };
        const T* wc = w + c * K;
        for (int64_t t = 0; t < length; ++t) {
          T acc = at(t) * wc[0];
          for (int64_t j = 1; j < K; ++j) acc = acc + at(t + j) * wc[j];
          out[(begin + t) * C + c] = acc;
        }
        T kept[8];
        for (int64_t i = 0; i < H; ++i) kept[i] = at(length + i);
        for (int64_t i = 0; i < H; ++i) st[i] = kept[i];
      }
    }
  });
}

}  // namespace

at::Tensor causal_conv(at::Tensor& state, const at::Tensor& slots,
                       const std::vector<int64_t>& starts, const at::Tensor& x,
                       const at::Tensor& weight) {
  const auto dtype = state.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kDouble) && state.dim() == 3 &&
                  state.is_contiguous() && state.size(2) >= 1 && state.size(2) < 8,
              "causal_conv: state (slots, C, K - 1), float32/64, contiguous, K <= 8");
  const int64_t C = state.size(1), K = state.size(2) + 1;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == C && x.stride(1) == 1 && x.scalar_type() == dtype,
              "causal_conv: x (T, C) of the state's dtype, rows of unit stride");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) == K &&
                  weight.scalar_type() == dtype,
              "causal_conv: weight (C, K) of the state's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong &&
                  slots.numel() + 1 == static_cast<int64_t>(starts.size()) &&
                  starts.back() == x.size(0),
              "causal_conv: slots (S,), starts (S + 1,) ending at x's rows");
  const at::Tensor sl = slots.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), C}, x.options());
  if (dtype == at::kFloat)
    run_conv<float>(state, sl.data_ptr<int64_t>(), starts, x.data_ptr<float>(), x.stride(0),
                    wc.data_ptr<float>(), out.data_ptr<float>());
  else
    run_conv<double>(state, sl.data_ptr<int64_t>(), starts, x.data_ptr<double>(), x.stride(0),
                     wc.data_ptr<double>(), out.data_ptr<double>());
  return out;
}

// x * sigmoid(gate), row by row (float32, (T, n)): a value's bits depend on its column only.
at::Tensor sigmoid_mul(const at::Tensor& x_in, const at::Tensor& gate_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.sizes() == gate_in.sizes() &&
                  x_in.scalar_type() == at::kFloat && gate_in.scalar_type() == at::kFloat,
              "sigmoid_mul: x and gate (T, n), float32");
  const at::Tensor x = x_in.contiguous(), gate = gate_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *gp = gate.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = xp + r * n, *gr = gp + r * n;
      float* o = op + r * n;
      int64_t i = 0;
      for (; i + kLanes<float> <= n; i += kLanes<float>) {
        const Vec<float> g = load(gr + i);
        store(o + i, load(xr + i) / (1.0f + vec::vexp<float>(-g)));
      }
      for (; i < n; ++i) o[i] = xr[i] / (1.0f + std::exp(-gr[i]));
    }
  });
  return out;
}

}  // namespace conveyor::layer
