// The mixture-of-experts MLP's own loops (model/moe.py is the reference): grouping a step's
// (row, expert) pairs by expert, the experts' activations and the weighted sum per row. The
// projections themselves are the dense layers' kernels (layer/decoder_layer.cpp: Projection,
// MoE), so an expert's product has the bits a dense projection of the same rows would.
//
// One order per output value, whatever the batch: a row's output is the sum of its experts'
// weighted outputs in ascending expert id, from zero; each product rounded before it is added
// (never fused into an FMA: the reference's `h * weight` then `index_add_`); the activations
// and the shared expert's sigmoid gate are loops over one row at a time, the same for every
// row (ATen's elementwise ops run a tensor's last values through their scalar path, whose exp
// can differ in the last bit from the vector one, so a row's value could depend on its place
// in the batch).
//
// float32 only here; float64 models run ATen's ops as their modules do (decoder_layer.cpp).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa/vec.h"

namespace conveyor::moe {

// The step's (row, slot) pairs by expert: experts ascending, each one's rows ascending (a row
// routes to an expert at most once). Only the active experts are listed.
struct Groups {
  std::vector<int64_t> experts;      // active expert ids, ascending
  std::vector<int64_t> offsets;      // group g's pairs: [offsets[g], offsets[g + 1])
  std::vector<int64_t> rows, slots;  // each pair's row and its place in the row's top_k
};

inline Groups group_by_expert(const at::Tensor& expert_ids, int64_t num_experts) {
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.scalar_type() == at::kLong,
              "group_by_expert: expert_ids (T, top_k) int64");
  const at::Tensor ids = expert_ids.contiguous();
  const int64_t rows = ids.size(0), top_k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> counts(num_experts + 1, 0);
  for (int64_t i = 0; i < rows * top_k; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "group_by_expert: expert id out of range");
    ++counts[id[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) counts[e + 1] += counts[e];  // starts
  Groups g;
  g.rows.resize(rows * top_k);
  g.slots.resize(rows * top_k);
  std::vector<int64_t> next(counts.begin(), counts.end() - 1);
  for (int64_t r = 0; r < rows; ++r)  // rows ascending: each group's rows come out sorted
    for (int64_t s = 0; s < top_k; ++s) {
      const int64_t at = next[id[r * top_k + s]]++;
      g.rows[at] = r;
      g.slots[at] = s;
    }
  for (int64_t e = 0; e < num_experts; ++e)
    if (counts[e + 1] > counts[e]) {
      g.experts.push_back(e);
      g.offsets.push_back(counts[e]);
    }
  g.offsets.push_back(rows * top_k);
  return g;
}

// The given rows of x (T, n), in order: an expert's input.
inline at::Tensor gather_rows(const at::Tensor& x, const int64_t* rows, int64_t n) {
  at::Tensor out = at::empty({n, x.size(1)}, x.options());
  const int64_t bytes = x.size(1) * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t j = 0; j < n; ++j) std::memcpy(dst + j * bytes, src + rows[j] * bytes, bytes);
  return out;
}

// An expert's local prompt rows ([begin, end) pairs of its gathered rows, layer/decoder_layer.cpp
// Step::prompt_rows) from the step's: a gathered row takes the prompt route when its step row
// does.
inline std::vector<int64_t> local_ranges(const std::vector<int64_t>& step_ranges,
                                         const int64_t* rows, int64_t n) {
  std::vector<int64_t> out;
  if (step_ranges.empty()) return out;
  size_t range = 0;
  for (int64_t j = 0; j < n; ++j) {
    while (range < step_ranges.size() && step_ranges[range + 1] <= rows[j]) range += 2;
    const bool prompt = range < step_ranges.size() && step_ranges[range] <= rows[j];
    if (!prompt) continue;
    if (!out.empty() && out.back() == j) {
      out.back() = j + 1;
    } else {
      out.push_back(j);
      out.push_back(j + 1);
    }
  }
  return out;
}

// a * b rounded, opaque to the optimizer: never contracted into an FMA with what follows.
inline vec::Vec<float> product(vec::Vec<float> a, vec::Vec<float> b) {
  vec::Vec<float> p = a * b;
  asm("" : "+v"(p));
  return p;
}
inline float product(float a, float b) {
  float p = a * b;
  asm("" : "+v"(p));
  return p;
}

// out[rows[j]] += y[j] * w[j] for the n rows of an expert's output y (n, hidden).
inline void add_weighted(float* out, const float* y, const float* w, const int64_t* rows,
                         int64_t n, int64_t hidden) {
  using namespace conveyor::vec;
  for (int64_t j = 0; j < n; ++j) {
    float* o = out + rows[j] * hidden;
    const float* yj = y + j * hidden;
    const Vec<float> wv = broadcast(w[j]);
    int64_t i = 0;
    for (; i + kLanes<float> <= hidden; i += kLanes<float>)
      store(o + i, load(o + i) + product(load(yj + i), wv));
    for (; i < hidden; ++i) o[i] += product(yj[i], w[j]);
  }
}

// out (T, hidden) += sigmoid(gate[r]) * y[r] row by row: Qwen2-MoE's shared expert behind its
// gate (T, 1); sigmoid(g) = 1 / (1 + e^-g), one scalar per row.
inline void add_gated(float* out, const float* gate, const float* y, int64_t rows,
                      int64_t hidden) {
  using namespace conveyor::vec;
  for (int64_t r = 0; r < rows; ++r) {
    const float s = 1.0f / (1.0f + std::exp(-gate[r]));
    float* o = out + r * hidden;
    const float* yr = y + r * hidden;
    const Vec<float> sv = broadcast(s);
    int64_t i = 0;
    for (; i + kLanes<float> <= hidden; i += kLanes<float>)
      store(o + i, load(o + i) + product(sv, load(yr + i)));
    for (; i < hidden; ++i) o[i] += product(s, yr[i]);
  }
}

// out (T, I) = (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha g)), g = min(gate, limit),
// for gate_up (T, 2 I): GPT-OSS's clamped SwiGLU (transformers' GptOssExperts._apply_gate),
// one scalar loop per row.
inline void swiglu_clamp_rows(const float* gate_up, float* out, int64_t rows, int64_t inner,
                              float alpha, float limit) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    float* o = out + r * inner;
    for (int64_t i = 0; i < inner; ++i) {
      const float gi = std::min(g[i], limit);
      const float ui = std::min(std::max(u[i], -limit), limit);
      const float z = product(gi, alpha);
      const float s = 1.0f / (1.0f + std::exp(-z));
      o[i] = (ui + 1.0f) * product(gi, s);
    }
  }
}

}  // namespace conveyor::moe
