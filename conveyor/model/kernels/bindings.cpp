// The Python module of the compiled CPU ops: one extension built from the sources listed in
// kernels/__init__.py (SOURCES); ops.h declares each op and names the file that defines it.
// The Python names are the ops' own, without their C++ namespaces.
#include <torch/extension.h>

#include "ops.h"

namespace {

using namespace conveyor;  // the ops' namespaces (ops.h)

std::map<std::string, bool> cpu_features() {
  const std::string best = gemm::panel::best_isa_name();
  return {{"avx2", best != "scalar"},
          {"avx512", best == "avx512"},
          {"avx512_bf16", attention::amx::bf16_dot_usable()},
          {"amx", gemm::amx::usable()},
          {"amx_int8", gemm::amx::int8_usable()}};
}

// "panel/<isa>", "amx/bf16_linear", "attention/<engine>", "moe/experts": the counts tests read to see that
// what ran is what the kernel plan chose.
std::map<std::string, int64_t> kernel_runs() {
  std::map<std::string, int64_t> out;
  for (const auto& [isa, n] : gemm::panel::isa_runs()) out["panel/" + isa] = n;
  out["amx/bf16_linear"] = gemm::amx::bf16_linear_runs();
  out["amx/int8_blocks"] = gemm::amx::int8_linear_runs();
  for (const auto& [engine, n] : attention::amx::prompt_attention_runs())
    out["attention/" + engine] = n;
  out["moe/experts"] = layer::moe_expert_runs();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("advise_huge_pages", &attention::advise_huge_pages,
        "madvise(MADV_HUGEPAGE) over a tensor");
  m.def("rotary_embedding", &attention::rotary_embedding,
        "rotary embedding of q and k, in place (CPU)");
  m.def("paged_attention", &attention::paged_attention, "paged attention over a whole step (CPU)",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_size"), py::arg("query_start"),
        py::arg("seq_lens"), py::arg("block_tables"), py::arg("scale"),
        py::arg("split_keys") = true, py::arg("prompt_rows") = std::vector<int64_t>{},
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("write_kv", &attention::write_kv, "write K/V into cache slots (CPU)");
  m.def("small_gemm", &gemm::small_gemm, "x @ weight.T for a few rows of x (CPU)");
  m.def("lora_add", &lora::lora_add, "y += a step's LoRA deltas, in place (CPU)", py::arg("y"),
        py::arg("x"), py::arg("a"), py::arg("b"), py::arg("rows"), py::arg("slots"),
        py::arg("columns"), py::arg("num_slots"));
  m.def("rms_norm", &layer::rms_norm, "RMSNorm over the last dim as the model computes it (CPU)");
  m.def("silu_and_mul", &layer::silu_and_mul, "silu(gate) * up of gate_up (T, 2 I), row by row");
  m.def("bf16_silu_mul", &layer::bf16_silu_mul,
        "silu_and_mul(bf16_linear(x, packed, 2 inner)), fused on the AMX tiles", py::arg("x"),
        py::arg("packed"), py::arg("inner"));
  m.def("swiglu_clamp_and_mul", &layer::swiglu_clamp_and_mul,
        "GPT-OSS's clamped SwiGLU of gate_up (T, 2 I), float32, row by row",
        py::arg("gate_up"), py::arg("alpha"), py::arg("limit"));
  m.def("sigmoid_gated_add", &layer::sigmoid_gated_add,
        "out += sigmoid(gate) * y row by row, in place (float32)", py::arg("out"),
        py::arg("gate"), py::arg("y"));
  m.def("gated_delta_rule", &layer::gated_delta_rule,
        "a gated delta net's L steps of N sequences (state slots updated in place); its heads' "
        "outputs normed and gated", py::arg("state"), py::arg("slots"), py::arg("mixed"),
        py::arg("a"), py::arg("b"), py::arg("z"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("norm_weight"), py::arg("eps"), py::arg("key_heads"));
  m.def("causal_conv", &layer::causal_conv,
        "a delta net's causal depthwise convolution over a step's rows, sequence by sequence "
        "(each one's kept inputs updated in place)", py::arg("state"), py::arg("slots"),
        py::arg("starts"), py::arg("x"), py::arg("weight"));
  m.def("mamba2_mix", &layer::mamba2_mix,
        "a Mamba2 layer's SSM over a step's sequences after its convolution (state slots "
        "updated in place): (T, H P) outputs gated by silu(z) and RMS-normed per group",
        py::arg("state"), py::arg("slots"), py::arg("starts"), py::arg("conv"),
        py::arg("conv_bias"), py::arg("dt"), py::arg("z"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("D"), py::arg("norm_weight"), py::arg("eps"), py::arg("groups"),
        py::arg("dt_min"), py::arg("dt_max"));
  m.def("sigmoid_mul", &layer::sigmoid_mul, "x * sigmoid(gate) row by row (float32)",
        py::arg("x"), py::arg("gate"));
  namespace q = gemm::quant;
  m.def("q4_linear", &q::q4_linear, "x @ W^T for 4-bit blocks (q * d + m)");
  m.def("q8_linear", &q::q8_linear, "x @ W^T for int8 blocks (q * d)");
  m.def("q4_linear_dequant", &q::q4_linear_dequant, "q4_linear through row tiles and MKL");
  m.def("q8_linear_dequant", &q::q8_linear_dequant, "q8_linear through row tiles and MKL");
  m.def("q4_dequantize", &q::q4_dequantize, "float rows of 4-bit blocks");
  m.def("q8_dequantize", &q::q8_dequantize, "float rows of int8 blocks");
  m.def("int8_prepare", &q::int8_prepare, "outlier split and per-row scaling for fbgemm");
  m.def("q4_columns", &q::q4_columns, "float columns of 4-bit blocks");
  m.def("q8_columns", &q::q8_columns, "float columns of int8 blocks");
  namespace pg = gemm::panel;
  m.def("isa", &pg::get_isa, "the instruction set the panel kernels run: avx512, avx2, scalar");
  m.def("set_isa", &pg::set_isa, "choose the panel kernels' instruction set (auto: the best)");
  m.def("pack_dense", &pg::pack_dense, "float weight (N, K) -> panels (P, K, L)");
  m.def("dense_linear", &pg::dense_linear, "x @ W^T over dense panels, one order per value",
        py::arg("x"), py::arg("packed"), py::arg("n_out"));
  m.def("pack_blocks", &pg::pack_blocks, "q4/q8 blocks -> panels (wq, dw, mw)", py::arg("qs"),
        py::arg("d"), py::arg("m") = py::none(), py::arg("float_acts") = false);
  m.def("block_linear", &pg::block_linear, "x @ W^T over block panels, one order per value",
        py::arg("x"), py::arg("wq"), py::arg("dw"), py::arg("mw"), py::arg("n_out"),
        py::arg("float_acts") = false);
  m.def("dense_linear_group", &pg::dense_linear_group,
        "dense_linear(xs[i], panels[i], n_outs[i]) for every i (float32) in one parallel "
        "region, the same bits", py::arg("xs"), py::arg("panels"), py::arg("n_outs"));
  m.def("block_linear_group", &pg::block_linear_group,
        "block_linear(xs[i], *panels[i], n_outs[i]) for every i in one parallel region, the "
        "same bits", py::arg("xs"), py::arg("panels"), py::arg("n_outs"));
  m.def("block_argmax", &pg::block_argmax,
        "each row's argmax of block_linear(x, float_acts=True), from the int8 panels' values and "
        "exact float values of the columns within their error bound; -1: not finite",
        py::arg("x"), py::arg("wk"), py::arg("wq"), py::arg("dw"), py::arg("mw"), py::arg("wmax"),
        py::arg("n_out"));
  m.def("peak_rate", &pg::peak_rate, "ops/s of the kernels' instructions in registers, all "
        "threads: f32_fma, f64_fma, int8_dot, bf16_dot, amx_bf16", py::arg("kind"), py::arg("iters"));
  namespace amx = gemm::amx;
  m.def("amx_available", &amx::available,
        "whether bf16_linear runs here (AMX-BF16, and the kernel plan allows it)");
  m.def("prompt_attention_isa", &attention::amx::prompt_attention_isa,
        "what a prompt row's bfloat16 attention runs here: amx, avx512_bf16, or '' (none)");
  m.def("pack_bf16", &amx::pack_bf16, "float weight (N, K) -> AMX bfloat16 tiles (P, KS, 16, 32)");
  m.def("bf16_linear", &amx::bf16_linear, "x @ W^T on AMX bfloat16 tiles, one order per value",
        py::arg("x"), py::arg("packed"), py::arg("n_out"));
  // The kernel plan (model/plan.py): what the CPU runs, the plan's choices, what ran.
  m.def("cpu_features", &cpu_features, "what this CPU and build run: avx2, avx512, "
        "avx512_bf16, amx (whatever the plan allows)");
  m.def("set_amx", &amx::set_allowed, "whether the AMX tiles may run (the plan's choice)");
  m.def("set_amx_int8_from", &amx::set_int8_from,
        "from how many rows block_linear's int8 route runs on AMX-INT8 tiles (0: never)");
  m.def("amx_int8_from", &amx::int8_from, "set_amx_int8_from's value");
  m.def("set_bf16_dot", &attention::amx::set_bf16_dot, "whether AVX512-BF16 attention may run");
  m.def("set_prompt_attention", &attention::set_prompt_attention,
        "whether prompt rows take the bfloat16 attention (the plan's choice)");
  m.def("kernel_runs", &kernel_runs, "calls per kernel and instruction set since start");
  layer::bind_decoder_layer(m);
}
