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

#include <chrono>
#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"
#include "isa/vec.h"

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
void residual_add(at::Tensor& x, const at::Tensor& y) {
  if (x.scalar_type() != at::kFloat) {
    x.add_(y);
    return;
  }
  const at::Tensor yc = y.contiguous();
  add_into(x.data_ptr<float>(), yc.data_ptr<float>(), x.numel());
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
    int64_t row = 0;
    for (size_t i = 0; i <= prompt_rows.size(); i += 2) {
      const int64_t begin = i < prompt_rows.size() ? prompt_rows[i] : rows;
      if (begin > row) y.narrow(0, row, begin - row).copy_((*this)(x.narrow(0, row, begin - row), form));
      if (i == prompt_rows.size()) break;
      const int64_t end = prompt_rows[i + 1];
      at::Tensor part = y.narrow(0, begin, end - begin);  // whole rows: contiguous
      gemm::amx::bf16_linear_into(x.narrow(0, begin, end - begin), prompt_tiles_, n, part);
      with_bias(part);
      row = end;
    }
    return y;
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
  at::Tensor with_bias(at::Tensor y) const { return bias_.defined() ? y.add_(bias_) : y; }

  at::Tensor weight_, qs_, d_, m_, bias_, panels_, wq_, dw_, mw_, prompt_tiles_;
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
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

inline at::Tensor optional_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight.defined() ? rms_norm(x, weight, eps) : x;
}

class DecoderLayer {
 public:
  DecoderLayer(std::optional<at::Tensor> attn_in, std::optional<at::Tensor> attn_out,
               std::optional<at::Tensor> mlp_in, std::optional<at::Tensor> mlp_out,
               std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, double eps,
               Projection qkv, Projection o, Projection gate_up, Projection down,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
               int64_t window, double softcap, int64_t rope, int64_t activation,
               double residual_scale)
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
        residual_scale_(residual_scale) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t hidden = o_.out_features();
    TORCH_CHECK(qkv_.out_features() == q_size + 2 * kv_size && qkv_.in_features() == hidden &&
                    o_.in_features() == q_size &&
                    gate_up_.in_features() == hidden && gate_up_.out_features() % 2 == 0 &&
                    down_.out_features() == hidden &&
                    2 * down_.in_features() == gate_up_.out_features(),
                "DecoderLayer: weight shapes do not fit together");
    TORCH_CHECK(q_norm_.defined() == k_norm_.defined() &&
                    (!q_norm_.defined() || q_norm_.size(0) == head_dim ||
                     (q_norm_.size(0) == q_size && k_norm_.size(0) == kv_size)),
                "DecoderLayer: q/k norms per head (head_dim) or of all heads (q, kv sizes)");
    TORCH_CHECK(activation == kSilu || activation == kGeluTanh,
                "DecoderLayer: activation 0 (silu) or 1 (gelu_tanh)");
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
        attention_.scale, step.split_keys, step.prompt_rows, attention_.window, attention_.softcap);
    clock.lap(kAttention);
    const at::Tensor attn_rows = attn.view({num_tokens, q_size});
    at::Tensor o = o_(attn_rows, step.form, step.prompt_rows);
    add_lora(o, attn_rows, step, index, 1, {0, o.size(1)});
    clock.lap(kProjections);
    residual_add(x, scaled(optional_norm(o, attn_out_, eps_)));
    h = optional_norm(x, mlp_in_, eps_);
    clock.lap(kOther);
    at::Tensor gate_up = gate_up_(h, step.form, step.prompt_rows);  // (T, 2 I)
    add_lora(gate_up, h, step, index, 2, {0, gate_up.size(1) / 2, gate_up.size(1)});
    clock.lap(kProjections);
    at::Tensor act = activation_ == kGeluTanh ? gelu_mul(gate_up) : silu_mul(gate_up);
    clock.lap(kOther);
    at::Tensor down = down_(act, step.form, step.prompt_rows);
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
  Projection qkv_, o_, gate_up_, down_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  Attention attention_;
  Activation activation_;
  double residual_scale_;
};

}  // namespace

// silu(gate) * up of gate_up (T, 2 I) as the compiled layers compute it (float32: each row in
// its own loop, one order per value whatever the rows or threads), for the modules that run
// outside them (model/moe.py's experts).
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return silu_mul(gate_up); }

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
                    const std::vector<at::Tensor>& sin, const at::Tensor& slot_mapping,
                    int64_t block_size, const at::Tensor& query_start, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables,
                    std::optional<at::Tensor> seconds, int64_t form, bool split_keys,
                    std::optional<std::vector<at::Tensor>> lora,
                    std::vector<int64_t> lora_slots, int64_t lora_num_slots,
                    std::vector<int64_t> prompt_rows) {
  TORCH_CHECK(layers.size() == kv_caches.size(), "decoder_layers: one KV cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "decoder_layers: x (T, hidden), contiguous, on the CPU");
  TORCH_CHECK(!seconds || (seconds->scalar_type() == at::kDouble && seconds->numel() == 3 &&
                           seconds->is_contiguous()),
              "decoder_layers: seconds, a float64 tensor of 3");
  TORCH_CHECK(form >= kKernel && form <= kTransposed,
              "decoder_layers: form 0 (kernel), 1 (linear) or 2 (transposed)");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "decoder_layers: cos, sin per table");
  Step step{cos,      sin,          slot_mapping,
            query_start, seq_lens, block_tables,
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
  for (size_t i = 0; i < layers.size(); ++i)
    layers[i]->forward(x, kv_caches[i], step, clock, i);
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
  py::class_<DecoderLayer>(m, "DecoderLayer")
      .def(py::init<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, double, Projection,
                    Projection, Projection, Projection, int64_t, int64_t, int64_t, double,
                    int64_t, double, int64_t, int64_t, double>(),
           py::arg("attn_in"), py::arg("attn_out"), py::arg("mlp_in"), py::arg("mlp_out"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("window") = 0,
           py::arg("softcap") = 0.0, py::arg("rope") = 0, py::arg("activation") = 0,
           py::arg("residual_scale") = 1.0);
  m.def("decoder_layers", &decoder_layers, "every decoder layer of a step, x in place (CPU)",
        py::arg("layers"), py::arg("x"), py::arg("kv_caches"), py::arg("cos"), py::arg("sin"),
        py::arg("slot_mapping"), py::arg("block_size"), py::arg("query_start"),
        py::arg("seq_lens"), py::arg("block_tables"), py::arg("seconds"),
        py::arg("form") = 0, py::arg("split_keys") = true, py::arg("lora") = py::none(),
        py::arg("lora_slots") = std::vector<int64_t>{}, py::arg("lora_num_slots") = 0,
        py::arg("prompt_rows") = std::vector<int64_t>{});
}

}  // namespace conveyor::layer
