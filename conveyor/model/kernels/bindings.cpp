// The Python module of the compiled CPU ops: one extension built from the sources listed in
// kernels/__init__.py (SOURCES); each op is defined in the file named beside it.
#include <torch/extension.h>

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t block_size,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping, int64_t block_size);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
bool advise_huge_pages(const at::Tensor& t);
// small_gemm.cpp
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("advise_huge_pages", &advise_huge_pages, "madvise(MADV_HUGEPAGE) over a tensor");
  m.def("rotary_embedding", &rotary_embedding, "rotary embedding of q and k, in place (CPU)");
  m.def("paged_attention", &paged_attention, "paged attention over a whole step (CPU)");
  m.def("write_kv", &write_kv, "write K/V into cache slots (CPU)");
  m.def("small_gemm", &small_gemm, "x @ weight.T for a few rows of x (CPU)");
}
