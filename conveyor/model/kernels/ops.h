// The compiled CPU ops, one declaration each, with the file that defines it: bindings.cpp
// exposes them to Python, and decoder_layer.cpp calls them from C++.
#pragma once

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

// decoder_layer.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
