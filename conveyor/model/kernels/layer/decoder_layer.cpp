// The decoder layers of the Llama family for a step of up to 64 token rows (decode steps, short
// chunks), all of them in one call from Python (CPU, float32 and float64).
//
// Why: at one to ~16 rows a layer is four weight streams (qkv, o, gate/up, down) with a dozen
// small ops between them, and each stream evicts what the caches held: 7 MB of weights pass
// through a 2 MB L2 per matmul. The Python interpreter's and torch dispatcher's working set is
// evicted with them, so the first Python-level op after each matmul, even a `split`, cost
// 15-35 us more than with warm caches here (measured: a split 3.7 us warm, 35 us after a
// streamed matmul). Run from Python the ~15 ops per layer cost ~9 ms of a ~38 ms one-row step
// on this machine; run here they are plain loops and a few ATen calls whose working set is
// small.
//
// Per layer, for x (T, hidden), the residual stream, updated in place (model/families.py says which
// family has which [part]):   h = [rms_norm](x) ; qkv = h Wqkv^T (+ bias) ; q, k, v = views of qkv
// [q, k = rms_norm of all heads, or per head] ; [rotary(q, k) in place, by the layer's table]
// write k, v into the cache ; a = paged_attention(q) [window, soft-cap]   x += [rms_norm](a Wo^T)
// [* residual_scale]   h = [rms_norm](x) ; gate, up = halves of h Wgu^T   x +=
// [rms_norm]((act(gate) * up) Wdown^T) [* residual_scale], act silu or tanh-gelu The arithmetic is
// the model's (model/llama.py, model/layers.py): the matmuls take the form the modules would at the
// step's rows (MatmulForm: the small-row kernel of gemm/small_gemm.cpp or MKL, as
// layers.matmul_forms measured; for a quantized model's block weights the block kernel below 16
// rows and float tiles from there, as QuantLinear does). At 16 to 64 rows MKL does the matmuls, but
// the Python between them still cost ~10 ms of a 32-row float32 step (other: 15-20 -> 4 ms in
// `python -m benchmarks step`). Attention, the KV write and rotary the compiled ops
// (attention/paged_attention.cpp); silu and the products ATen's own for float64 and loops of their
// own for float32 (see residual_add). RMSNorm of a float64 model is transformers' (normalized in
// float32 through the same ATen ops), so the float64 equivalence tests hold token for token; for
// float32 it is the loop below (sums of squares in float32, as torch.rms_norm does, in another
// order).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"
#include "isa/vec.h"
#include "moe/moe.h"

namespace conveyor::layer {

namespace {

using namespace conveyor::vec;

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n,
                   float eps) {
  const int64_t n_vec = n - n % kLanes<float>;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    Vec<float> acc{};
    for (int64_t i = 0; i < n_vec; i += kLanes<float>) {
      const Vec<float> v = load(xr + i);
      acc += v * v;
    }
    float sum = 0.0f;
    for (int i = 0; i < kLanes<float>; ++i) sum += acc[i];
    for (int64_t i = n_vec; i < n; ++i) sum += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * scale * w[i];
  }
}

// Seconds per category (projections, attention, other: norms, rotary, activation, residual adds)
// added to `totals` when it is given (python -m benchmarks step's breakdown); a no-op otherwise.
enum Category { kProjections = 0, kAttention = 1, kOther = 2 };

class Stopwatch {
 public:
  explicit Stopwatch(double* totals) : totals_(totals), mark_(Clock::now()) {}
  void lap(Category category) {
    if (totals_ == nullptr) return;
    const Clock::time_point now = Clock::now();
    totals_[category] += std::chrono::duration<double>(now - mark_).count();
    mark_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  double* totals_;
  Clock::time_point mark_;
};

// x += y over n values.
template <typename T>
void add_into(T* __restrict x, const T* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes<T> <= n; i += kLanes<T>) store(x + i, load(x + i) + load(y + i));
  for (; i < n; ++i) x[i] += y[i];
}

// out (T, I) = silu(gate) * up for gate_up (T, 2 I), silu(g) = g / (1 + e^-g) as torch's.
void silu_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t inner) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    float* o = out + r * inner;
    int64_t i = 0;
    for (; i + kLanes<float> <= inner; i += kLanes<float>) {
      const Vec<float> gv = load(g + i);
      store(o + i, gv / (1.0f + vexp<float>(-gv)) * load(u + i));
    }
    for (; i < inner; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// The residual add and the MLP's activation: own loops for float32 (small code, which matters
// right after a matmul has streamed through the caches); ATen's for float64, so that a float64
// model computes exactly what its modules do.
// A prompt chunk's rows split over the threads (an add is elementwise: the same bits on any
// split); a decode step's rows (up to ~200 of SmolLM2's 576 values) on this thread, where a
// parallel region costs more than the add (64 streams measured 2-3% slower at 1 << 15).
constexpr int64_t kAddGrain = 1 << 17;

void residual_add(at::Tensor& x, const at::Tensor& y) {
  if (x.scalar_type() != at::kFloat) {
    x.add_(y);
    return;
  }
  const at::Tensor yc = y.contiguous();
  float* xp = x.data_ptr<float>();
  const float* yp = yc.data_ptr<float>();
  at::parallel_for(0, x.numel(), kAddGrain,
                   [&](int64_t i0, int64_t i1) { add_into(xp + i0, yp + i0, i1 - i0); });
}

// x += y, then the RMSNorm of x's rows (weight, eps): each row normed right after its add, while
// it is in cache, in one parallel region; the same bits as residual_add, then rms_norm.
at::Tensor add_then_norm(at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                         double eps) {
  if (x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || x.dim() != 2) {
    residual_add(x, y);
    return rms_norm(x, weight, eps);
  }
  const at::Tensor yc = y.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* yp = yc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 64, [&](int64_t r0, int64_t r1) {
    add_into(xp + r0 * n, yp + r0 * n, (r1 - r0) * n);
    rms_norm_rows(xp + r0 * n, w.data_ptr<float>(), op + r0 * n, r1 - r0, n,
                  static_cast<float>(eps));
  });
  return out;
}

// out (T, I) = gelu_tanh(gate) * up, ATen's ops as the modules run them (Gemma's GeGLU).
at::Tensor gelu_mul(const at::Tensor& gate_up) {
  const int64_t inner = gate_up.size(1) / 2;
  return at::gelu(gate_up.narrow(1, 0, inner), "tanh").mul_(gate_up.narrow(1, inner, inner));
}

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const int64_t rows = gate_up_in.size(0), inner = gate_up_in.size(1) / 2;
  if (gate_up_in.scalar_type() != at::kFloat) {
    return at::silu(gate_up_in.narrow(1, 0, inner)).mul_(gate_up_in.narrow(1, inner, inner));
  }
  const at::Tensor gate_up = gate_up_in.contiguous();
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  // Rows are independent (each one's values the same on any thread): prompt chunks split them.
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    silu_mul_rows(src + r0 * 2 * inner, dst + r0 * inner, r1 - r0, inner);
  });
  return out;
}

// How a step's projections are computed, as the model's modules would at its row count (the
// caller says which, from layers.matmul_forms or QuantLinear's thresholds):
//   dense weights: kKernel the small-row kernel, kLinear MKL's x W^T (at::linear, bias fused),
//                  kTransposed MKL's (W x^T)^T;
//   block weights: kKernel the block kernel (int8 activations), otherwise float tiles and MKL.
enum MatmulForm : int64_t { kKernel = 0, kLinear = 1, kTransposed = 2 };

// One projection's weight: a dense float matrix (O, K), or GGUF-style blocks (q4: qs, d, m;
// q8: qs, d) run through the block kernels (gemm/quant_gemm.cpp, float32 models); a float bias or
// none. y = x W^T (+ bias), as the model's Linear / QuantLinear compute it.
// With panels (dense, from pack_dense) or block panels (wq, dw, mw from pack_blocks) the
// projection runs the batch-invariant panel kernels (gemm/panel_gemm.cpp) at every row count, and
// `weight` / `qs, d, m` only give the shapes. With prompt tiles too (gemm/amx_gemm.cpp's pack_bf16
// of the same weight), the step's prompt rows (Step::prompt_rows) run bf16_linear instead: a
// row's route is fixed by its token (model/prompt_route.py), never by the step around it.
class Projection {
 public:
  Projection(std::optional<at::Tensor> weight, std::optional<at::Tensor> qs,
             std::optional<at::Tensor> d, std::optional<at::Tensor> m,
             std::optional<at::Tensor> bias, std::optional<at::Tensor> panels,
             std::optional<std::vector<at::Tensor>> block_panels,
             std::optional<at::Tensor> prompt_tiles)
      : weight_(weight.value_or(at::Tensor())),
        qs_(qs.value_or(at::Tensor())),
        d_(d.value_or(at::Tensor())),
        m_(m.value_or(at::Tensor())),
        bias_(bias.value_or(at::Tensor())),
        panels_(panels.value_or(at::Tensor())),
        prompt_tiles_(prompt_tiles.value_or(at::Tensor())) {
    if (block_panels) {
      TORCH_CHECK(block_panels->size() == 3, "Projection: block_panels is (wq, dw, mw)");
      wq_ = (*block_panels)[0], dw_ = (*block_panels)[1], mw_ = (*block_panels)[2];
    }
    const bool blocks = qs_.defined() || d_.defined() || m_.defined();
    TORCH_CHECK(weight_.defined() ? !blocks : qs_.defined() && d_.defined(),
                "Projection: a dense weight, or block weights (qs, d[, m])");
    TORCH_CHECK(!panels_.defined() || weight_.defined(), "Projection: panels of a dense weight");
    TORCH_CHECK(!wq_.defined() || blocks, "Projection: block panels of block weights");
    TORCH_CHECK(!weight_.defined() || (weight_.dim() == 2 && weight_.is_contiguous()),
                "Projection: the dense weight must be a contiguous (out, in) matrix");
    TORCH_CHECK(!bias_.defined() || bias_.size(0) == out_features(),
                "Projection: bias size differs from the output size");
  }

  int64_t out_features() const { return weight_.defined() ? weight_.size(0) : qs_.size(0); }
  // The panels that gemm::panel's group calls take (several projections at once:
  // MoE::experts): the int8 block panels (wq, dw, mw) of a quantized projection, or a dense
  // one's float panels; empty for other weights.
  std::vector<at::Tensor> block_panels() const {
    return wq_.defined() ? std::vector<at::Tensor>{wq_, dw_, mw_} : std::vector<at::Tensor>{};
  }
  const at::Tensor& dense_panels() const { return panels_; }
  at::Tensor with_bias(at::Tensor y) const { return bias_.defined() ? y.add_(bias_) : y; }
  int64_t in_features() const {
    if (weight_.defined()) return weight_.size(1);
    return m_.defined() ? 2 * qs_.size(1) : qs_.size(1);  // q4: two values a byte
  }

  // prompt_rows: [begin, end) row ranges, ascending, that take the prompt tiles (when the
  // projection has them); the rows between take the route below.
  at::Tensor operator()(const at::Tensor& x, MatmulForm form,
                        const std::vector<int64_t>& prompt_rows) const {
    if (!prompt_tiles_.defined() || prompt_rows.empty()) return (*this)(x, form);
    const int64_t rows = x.size(0), n = out_features();
    if (prompt_rows.size() == 2 && prompt_rows[0] == 0 && prompt_rows[1] == rows)
      return with_bias(gemm::amx::bf16_linear(x, prompt_tiles_, n));
    at::Tensor y = at::empty({rows, n}, x.options());
    walk_rows(rows, prompt_rows, [&](int64_t begin, int64_t end) {
      y.narrow(0, begin, end - begin).copy_((*this)(x.narrow(0, begin, end - begin), form));
    }, [&](int64_t begin, int64_t end) {
      at::Tensor part = y.narrow(0, begin, end - begin);  // whole rows: contiguous
      gemm::amx::bf16_linear_into(x.narrow(0, begin, end - begin), prompt_tiles_, n, part);
      with_bias(part);
    });
    return y;
  }

  // Whether silu_mul_of can take this projection's prompt rows: a gate_up with prompt tiles,
  // no bias, halves of whole panels.
  bool fuses_silu() const {
    return prompt_tiles_.defined() && !bias_.defined() && out_features() % 32 == 0;
  }

  // silu(gate) * up of this gate_up projection's output (T, 2 I) as (T, I), what silu_mul of
  // operator()'s output gives, bit for bit: the prompt rows straight from their tiles' sums
  // (gemm::amx::bf16_silu_mul_into, through the same silu_mul_rows), never writing their
  // (T, 2 I) product; the rows between through the route below and silu_mul.
  at::Tensor silu_mul_of(const at::Tensor& x, MatmulForm form,
                         const std::vector<int64_t>& prompt_rows) const {
    const int64_t rows = x.size(0), inner = out_features() / 2;
    at::Tensor act = at::empty({rows, inner}, x.options());
    walk_rows(rows, prompt_rows, [&](int64_t begin, int64_t end) {
      act.narrow(0, begin, end - begin)
          .copy_(silu_mul((*this)(x.narrow(0, begin, end - begin), form)));
    }, [&](int64_t begin, int64_t end) {
      at::Tensor part = act.narrow(0, begin, end - begin);  // whole rows: contiguous
      gemm::amx::bf16_silu_mul_into(x.narrow(0, begin, end - begin), prompt_tiles_, inner, part,
                                    silu_mul_rows);
    });
    return act;
  }

  at::Tensor operator()(const at::Tensor& x, MatmulForm form) const {
    at::Tensor y;
    if (panels_.defined()) {
      y = gemm::panel::dense_linear(x, panels_, out_features());
    } else if (wq_.defined()) {
      y = gemm::panel::block_linear(x, wq_, dw_, mw_, out_features(), false);
    } else if (weight_.defined() && form == kLinear) {
      return at::linear(x, weight_, bias_.defined() ? std::optional<at::Tensor>(bias_)
                                                    : std::nullopt);
    } else if (weight_.defined() && form == kTransposed) {
      y = at::mm(weight_, x.t()).t();
      y = bias_.defined() ? y + bias_ : y;
      // float64 keeps the module's transposed view (qk_norm's per-head norms then reduce over
      // the same strides, bit for bit); float32 copies it: the ops after it (rotary, the
      // residual add, the activation) ran ~10 ms slower per 32-row step on the strided rows.
      return x.scalar_type() == at::kFloat ? y.contiguous() : y;
    } else if (weight_.defined()) {
      y = gemm::small_gemm(x, weight_);
    } else if (form == kKernel) {
      y = m_.defined() ? gemm::quant::q4_linear(x, qs_, d_, m_)
                       : gemm::quant::q8_linear(x, qs_, d_);
    } else {
      y = m_.defined() ? gemm::quant::q4_linear_dequant(x, qs_, d_, m_)
                       : gemm::quant::q8_linear_dequant(x, qs_, d_);
    }
    if (bias_.defined()) y.add_(bias_);
    return y;
  }

 private:
  // [0, rows) in order as prompt_rows' ranges (on_prompt) and the ranges between (on_other).
  template <typename Other, typename Prompt>
  static void walk_rows(int64_t rows, const std::vector<int64_t>& prompt_rows, Other on_other,
                        Prompt on_prompt) {
    int64_t row = 0;
    for (size_t i = 0; i <= prompt_rows.size(); i += 2) {
      const int64_t begin = i < prompt_rows.size() ? prompt_rows[i] : rows;
      if (begin > row) on_other(row, begin);
      if (i == prompt_rows.size()) break;
      on_prompt(begin, prompt_rows[i + 1]);
      row = prompt_rows[i + 1];
    }
  }

  at::Tensor weight_, qs_, d_, m_, bias_, panels_, wq_, dw_, mw_, prompt_tiles_;
};

// A mixture-of-experts MLP (model/moe.py: MoEMLP, its reference) as the compiled layer runs it:
// the router's projection; each row's top_k experts and weights by ATen's softmax and topk, as
// the module computes them (ties as transformers resolves them); the step's rows grouped by
// expert (moe/moe.h), each active expert's two projections run once over all its rows on the
// kernels a dense projection takes (its prompt rows on its prompt tiles, where it has them);
// a row's weighted expert outputs summed in ascending expert id from zero; then Qwen2-MoE's
// shared expert behind its sigmoid gate. float32 through moe/moe.h's row loops, float64 through
// the module's ATen ops (so a float64 model computes exactly what its modules do).
enum ExpertActivation : int64_t { kExpertSilu = 0, kSwigluClamp = 1 };
// Experts run (each one's two projections over its rows), since start: kernel_runs()'s
// "moe/experts", the bytes a step reads (python -m benchmarks moe).
std::atomic<int64_t> expert_runs{0};
// kTopkSoftmaxFloat (Granite's MoE): the logits in float32 first, the weights back in the
// model dtype. kSigmoidGroupTopk (GLM-4.5, Nemotron 3): sigmoid scores (row by row, as
// sigmoid_mul), the top-k of them plus a choosing bias among the best groups, weighed by the
// scores, renormalised (+ 1e-20), scaled; kSoftmaxBiasTopk (ERNIE 4.5): the top-k of the
// softmax plus a choosing bias, weighed by the softmax, divided by their sum (at least
// norm_min). Both for float32 models (a float64 one runs the modules: its router's logits are
// float32 there).
enum Router : int64_t {
  kSoftmaxTopk = 0,
  kTopkSoftmax = 1,
  kTopkSoftmaxFloat = 2,
  kSigmoidGroupTopk = 3,
  kSoftmaxBiasTopk = 4
};

class MoE {
 public:
  MoE(Projection router, std::vector<Projection> gate_up, std::vector<Projection> down,
      int64_t router_kind, int64_t top_k, bool norm_topk_prob, bool float32_route_weights,
      int64_t activation, double alpha, double limit, std::optional<Projection> shared_gate_up,
      std::optional<Projection> shared_down, std::optional<Projection> shared_gate,
      std::optional<at::Tensor> router_bias, int64_t groups, int64_t groups_chosen,
      double routed_scaling, double norm_min)
      : router_(std::move(router)),
        gate_up_(std::move(gate_up)),
        down_(std::move(down)),
        router_kind_(static_cast<Router>(router_kind)),
        top_k_(top_k),
        norm_topk_prob_(norm_topk_prob),
        float32_route_weights_(float32_route_weights),
        activation_(static_cast<ExpertActivation>(activation)),
        alpha_(alpha),
        limit_(limit),
        shared_gate_up_(std::move(shared_gate_up)),
        shared_down_(std::move(shared_down)),
        shared_gate_(std::move(shared_gate)),
        router_bias_(std::move(router_bias)),
        groups_(groups),
        groups_chosen_(groups_chosen),
        routed_scaling_(routed_scaling),
        norm_min_(norm_min) {
    const int64_t experts = static_cast<int64_t>(gate_up_.size());
    TORCH_CHECK(experts > 0 && down_.size() == gate_up_.size() &&
                    router_.out_features() == experts && top_k > 0 && top_k <= experts,
                "MoE: a router to num_experts logits, gate_up and down per expert, top_k <= experts");
    const int64_t hidden = router_.in_features();
    for (int64_t e = 0; e < experts; ++e)
      TORCH_CHECK(gate_up_[e].in_features() == hidden && down_[e].out_features() == hidden &&
                      2 * down_[e].in_features() == gate_up_[e].out_features(),
                  "MoE: expert ", e, "'s weight shapes do not fit together");
    TORCH_CHECK(router_kind >= kSoftmaxTopk && router_kind <= kSoftmaxBiasTopk,
                "MoE: router 0 (softmax_topk), 1 (topk_softmax), 2 (topk_softmax_float32), 3 "
                "(sigmoid_group_topk) or 4 (softmax_bias_topk)");
    if (router_kind >= kSigmoidGroupTopk)
      TORCH_CHECK(router_bias_.has_value() && router_bias_->numel() == experts &&
                      router_bias_->scalar_type() == at::kFloat && groups_ > 0 &&
                      experts % groups_ == 0 && groups_chosen_ > 0 && groups_chosen_ <= groups_,
                  "MoE: a biased router's float32 bias (experts,) and groups dividing them");
    TORCH_CHECK(activation == kExpertSilu || activation == kSwigluClamp,
                "MoE: activation 0 (silu) or 1 (swiglu_clamp)");
    TORCH_CHECK(shared_gate_up_.has_value() == shared_down_.has_value() &&
                    (shared_gate_up_.has_value() || !shared_gate_.has_value()),
                "MoE: a shared expert has gate_up and down (and its gate, where it is gated)");
  }

  int64_t hidden() const { return router_.in_features(); }

  // h (T, hidden) -> (T, hidden); prompt_rows as Projection's, rows of h.
  at::Tensor forward(const at::Tensor& h_in, MatmulForm form,
                     const std::vector<int64_t>& prompt_rows) const {
    const at::Tensor h = h_in.contiguous();
    at::Tensor weights, ids;
    std::tie(weights, ids) = route(h, form);
    const moe::Groups groups = moe::group_by_expert(ids, static_cast<int64_t>(gate_up_.size()));
    const bool f32 = h.scalar_type() == at::kFloat;
    TORCH_CHECK(f32 || h.scalar_type() == at::kDouble, "MoE: float32 or float64 rows");
    at::Tensor out = at::zeros_like(h);
    const at::Tensor w = weights.contiguous();
    expert_runs += static_cast<int64_t>(groups.experts.size());
    const std::vector<at::Tensor> ys = experts(groups, h, form, prompt_rows);
    for (size_t g = 0; g + 1 < groups.offsets.size(); ++g) {
      const int64_t begin = groups.offsets[g], n = groups.offsets[g + 1] - begin;
      const int64_t* rows = groups.rows.data() + begin;
      const int64_t* slots = groups.slots.data() + begin;
      const at::Tensor& y = ys[g];
      if (f32) {
        std::vector<float> wj(n);
        for (int64_t j = 0; j < n; ++j) wj[j] = w.data_ptr<float>()[rows[j] * top_k_ + slots[j]];
        moe::add_weighted(out.data_ptr<float>(), y.contiguous().data_ptr<float>(), wj.data(),
                          rows, n, out.size(1));
      } else {  // the module's ops: (h * weight).to(dtype), index_add_
        const at::Tensor r = at::tensor(std::vector<int64_t>(rows, rows + n));
        const at::Tensor s = at::tensor(std::vector<int64_t>(slots, slots + n));
        const at::Tensor wr = w.index({r, s}).unsqueeze(1);
        out.index_add_(0, r, (y * wr).to(h.scalar_type()));
      }
    }
    if (shared_gate_up_) out = add_shared(out, h, form, prompt_rows);
    return out;
  }

 private:
  // (weights (T, top_k), expert ids (T, top_k) int64), as MoEMLP.route.
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& h, MatmulForm form) const {
    const at::Tensor logits = router_(h, form);  // (T, E)
    if (router_kind_ == kSigmoidGroupTopk) return sigmoid_routes(logits);
    if (router_kind_ == kSoftmaxBiasTopk) {
      const at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
      const at::Tensor ids = std::get<1>(at::topk(probs + *router_bias_, top_k_, -1));
      const at::Tensor top = probs.gather(1, ids);
      return {(top / row_sums(top).clamp_min(norm_min_)).to(logits.scalar_type()), ids};
    }
    if (router_kind_ == kTopkSoftmax) {
      auto [top, ids] = at::topk(logits, top_k_, -1);
      return {at::softmax(top, 1, top.scalar_type()), ids};
    }
    if (router_kind_ == kTopkSoftmaxFloat) {
      auto [top, ids] = at::topk(logits.to(at::kFloat), top_k_, -1);
      return {at::softmax(top, 1, at::kFloat).to(logits.scalar_type()), ids};
    }
    const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
    auto [top, ids] = at::topk(probs, top_k_, -1);
    if (norm_topk_prob_) {  // each row's k weights added left to right (moe.py: _row_sums)
      at::Tensor total = top.narrow(1, 0, 1).clone();
      for (int64_t j = 1; j < top_k_; ++j) total.add_(top.narrow(1, j, 1));
      top = top / total;
    }
    return {float32_route_weights_ ? top : top.to(logits.scalar_type()), ids};
  }

  // (T, 1): each row's k weights added left to right (moe.py: _row_sums).
  at::Tensor row_sums(const at::Tensor& top) const {
    at::Tensor total = top.narrow(1, 0, 1).clone();
    for (int64_t j = 1; j < top_k_; ++j) total.add_(top.narrow(1, j, 1));
    return total;
  }

  // MoEMLP._sigmoid_routes of sigmoid_group_topk, float32 logits (T, E).
  std::tuple<at::Tensor, at::Tensor> sigmoid_routes(const at::Tensor& logits) const {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "MoE: sigmoid_group_topk on float32 rows");
    const at::Tensor scores = sigmoid_mul(at::ones_like(logits), logits);
    at::Tensor choice = scores + *router_bias_;
    if (groups_ > 1) {  // the experts outside the groups_chosen best groups at -inf
      const at::Tensor by_group = choice.view({choice.size(0), groups_, -1});
      const at::Tensor best_two = std::get<0>(by_group.topk(2, -1));
      const at::Tensor group_scores = best_two.select(-1, 0) + best_two.select(-1, 1);
      const at::Tensor keep = std::get<1>(at::topk(group_scores, groups_chosen_, -1));
      const at::Tensor mask = at::zeros_like(group_scores, at::kBool).scatter_(1, keep, true);
      choice = by_group.masked_fill(mask.unsqueeze(-1).logical_not(), -INFINITY)
                   .view_as(choice);
    }
    const at::Tensor ids = std::get<1>(at::topk(choice, top_k_, -1));
    at::Tensor weights = scores.gather(1, ids);
    if (norm_topk_prob_) weights = weights / (row_sums(weights) + 1e-20);
    return {weights * routed_scaling_, ids};
  }

  // Each group's expert output (its rows' gathered h through gate_up, the activation, down).
  // float32 experts on panels (int8 blocks or float) whose rows take no prompt tiles run
  // together, each of the two projections of all of them in one parallel region
  // (gemm::panel's block_linear_group and dense_linear_group, the same bits as one at a time);
  // the others one at a time.
  std::vector<at::Tensor> experts(const moe::Groups& groups, const at::Tensor& h, MatmulForm form,
                                  const std::vector<int64_t>& prompt_rows) const {
    const size_t count = groups.experts.size();
    std::vector<at::Tensor> ys(count), xs;
    std::vector<size_t> together;
    for (size_t g = 0; g < count; ++g) {
      const int64_t begin = groups.offsets[g], n = groups.offsets[g + 1] - begin;
      const int64_t* rows = groups.rows.data() + begin;
      const int64_t e = groups.experts[g];
      const std::vector<int64_t> local = moe::local_ranges(prompt_rows, rows, n);
      at::Tensor x = moe::gather_rows(h, rows, n);
      if (!local.empty() || x.scalar_type() != at::kFloat || !groupable(e)) {
        ys[g] = expert(e, x, form, local);
        continue;
      }
      together.push_back(g);
      xs.push_back(std::move(x));
    }
    if (together.empty()) return ys;
    std::vector<int64_t> ids;
    for (size_t g : together) ids.push_back(groups.experts[g]);
    std::vector<at::Tensor> mid = projections(gate_up_, ids, xs);
    // an expert's few rows per thread (a region each would cost more than their arithmetic),
    // on this thread below 128 rows in all (panel_gemm.cpp's kSpread, measured likewise)
    int64_t rows = 0;
    for (const at::Tensor& x : xs) rows += x.size(0);
    const int64_t calls = static_cast<int64_t>(ids.size());
    const bool inference = c10::InferenceMode::is_enabled();  // thread-local: carried over
    at::parallel_for(0, calls, rows >= 128 ? 1 : calls, [&](int64_t i0, int64_t i1) {
      c10::InferenceMode guard(inference);
      for (int64_t i = i0; i < i1; ++i)
        mid[i] = activate(gate_up_[ids[i]].with_bias(mid[i]), activation_);
    });
    std::vector<at::Tensor> out = projections(down_, ids, mid);
    for (size_t i = 0; i < ids.size(); ++i) ys[together[i]] = down_[ids[i]].with_bias(out[i]);
    return ys;
  }

  // Whether expert e's two projections run in the group calls: all the experts' weights are of
  // one kind (the loader quantizes or packs them alike), so the first expert's kind decides.
  bool groupable(int64_t e) const {
    const bool blocks = !gate_up_[0].block_panels().empty();
    const auto kind = [&](const Projection& p) {
      return blocks ? !p.block_panels().empty() : p.dense_panels().defined();
    };
    return kind(gate_up_[e]) && kind(down_[e]);
  }

  // projection[ids[i]](xs[i]) for every i, in one group call.
  static std::vector<at::Tensor> projections(const std::vector<Projection>& projection,
                                             const std::vector<int64_t>& ids,
                                             const std::vector<at::Tensor>& xs) {
    std::vector<int64_t> n_outs;
    for (int64_t e : ids) n_outs.push_back(projection[e].out_features());
    if (!projection[ids[0]].block_panels().empty()) {
      std::vector<std::vector<at::Tensor>> panels;
      for (int64_t e : ids) panels.push_back(projection[e].block_panels());
      return gemm::panel::block_linear_group(xs, panels, n_outs);
    }
    std::vector<at::Tensor> panels;
    for (int64_t e : ids) panels.push_back(projection[e].dense_panels());
    return gemm::panel::dense_linear_group(xs, panels, n_outs);
  }

  at::Tensor expert(int64_t e, const at::Tensor& x, MatmulForm form,
                    const std::vector<int64_t>& prompt_rows) const {
    const at::Tensor gate_up = gate_up_[e](x, form, prompt_rows);  // (n, 2 I)
    return down_[e](activate(gate_up, activation_), form, prompt_rows);
  }

  at::Tensor activate(const at::Tensor& gate_up, ExpertActivation activation) const {
    if (activation == kExpertSilu) return silu_mul(gate_up);
    const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
    if (gate_up.scalar_type() != at::kFloat) {  // transformers' GptOssExperts._apply_gate
      const at::Tensor gate = gate_up.narrow(1, 0, inner).clamp_max(limit_);
      const at::Tensor up = gate_up.narrow(1, inner, inner).clamp(-limit_, limit_);
      return (up + 1) * (gate * at::sigmoid(gate * alpha_));
    }
    const at::Tensor src = gate_up.contiguous();
    at::Tensor out = at::empty({rows, inner}, src.options());
    moe::swiglu_clamp_rows(src.data_ptr<float>(), out.data_ptr<float>(), rows, inner,
                           static_cast<float>(alpha_), static_cast<float>(limit_));
    return out;
  }

  // out + sigmoid(h Wgate^T) * shared_expert(h): Qwen2-MoE's always-on expert; out +
  // shared_expert(h) where it has no gate (GLM-4.5's, ERNIE 4.5's).
  at::Tensor add_shared(at::Tensor out, const at::Tensor& h, MatmulForm form,
                        const std::vector<int64_t>& prompt_rows) const {
    const at::Tensor up = (*shared_gate_up_)(h, form, prompt_rows);
    const at::Tensor y = (*shared_down_)(activate(up, kExpertSilu), form, prompt_rows);
    if (!shared_gate_) return out + y;
    const at::Tensor gate = (*shared_gate_)(h, form);  // (T, 1)
    if (out.scalar_type() != at::kFloat) return out + at::sigmoid(gate) * y;
    const at::Tensor g = gate.contiguous(), yc = y.contiguous();
    moe::add_gated(out.data_ptr<float>(), g.data_ptr<float>(), yc.data_ptr<float>(),
                   out.size(0), out.size(1));
    return out;
  }

  Projection router_;
  std::vector<Projection> gate_up_, down_;
  Router router_kind_;
  int64_t top_k_;
  bool norm_topk_prob_, float32_route_weights_;
  ExpertActivation activation_;
  double alpha_, limit_;
  std::optional<Projection> shared_gate_up_, shared_down_, shared_gate_;
  std::optional<at::Tensor> router_bias_;
  int64_t groups_, groups_chosen_;
  double routed_scaling_, norm_min_;
};

// A step's LoRA deltas (lora/slots.py): per layer and projection, every resident slot's A^T
// side by side (in, slots * S * R) and B dense (slots * S * R, out: slice s of slot k in rows
// k * S * R + s * R .., its own columns, times its scaling); and the step's rows of each slot
// in use. lora/lora_gemm.cpp adds them after each projection.
struct LoRA {
  std::vector<int64_t> slots;                      // the slots in use
  std::vector<at::Tensor> rows;                    // their rows (int64 indices)
  int64_t num_slots = 0;
  const std::vector<at::Tensor>* ab = nullptr;     // per layer: A, B of qkv, o, gate_up, down
};

struct Step {
  std::vector<at::Tensor> cos, sin;  // per rotary table (a layer's `rope` picks one)
  at::Tensor slot_mapping, query_start, seq_lens, block_tables;
  int64_t block_size;
  MatmulForm form;
  bool split_keys;
  LoRA lora;
  std::vector<int64_t> prompt_rows;  // [begin, end) pairs: rows whose tokens are the prompt's
};

// y += each slot's rows' (h A_k^T) B_k: the LoRA delta of projection `which` (0 qkv, 1 o,
// 2 gate_up, 3 down) of `layer`, when the step has adapter rows (lora/lora_gemm.cpp); columns: the
// projection's slices' boundaries. The compiled layers run float32 and float64 only, the
// kernel's dtypes (model/llama.py: _compiled_form).
inline void add_lora(at::Tensor& y, const at::Tensor& h, const Step& step, size_t layer,
                     int which, std::initializer_list<int64_t> columns) {
  if (step.lora.ab == nullptr) return;
  lora::lora_add(y, h, (*step.lora.ab)[layer * 8 + which * 2],
                 (*step.lora.ab)[layer * 8 + which * 2 + 1], step.lora.rows, step.lora.slots,
                 std::vector<int64_t>(columns), step.lora.num_slots);
}

// The model's layer description (model/families.py) as the compiled layer takes it.
struct Attention {
  double scale;
  int64_t window;  // 0: full attention
  double softcap;  // 0: none
  int64_t rope;    // the step's rotary table; -1: none
};
// kRelu2: an ungated MLP (Arcee's): relu(x)^2 of gate_up's one part (T, I), exact per value.
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kRelu2 = 2 };

inline at::Tensor optional_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight.defined() ? rms_norm(x, weight, eps) : x;
}

class DecoderLayer {
 public:
  DecoderLayer(std::optional<at::Tensor> attn_in, std::optional<at::Tensor> attn_out,
               std::optional<at::Tensor> mlp_in, std::optional<at::Tensor> mlp_out,
               std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, double eps,
               Projection qkv, Projection o, std::optional<Projection> gate_up,
               std::optional<Projection> down, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double scale, int64_t window, double softcap, int64_t rope,
               int64_t activation, double residual_scale, std::optional<MoE> moe,
               std::optional<at::Tensor> sinks)
      : attn_in_(attn_in.value_or(at::Tensor())),
        attn_out_(attn_out.value_or(at::Tensor())),
        mlp_in_(mlp_in.value_or(at::Tensor())),
        mlp_out_(mlp_out.value_or(at::Tensor())),
        q_norm_(q_norm.value_or(at::Tensor())),
        k_norm_(k_norm.value_or(at::Tensor())),
        eps_(eps),
        qkv_(std::move(qkv)),
        o_(std::move(o)),
        gate_up_(std::move(gate_up)),
        down_(std::move(down)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        attention_{scale, window, softcap, rope},
        activation_(static_cast<Activation>(activation)),
        residual_scale_(residual_scale),
        moe_(std::move(moe)),
        sinks_(sinks) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t hidden = o_.out_features();
    TORCH_CHECK(qkv_.out_features() == q_size + 2 * kv_size && qkv_.in_features() == hidden &&
                    o_.in_features() == q_size,
                "DecoderLayer: weight shapes do not fit together");
    TORCH_CHECK(moe_ ? !gate_up_ && !down_ && moe_->hidden() == hidden : gate_up_ && down_,
                "DecoderLayer: a dense MLP (gate_up, down) or a mixture of experts (moe)");
    const int64_t parts = activation == kRelu2 ? 1 : 2;  // an ungated MLP's gate_up: up alone
    TORCH_CHECK(moe_ || (gate_up_->in_features() == hidden && down_->out_features() == hidden &&
                         parts * down_->in_features() == gate_up_->out_features()),
                "DecoderLayer: MLP weight shapes do not fit together");
    TORCH_CHECK(!sinks_ || sinks_->size(0) == num_heads, "DecoderLayer: a sink per head");
    TORCH_CHECK(q_norm_.defined() == k_norm_.defined() &&
                    (!q_norm_.defined() || q_norm_.size(0) == head_dim ||
                     (q_norm_.size(0) == q_size && k_norm_.size(0) == kv_size)),
                "DecoderLayer: q/k norms per head (head_dim) or of all heads (q, kv sizes)");
    TORCH_CHECK(activation == kSilu || activation == kGeluTanh || activation == kRelu2,
                "DecoderLayer: activation 0 (silu), 1 (gelu_tanh) or 2 (relu2)");
    TORCH_CHECK(window >= 0 && softcap >= 0 && rope >= -1, "DecoderLayer: bad attention kind");
  }

  void forward(at::Tensor& x, at::Tensor& kv_cache, const Step& step, Stopwatch& clock,
               size_t index) const {
    const int64_t num_tokens = x.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor h = optional_norm(x, attn_in_, eps_);
    clock.lap(kOther);
    at::Tensor qkv = qkv_(h, step.form, step.prompt_rows);  // (T, q + 2 kv)
    add_lora(qkv, h, step, index, 0, {0, q_size, q_size + kv_size, q_size + 2 * kv_size});
    clock.lap(kProjections);
    at::Tensor q = qkv.narrow(1, 0, q_size);
    at::Tensor k = qkv.narrow(1, q_size, kv_size);
    const bool full_norms = q_norm_.defined() && q_norm_.size(0) != head_dim_;
    if (full_norms) {  // over all heads (OLMo 2)
      q = rms_norm(q, q_norm_, eps_);
      k = rms_norm(k, k_norm_, eps_);
    }
    q = q.view({num_tokens, num_heads_, head_dim_});
    k = k.view({num_tokens, num_kv_heads_, head_dim_});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view(k.sizes());
    if (q_norm_.defined() && !full_norms) {
      q = rms_norm(q, q_norm_, eps_);
      k = rms_norm(k, k_norm_, eps_);
    }
    if (attention_.rope >= 0)
      attention::rotary_embedding(q, k, step.cos[attention_.rope], step.sin[attention_.rope]);
    clock.lap(kOther);
    attention::write_kv(k, v, kv_cache, step.slot_mapping, step.block_size);
    at::Tensor attn = attention::paged_attention(
        q, kv_cache, step.block_size, step.query_start, step.seq_lens, step.block_tables,
        attention_.scale, step.split_keys, step.prompt_rows, attention_.window, attention_.softcap,
        sinks_);
    clock.lap(kAttention);
    const at::Tensor attn_rows = attn.view({num_tokens, q_size});
    at::Tensor o = o_(attn_rows, step.form, step.prompt_rows);
    add_lora(o, attn_rows, step, index, 1, {0, o.size(1)});
    clock.lap(kProjections);
    const at::Tensor attn_out = scaled(optional_norm(o, attn_out_, eps_));
    if (mlp_in_.defined()) {
      h = add_then_norm(x, attn_out, mlp_in_, eps_);
    } else {
      residual_add(x, attn_out);
      h = x;
    }
    clock.lap(kOther);
    if (moe_) {  // its projections, activations and sums together: projections' time
      const at::Tensor y = moe_->forward(h, step.form, step.prompt_rows);
      clock.lap(kProjections);
      residual_add(x, scaled(optional_norm(y, mlp_out_, eps_)));
      clock.lap(kOther);
      return;
    }
    at::Tensor act;
    if (activation_ == kSilu && step.lora.ab == nullptr && !step.prompt_rows.empty() &&
        h.scalar_type() == at::kFloat && gate_up_->fuses_silu()) {
      act = gate_up_->silu_mul_of(h, step.form, step.prompt_rows);  // its SiLU: projections' time
      clock.lap(kProjections);
    } else {
      at::Tensor gate_up = (*gate_up_)(h, step.form, step.prompt_rows);  // (T, 2 I)
      if (activation_ == kRelu2)  // (T, I): up alone
        add_lora(gate_up, h, step, index, 2, {0, gate_up.size(1)});
      else
        add_lora(gate_up, h, step, index, 2, {0, gate_up.size(1) / 2, gate_up.size(1)});
      clock.lap(kProjections);
      if (activation_ == kRelu2)
        act = at::relu(gate_up).square_();
      else
        act = activation_ == kGeluTanh ? gelu_mul(gate_up) : silu_mul(gate_up);
      clock.lap(kOther);
    }
    at::Tensor down = (*down_)(act, step.form, step.prompt_rows);
    add_lora(down, act, step, index, 3, {0, down.size(1)});
    clock.lap(kProjections);
    residual_add(x, scaled(optional_norm(down, mlp_out_, eps_)));
    clock.lap(kOther);
  }

 private:
  // A sublayer's output times the residual multiplier (Granite), as the modules compute it.
  at::Tensor scaled(at::Tensor y) const {
    return residual_scale_ == 1.0 ? y : y.mul(residual_scale_);
  }

  at::Tensor attn_in_, attn_out_, mlp_in_, mlp_out_, q_norm_, k_norm_;
  double eps_;
  Projection qkv_, o_;
  std::optional<Projection> gate_up_, down_;  // a dense MLP, or
  int64_t num_heads_, num_kv_heads_, head_dim_;
  Attention attention_;
  Activation activation_;
  double residual_scale_;
  std::optional<MoE> moe_;              // a mixture of experts
  std::optional<at::Tensor> sinks_;     // GPT-OSS's per-head logits in every softmax
};

}  // namespace

// silu(gate) * up of gate_up (T, 2 I) as the compiled layers compute it (float32: each row in
// its own loop, one order per value whatever the rows or threads), for the modules that run
// outside them (model/moe.py's experts).
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return silu_mul(gate_up); }

at::Tensor bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inner) {
  at::Tensor act = at::empty({x.size(0), inner}, x.options());
  gemm::amx::bf16_silu_mul_into(x, packed, inner, act, silu_mul_rows);
  return act;
}

// GPT-OSS's clamped SwiGLU of gate_up (T, 2 I), float32, row by row (moe/moe.h), for the modules
// (model/moe.py's experts): the compiled MoE's arithmetic.
at::Tensor swiglu_clamp_and_mul(const at::Tensor& gate_up_in, double alpha, double limit) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.scalar_type() == at::kFloat &&
                  gate_up_in.size(1) % 2 == 0,
              "swiglu_clamp_and_mul: gate_up (T, 2 I), float32");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  moe::swiglu_clamp_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inner,
                         static_cast<float>(alpha), static_cast<float>(limit));
  return out;
}

// out += sigmoid(gate) * y row by row, in place (out, y (T, n), gate (T, 1), float32): Qwen2-MoE's
// shared expert as the compiled MoE adds it (moe/moe.h), for the modules.
at::Tensor sigmoid_gated_add(at::Tensor& out, const at::Tensor& gate, const at::Tensor& y) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                  y.sizes() == out.sizes() && y.scalar_type() == at::kFloat &&
                  gate.numel() == out.size(0) && gate.scalar_type() == at::kFloat,
              "sigmoid_gated_add: out, y (T, n) and gate (T, 1), float32, out contiguous");
  const at::Tensor g = gate.contiguous(), yc = y.contiguous();
  moe::add_gated(out.data_ptr<float>(), g.data_ptr<float>(), yc.data_ptr<float>(), out.size(0),
                 out.size(1));
  return out;
}

int64_t moe_expert_runs() { return expert_runs.load(); }

// RMSNorm over the last dim, as the model's RMSNorm module computes it (see the header).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.size(-1) == weight.size(0) &&
                  (x.scalar_type() == weight.scalar_type() || weight.scalar_type() == at::kFloat),
              "rms_norm: weight (n,) of x's dtype, or float32, for x (..., n)");
  if (x.scalar_type() != at::kFloat) {
    const at::Tensor h = x.to(at::kFloat);
    const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
    // A float32 weight of a float64 model: multiplied before the cast (Gemma's 1 + w).
    if (weight.scalar_type() == at::kFloat) return (normed * weight).to(x.scalar_type());
    return weight * normed.to(x.scalar_type());
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t n = x.size(-1);
  const at::Tensor w = weight.contiguous();
  const float* src = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, xc.numel() / n, 64, [&](int64_t r0, int64_t r1) {
    rms_norm_rows(src + r0 * n, w.data_ptr<float>(), dst + r0 * n, r1 - r0, n,
                  static_cast<float>(eps));
  });
  return out;
}

// Every layer of a step, in order, over x (T, hidden) in place. seconds: a float64 (3,) CPU
// tensor that gets each category's time added (see Stopwatch), or None.
void decoder_layers(const std::vector<const DecoderLayer*>& layers, at::Tensor& x,
                    std::vector<at::Tensor>& kv_caches, const std::vector<at::Tensor>& cos,
                    const std::vector<at::Tensor>& sin,
                    const std::vector<at::Tensor>& slot_mappings, int64_t block_size,
                    const at::Tensor& query_start, const at::Tensor& seq_lens,
                    const std::vector<at::Tensor>& block_tables,
                    std::optional<at::Tensor> seconds, int64_t form, bool split_keys,
                    std::optional<std::vector<at::Tensor>> lora,
                    std::vector<int64_t> lora_slots, int64_t lora_num_slots,
                    std::vector<int64_t> prompt_rows, std::vector<int64_t> layer_groups) {
  TORCH_CHECK(layers.size() == kv_caches.size(), "decoder_layers: one KV cache per layer");
  // KV groups (model/kv_groups.py): a layer's slots and block tables are its group's; one
  // group: every layer's
  TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size(),
              "decoder_layers: slot_mappings and block_tables, one of each per KV group");
  TORCH_CHECK(layer_groups.empty() || layer_groups.size() == layers.size(),
              "decoder_layers: layer_groups, one per layer (or none: one group)");
  for (const int64_t g : layer_groups)
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(slot_mappings.size()),
                "decoder_layers: a layer's group out of range");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "decoder_layers: x (T, hidden), contiguous, on the CPU");
  TORCH_CHECK(!seconds || (seconds->scalar_type() == at::kDouble && seconds->numel() == 3 &&
                           seconds->is_contiguous()),
              "decoder_layers: seconds, a float64 tensor of 3");
  TORCH_CHECK(form >= kKernel && form <= kTransposed,
              "decoder_layers: form 0 (kernel), 1 (linear) or 2 (transposed)");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "decoder_layers: cos, sin per table");
  Step step{cos,      sin,          slot_mappings[0],
            query_start, seq_lens, block_tables[0],
            block_size, static_cast<MatmulForm>(form), split_keys, LoRA{}};
  TORCH_CHECK(prompt_rows.size() % 2 == 0, "decoder_layers: prompt_rows are (begin, end) pairs");
  for (size_t i = 0; i < prompt_rows.size(); i += 2)
    TORCH_CHECK((i == 0 ? 0 : prompt_rows[i - 1]) <= prompt_rows[i] &&
                    prompt_rows[i] < prompt_rows[i + 1] && prompt_rows[i + 1] <= x.size(0),
                "decoder_layers: prompt_rows must be ascending, non-empty ranges of x's rows");
  step.prompt_rows = std::move(prompt_rows);
  std::vector<at::Tensor> ab;
  if (lora) {  // (each slot's rows, then A and B of 4 projections per layer)
    const size_t groups = lora_slots.size();
    TORCH_CHECK(lora->size() == groups + 8 * layers.size() && lora_num_slots > 0,
                "decoder_layers: lora is each slot's rows, then 8 tensors per layer");
    step.lora.slots = lora_slots;
    step.lora.rows.assign(lora->begin(), lora->begin() + groups);
    step.lora.num_slots = lora_num_slots;
    ab.assign(lora->begin() + groups, lora->end());
    step.lora.ab = &ab;
  }
  Stopwatch clock(seconds ? seconds->data_ptr<double>() : nullptr);
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!layer_groups.empty()) {
      step.slot_mapping = slot_mappings[layer_groups[i]];
      step.block_tables = block_tables[layer_groups[i]];
    }
    layers[i]->forward(x, kv_caches[i], step, clock, i);
  }
}

void bind_decoder_layer(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection")
      .def(py::init<std::optional<at::Tensor>, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>,
                    std::optional<std::vector<at::Tensor>>, std::optional<at::Tensor>>(),
           py::arg("weight") = py::none(), py::arg("qs") = py::none(), py::arg("d") = py::none(),
           py::arg("m") = py::none(), py::arg("bias") = py::none(),
           py::arg("panels") = py::none(), py::arg("block_panels") = py::none(),
           py::arg("prompt_tiles") = py::none());
  using Tensor = std::optional<at::Tensor>;
  using MaybeProjection = std::optional<Projection>;
  py::class_<MoE>(m, "MoE")
      .def(py::init<Projection, std::vector<Projection>, std::vector<Projection>, int64_t,
                    int64_t, bool, bool, int64_t, double, double, MaybeProjection,
                    MaybeProjection, MaybeProjection, Tensor, int64_t, int64_t, double,
                    double>(),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("router_kind"),
           py::arg("top_k"), py::arg("norm_topk_prob"), py::arg("float32_route_weights"),
           py::arg("activation") = 0, py::arg("alpha") = 0.0, py::arg("limit") = 0.0,
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(), py::arg("router_bias") = py::none(),
           py::arg("groups") = 1, py::arg("groups_chosen") = 1,
           py::arg("routed_scaling") = 1.0, py::arg("norm_min") = 0.0)
      .def(
          "forward",
          [](const MoE& moe, const at::Tensor& h, int64_t form,
             const std::vector<int64_t>& prompt_rows) {
            TORCH_CHECK(h.dim() == 2 && h.device().is_cpu() && h.size(1) == moe.hidden(),
                        "MoE.forward: h (T, hidden) on the CPU");
            return moe.forward(h, static_cast<MatmulForm>(form), prompt_rows);
          },
          "the MoE MLP of h (T, hidden), as the compiled layer runs it", py::arg("h"),
          py::arg("form") = 0, py::arg("prompt_rows") = std::vector<int64_t>{});
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, double, Projection,
                    Projection, MaybeProjection, MaybeProjection, int64_t, int64_t, int64_t,
                    double, int64_t, double, int64_t, int64_t, double, std::optional<MoE>,
                    Tensor>(),
           py::arg("attn_in"), py::arg("attn_out"), py::arg("mlp_in"), py::arg("mlp_out"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up") = py::none(), py::arg("down") = py::none(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
           py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("rope") = 0,
           py::arg("activation") = 0, py::arg("residual_scale") = 1.0,
           py::arg("moe") = py::none(), py::arg("sinks") = py::none());
  m.def("decoder_layers", &decoder_layers, "every decoder layer of a step, x in place (CPU)",
        py::arg("layers"), py::arg("x"), py::arg("kv_caches"), py::arg("cos"), py::arg("sin"),
        py::arg("slot_mappings"), py::arg("block_size"), py::arg("query_start"),
        py::arg("seq_lens"), py::arg("block_tables"), py::arg("seconds"),
        py::arg("form") = 0, py::arg("split_keys") = true, py::arg("lora") = py::none(),
        py::arg("lora_slots") = std::vector<int64_t>{}, py::arg("lora_num_slots") = 0,
        py::arg("prompt_rows") = std::vector<int64_t>{},
        py::arg("layer_groups") = std::vector<int64_t>{});
}

}  // namespace conveyor::layer
