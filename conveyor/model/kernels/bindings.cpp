// The Python module of the compiled CPU ops: one extension built from the sources listed in
// kernels/__init__.py (SOURCES); ops.h declares each op and names the file that defines it.
#include <torch/extension.h>

#include "ops.h"

void bind_decoder_layer(pybind11::module& m);  // decoder_layer.cpp: the DecoderLayer class

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("advise_huge_pages", &advise_huge_pages, "madvise(MADV_HUGEPAGE) over a tensor");
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of q and k, in place (CPU)");
  m.def("paged_attention", &paged_attention, "paged attention over a whole step (CPU)");
  m.def("write_kv", &write_kv, "write K/V into cache slots (CPU)");
  m.def("small_gemm", &small_gemm, "x @ weight.T for a few rows of x (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim as the model computes it (CPU)");
  bind_decoder_layer(m);
}
