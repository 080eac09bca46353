// The compiled CPU ops, one declaration each, with the file that defines it: bindings.cpp
// exposes them to Python, and layer/decoder_layer.cpp calls them from C++. Everything is in
// namespace conveyor, one sub-namespace per op (the folder of its sources): gemm (with panel,
// quant and amx for those kernels), attention (attention::amx: the prompt rows' bfloat16
// attention), layer, lora; isa/ holds the shared vector code (vec) and thread split (balance).
#pragma once

#include <torch/extension.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace conveyor {

// attention/paged_attention.cpp
namespace attention {
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t block_size,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale,
                           bool split_keys = true,
                           const std::vector<int64_t>& prompt_rows = {}, int64_t window = 0,
                           double softcap = 0,
                           const std::optional<at::Tensor>& sinks = std::nullopt);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping, int64_t block_size);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
bool advise_huge_pages(const at::Tensor& t);
// Whether prompt rows named by prompt_rows take the bfloat16 attention (the kernel plan's
// choice, set once at load; off: they take this kernel, their projections still the tiles).
void set_prompt_attention(bool on);
}  // namespace attention

// gemm/small_gemm.cpp
namespace gemm {
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight);
}  // namespace gemm

// gemm/quant_gemm.cpp: GGUF-style block weights (x86 with AVX2, FMA and F16C; elsewhere they raise)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVEYOR_QUANT_KERNELS 1
#else
#define CONVEYOR_QUANT_KERNELS 0
#endif
namespace gemm::quant {
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d);
at::Tensor q4_linear_dequant(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                             const at::Tensor& m);
at::Tensor q8_linear_dequant(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d);
at::Tensor q4_dequantize(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m);
at::Tensor q8_dequantize(const at::Tensor& qs, const at::Tensor& d);
std::vector<at::Tensor> int8_prepare(const at::Tensor& x, double ratio);
at::Tensor q4_columns(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                      const at::Tensor& cols);
at::Tensor q8_columns(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& cols);
}  // namespace gemm::quant

// gemm/panel_gemm.cpp: one reduction order per output value, for every row count
namespace gemm::panel {
std::string get_isa();
std::string set_isa(const std::string& name);
std::string best_isa_name();  // what the CPU and the build run, whatever set_isa chose
std::map<std::string, int64_t> isa_runs();  // kernel calls per instruction set
at::Tensor pack_dense(const at::Tensor& weight);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out);
std::vector<at::Tensor> pack_blocks(const at::Tensor& qs, const at::Tensor& d,
                                    const std::optional<at::Tensor>& m, bool float_acts);
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& dw,
                        const at::Tensor& mw, int64_t n_out, bool float_acts);
std::vector<at::Tensor> dense_linear_group(const std::vector<at::Tensor>& xs,
                                           const std::vector<at::Tensor>& panels,
                                           const std::vector<int64_t>& n_outs);
std::vector<at::Tensor> block_linear_group(const std::vector<at::Tensor>& xs,
                                           const std::vector<std::vector<at::Tensor>>& panels,
                                           const std::vector<int64_t>& n_outs);
at::Tensor block_argmax(const at::Tensor& x, const at::Tensor& wk, const at::Tensor& wq,
                        const at::Tensor& dw, const at::Tensor& mw, const at::Tensor& wmax,
                        int64_t n_out);
double peak_rate(const std::string& kind, int64_t iters);
#if CONVEYOR_QUANT_KERNELS
// One token's int8 blocks (AVX2): values, scale max|x| / 127, scale * sum, integer sum (isum
// may be null).
void quantize_token_avx2(const float* x, int64_t nb, int8_t* q, float* d, float* s,
                         int32_t* isum);
#endif
}  // namespace gemm::panel

// lora/lora_gemm.cpp: y += a step's LoRA deltas (conveyor/lora/slots.py's layout), one order
// per value
namespace lora {
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const std::vector<at::Tensor>& rows, const std::vector<int64_t>& slots,
              const std::vector<int64_t>& columns, int64_t num_slots);
}  // namespace lora

// AMX-BF16 tiles: built where the compiler targets them (-march=native on such a CPU); used
// where gemm::amx::available() says the CPU and the process may.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__linux__)
#define CONVEYOR_AMX 1
#else
#define CONVEYOR_AMX 0
#endif
#if CONVEYOR_AMX && defined(__AMX_INT8__)
#define CONVEYOR_AMX_INT8 1
#else
#define CONVEYOR_AMX_INT8 0
#endif

// AVX512-BF16's dot products (vdpbf16ps), the prompt rows' attention where there are no tiles
// (a Zen 4 or 5, a Cooper Lake Xeon): built where the compiler targets them.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__)
#define CONVEYOR_BF16_DOT 1
#else
#define CONVEYOR_BF16_DOT 0
#endif

// gemm/amx_gemm.cpp: x W^T in bfloat16 on AMX tiles (float32 sums), the prompt rows' route
namespace gemm::amx {
bool usable();     // the CPU, the build and the OS allow the tiles
bool available();  // usable, and the kernel plan lets them run (set_allowed)
void set_allowed(bool on);
int64_t bf16_linear_runs();
double peak(int64_t iters);
at::Tensor pack_bf16(const at::Tensor& weight);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out);
void bf16_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t n_out, at::Tensor& y);
// silu(gate) * up over rows of (gate | up) values: out rows of `inner` from gate_up rows of 2 inner.
using SiluRows = void (*)(const float* gate_up, float* out, int64_t rows, int64_t inner);
void bf16_silu_mul_into(const at::Tensor& x, const at::Tensor& packed, int64_t inner,
                        at::Tensor& act, SiluRows silu_rows);
#if CONVEYOR_AMX
void configure();  // this thread's tiles: eight of 16 rows x 64 bytes
#endif
// Generated rows on AMX-INT8 tiles: panel_gemm.cpp's int8 block route with the same bits,
// taken from the kernel plan's row count on (set_int8_from; 0: never).
struct Int8Blocks {
  const int8_t* xq;    // (tokens rounded up to 16, k) int8 activations, the extra rows zero
  const float* xd;     // (tokens rounded up to 16, nb) scales, xs (q4), xi (q8) likewise
  const float* xs;
  const int32_t* xi;
  const uint8_t* wq;   // pack_blocks' panels (P, nb, C * 64)
  const int16_t* dw;   // (P, nb, 16) float16 bits
  const int16_t* mw;   // the same for q4; null for q8
  int64_t tokens, k, nb, panels, n_out;
  float* y;            // (tokens, n_out)
  // block_argmax's bounds in place of y, when lo is set (gemm/panel_gemm.cpp's BlockArgs): for
  // row t and panel p, the largest of y_n - c_t wmax_n (lo) and of y_n + c_t wmax_n (hi) over
  // the panel's columns n < n_out, at [t * panels + p]
  const float* c = nullptr;
  const float* wmax = nullptr;
  float* lo = nullptr;
  float* hi = nullptr;
};
bool int8_usable();  // the CPU, the build and the OS allow AMX-INT8
void set_int8_from(int64_t rows);
int64_t int8_from();
bool int8_takes(int64_t rows);  // whether a call of this many rows runs int8_block_linear
int64_t int8_linear_runs();
void int8_block_linear(const Int8Blocks& a);
}  // namespace gemm::amx

// attention/amx_attention.cpp: attention of a step's prompt rows in bfloat16 (float32 sums and
// softmax), on AMX tiles or else AVX512-BF16 dot products; prompt_tokens[s]: sequence s's
// leading rows that take it. Writes those rows of out (T, H, D); the metadata as
// paged_attention's, already checked. prompt_attention_isa: which of the two runs here ("amx",
// "avx512_bf16"), "" for none.
namespace attention::amx {
std::string prompt_attention_isa();
bool bf16_dot_usable();  // AVX512-BF16 in the CPU and the build
void set_bf16_dot(bool on);  // the kernel plan's choice: may AVX512-BF16 run
std::map<std::string, int64_t> prompt_attention_runs();  // calls per engine
void prompt_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t block_size,
                      const at::Tensor& query_start, const at::Tensor& seq_lens,
                      const at::Tensor& block_tables, double scale,
                      const std::vector<int64_t>& prompt_tokens, at::Tensor& out);
}  // namespace attention::amx

// layer/decoder_layer.cpp
namespace layer {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
// silu(gate) * up of x's prompt-row product with a gate_up weight's bfloat16 tiles (pack_bf16),
// fused in the tiles' route: silu_and_mul(bf16_linear(x, packed, 2 inner)), bit for bit.
at::Tensor bf16_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inner);
at::Tensor swiglu_clamp_and_mul(const at::Tensor& gate_up, double alpha, double limit);
at::Tensor sigmoid_gated_add(at::Tensor& out, const at::Tensor& gate, const at::Tensor& y);
int64_t moe_expert_runs();  // experts the compiled MoE layers ran, since start
void bind_decoder_layer(pybind11::module& m);  // the DecoderLayer class and decoder_layers
// layer/deltanet.cpp
at::Tensor gated_delta_rule(at::Tensor& state, const at::Tensor& slots, const at::Tensor& mixed,
                            const at::Tensor& a, const at::Tensor& b, const at::Tensor& z,
                            const at::Tensor& A_log, const at::Tensor& dt_bias,
                            const at::Tensor& norm_weight, double eps, int64_t key_heads);
at::Tensor causal_conv(at::Tensor& state, const at::Tensor& slots,
                       const std::vector<int64_t>& starts, const at::Tensor& x,
                       const at::Tensor& weight);
at::Tensor sigmoid_mul(const at::Tensor& x, const at::Tensor& gate);
// layer/mamba.cpp
at::Tensor mamba2_mix(at::Tensor& state, const at::Tensor& slots,
                      const std::vector<int64_t>& starts, const at::Tensor& conv,
                      const at::Tensor& conv_bias, const at::Tensor& dt, const at::Tensor& z,
                      const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& D,
                      const at::Tensor& norm_weight, double eps, int64_t groups, double dt_min,
                      double dt_max);
}  // namespace layer

}  // namespace conveyor
