// y = x W^T on AMX tiles in bfloat16, float32 sums: the route of prompt rows on CPUs with
// AMX-BF16 (model/prompt_route.py says which rows take it, and why a row's route never depends
// on the step around it).
//
// Why bfloat16 for prompt rows and not the block kernels' int8 tiles: GGUF weights carry a
// scale per block of 32 k, so an int8 tile dot product runs 32 k before its sums have to leave
// the tile unit and be folded by vector instructions; in bfloat16 a tile sums a whole row of K
// in place, and leaves it once. Generated rows do take int8 tiles (the second kernel below):
// they must keep the block kernel's bits, which only the int8 sums give, and the fold that
// bounds both is the VNNI kernel's too (from 32 rows 1.0-1.1x its speed on two threads,
// 1.15-1.26x on one; docs/benchmarks.md).
//
// Layout
//   packed (P, KS, 16, 32) bfloat16: panel p holds output columns 16p .. 16p + 15, tile ks holds
//          k = 32 ks .. 32 ks + 31 as AMX's B operand wants it: row r, pair of columns (2c, 2c+1)
//          = W[16p + c][32 ks + 2r], W[16p + c][32 ks + 2r + 1]. Columns and k past the weight's
//          are zeros.
//   x      (M, K) float32 rows, rounded to bfloat16 (nearest even) into tiles (M' / 16, KS, 16,
//          32), zero rows and k after its own.
//
// One reduction order per value: every output is one tile row's dot product over its own x row
// and W column, accumulated tile by tile over k = 0, 32, 64, .. in the tile unit, whatever the
// row count, the row's place in its tile or the thread; threads split the columns.
// Tile loads, not the dot products, bound the kernel (a tile load costs about a dot product,
// and tiles are not renamed), so every operand tile is a contiguous, aligned KiB; four
// accumulator tiles (two row tiles x two panels) share each load twice.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "isa/balance.h"

#include "ops.h"

#if CONVEYOR_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace conveyor::gemm::amx {

#if CONVEYOR_AMX
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes. Here: 0..3 sums (row tile i, panel j at 2i + j), 4, 5 the rows
// of row tiles 0 and 1, 6, 7 the weights of panels 0 and 1 (attention/amx_attention.cpp: its own).
void configure() {
  alignas(64) TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC does not count the tile-config load as a read of cfg: out of line, it dropped the
  // stores above, and ldtilecfg faulted on a configuration of zero tiles. The barrier keeps them.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

namespace {

constexpr int64_t kK = 32;  // bfloat16 k per tile row (64 bytes)
constexpr int64_t kN = 16;  // columns per panel
constexpr int64_t kM = 16;  // rows per tile

#if CONVEYOR_AMX
// The CPU's tile instructions (CPUID leaf 7: AMX-BF16, AMX-TILE) and, on Linux, the process's
// permission to use the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}


// Sums of one block of up to 32 rows x 32 columns (panels w0 and w1) over all KS tiles of k.
// Tile numbers are immediates, so each shape is its own instance.
template <bool kTwoRows, bool kTwoPanels>
void block(const uint16_t* x0, const uint16_t* w0, const uint16_t* w1, int64_t ks_count) {
  _tile_zero(0);
  if constexpr (kTwoPanels) _tile_zero(1);
  if constexpr (kTwoRows) _tile_zero(2);
  if constexpr (kTwoRows && kTwoPanels) _tile_zero(3);
  constexpr int64_t kTile = kM * kK;  // values of one tile, 1 KiB
  const uint16_t* x1 = x0 + ks_count * kTile;
  for (int64_t ks = 0; ks < ks_count; ++ks) {
    _tile_loadd(4, x0 + ks * kTile, 64);
    _tile_loadd(6, w0 + ks * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoPanels) {
      _tile_loadd(7, w1 + ks * kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kTwoRows) {
      _tile_loadd(5, x1 + ks * kTile, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kTwoPanels) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Sum tile t (0..3) to y rows r0.., columns c0.. (only those inside m x n); scratch: 16 x 16
// floats. Tile numbers are immediates, hence the switch.
void tile_store(int t, void* out, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, out, stride); break;
    case 1: _tile_stored(1, out, stride); break;
    case 2: _tile_stored(2, out, stride); break;
    default: _tile_stored(3, out, stride); break;
  }
}

void store(int t, float* y, int64_t m, int64_t n, int64_t r0, int64_t c0, float* scratch) {
  if (r0 >= m || c0 >= n) return;
  if (r0 + kM <= m && c0 + kN <= n) {
    tile_store(t, y + r0 * n + c0, n * sizeof(float));
    return;
  }
  tile_store(t, scratch, kN * sizeof(float));
  const int64_t rows = std::min(kM, m - r0), cols = std::min(kN, n - c0);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(y + (r0 + r) * n + c0, scratch + r * kN, cols * sizeof(float));
}

// One row of x to bfloat16 (nearest even) in the tile-major layout: value k of row r at
// ((r / 16) KS + k / 32) 512 + (r % 16) 32 + k % 32, zeros after its k values.
void round_row(const float* x, int64_t k, uint16_t* out, int64_t ks_count) {
  for (int64_t ks = 0; ks < ks_count; ++ks, x += kK, k -= kK) {
    uint16_t* dst = out + ks * kM * kK;
    if (k >= kK) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
      _mm512_storeu_si512(dst, (__m512i)v);
      continue;
    }
    for (int64_t i = 0; i < kK; ++i) dst[i] = i < k ? c10::BFloat16(x[i]).x : 0;
  }
}

// x (M, K) float32 in tile-major bfloat16 (round_row), row tiles padded to an even count of
// zero rows: each tile one contiguous KiB for the tile loads.
at::Tensor round_rows(const at::Tensor& x, int64_t ks_count) {
  const at::Tensor xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t row_tiles = (m + 2 * kM - 1) / (2 * kM) * 2;
  at::Tensor xb = at::empty({row_tiles, ks_count, kM, kK}, x.options().dtype(at::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, row_tiles * kM, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* dst = xbp + (r / kM) * ks_count * kM * kK + (r % kM) * kK;
      if (r < m) {
        round_row(xp + r * k, k, dst, ks_count);
      } else {
        for (int64_t ks = 0; ks < ks_count; ++ks)
          std::memset(dst + ks * kM * kK, 0, kK * sizeof(uint16_t));
      }
    }
  });
  return xb;
}
#endif

// Whether the kernel plan lets the tiles run (set_allowed, once at load: model/plan.py).
std::atomic<bool>& allowed() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<int64_t>& linear_runs() {
  static std::atomic<int64_t> count{0};
  return count;
}

// What both prompt-tile entry points check: x (M, K) float32 on the CPU, out (M, out_cols)
// contiguous float32, packed pack_bf16's tiles of a weight of n_out rows and K columns. KS.
int64_t check_operands(const char* name, const at::Tensor& x, const at::Tensor& packed,
                       int64_t n_out, const at::Tensor& out, int64_t out_cols) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), name,
              ": x (M, K) float32 on the CPU");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == out_cols,
              name, ": the output (M, ", out_cols, ") contiguous float32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kM && packed.size(3) == 2 * kN && packed.is_contiguous(),
              name, ": packed is pack_bf16's (P, KS, 16, 32) bfloat16");
  const int64_t k = x.size(1), panels = packed.size(0), ks_count = packed.size(1);
  TORCH_CHECK(k <= ks_count * kK && k > (ks_count - 1) * kK, name, ": x has ", k,
              " columns, the weight ", ks_count * kK, " (padded)");
  TORCH_CHECK(n_out > (panels - 1) * kN && n_out <= panels * kN, name, ": n_out ", n_out,
              " does not fit the packed panels");
  return ks_count;
}

}  // namespace

bool usable() {
#if CONVEYOR_AMX
  static const bool usable = probe();
  return usable;
#else
  return false;
#endif
}

bool available() { return usable() && allowed().load(); }

void set_allowed(bool on) { allowed().store(on); }

int64_t bf16_linear_runs() { return linear_runs().load(); }

// Tile dot products per second on all threads, as FLOPs (16 x 16 x 32 multiply-adds each):
// four independent accumulators on operands already in tiles, nothing loaded. 0 without AMX.
double peak(int64_t iters) {
  TORCH_CHECK(iters > 0, "peak: iters must be > 0");
#if CONVEYOR_AMX
  if (!available()) return 0.0;
  const int64_t threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    configure();
    for (int t = 0; t < 8; ++t) {
      switch (t) {  // immediates
        case 0: _tile_zero(0); break;
        case 1: _tile_zero(1); break;
        case 2: _tile_zero(2); break;
        case 3: _tile_zero(3); break;
        case 4: _tile_zero(4); break;
        case 5: _tile_zero(5); break;
        case 6: _tile_zero(6); break;
        default: _tile_zero(7); break;
      }
    }
    for (int64_t i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    alignas(64) float sink[kM * kN];
    _tile_stored(0, sink, kN * sizeof(float));
    _tile_release();
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 4.0 * 2 * kM * kN * kK * static_cast<double>(iters) * threads / seconds;
#else
  return 0.0;
#endif
}

at::Tensor pack_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_bf16: a float32 weight (N, K)");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kN - 1) / kN, ks_count = (k + kK - 1) / kK;
  at::Tensor packed = at::zeros({panels, ks_count, kM, 2 * kN}, w.options().dtype(at::kBFloat16));
  const float* src = w.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kN && p * kN + c < n; ++c)
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t ks = kk / kK, r = (kk % kK) / 2, j = kk % 2;
          dst[((p * ks_count + ks) * kM + r) * 2 * kN + 2 * c + j] =
              c10::BFloat16(src[(p * kN + c) * k + kk]).x;
        }
  });
  return packed;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out) {
  at::Tensor y = at::empty({x.size(0), n_out}, x.options());
  bf16_linear_into(x, packed, n_out, y);
  return y;
}

// The same into y (M, n_out), contiguous float32: a step's prompt rows straight into their rows
// of the projection's output, not copied there (decoder_layer.cpp's Projection).
void bf16_linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t n_out, at::Tensor& y) {
  const int64_t ks_count = check_operands("bf16_linear", x, packed, n_out, y, n_out);
  const int64_t m = x.size(0), panels = packed.size(0);
  if (m == 0) return;
#if CONVEYOR_AMX
  TORCH_CHECK(available(), "bf16_linear: this CPU (or the kernel plan) has no AMX-BF16");
  linear_runs().fetch_add(1, std::memory_order_relaxed);
  const at::Tensor xb = round_rows(x, ks_count);
  const uint16_t* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  // Each thread takes a contiguous range of column blocks (two panels each) and walks it in
  // groups of kGroup blocks (their weights ~0.6 MB at K = 576, from L2), all row blocks of a
  // group before the next: a row block's tiles stay in L1 across the group.
  constexpr int64_t kGroup = 16;
  const int64_t col_blocks = (panels + 1) / 2, threads = at::get_num_threads();
  const int64_t tile = kM * kK;
  at::parallel_for(0, col_blocks, (col_blocks + threads - 1) / threads, [&](int64_t b0, int64_t b1) {
    configure();
    alignas(64) float scratch[kM * kN];
    for (int64_t g = b0; g < b1; g += kGroup) {
      for (int64_t r0 = 0; r0 < m; r0 += 2 * kM) {
        const uint16_t* x0 = xbp + (r0 / kM) * ks_count * tile;
        const bool two_rows = r0 + kM < m;
        for (int64_t b = g; b < std::min(b1, g + kGroup); ++b) {
          const int64_t p = 2 * b, c0 = p * kN;
          const bool two_panels = p + 1 < panels;
          const uint16_t* w0 = wp + p * ks_count * tile;
          const uint16_t* w1 = w0 + ks_count * tile;
          if (two_rows && two_panels) {
            block<true, true>(x0, w0, w1, ks_count);
          } else if (two_rows) {
            block<true, false>(x0, w0, w1, ks_count);
          } else if (two_panels) {
            block<false, true>(x0, w0, w1, ks_count);
          } else {
            block<false, false>(x0, w0, w1, ks_count);
          }
          store(0, yp, m, n_out, r0, c0, scratch);
          if (two_panels) store(1, yp, m, n_out, r0, c0 + kN, scratch);
          if (two_rows) store(2, yp, m, n_out, r0 + kM, c0, scratch);
          if (two_rows && two_panels) store(3, yp, m, n_out, r0 + kM, c0 + kN, scratch);
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AMX-BF16 (-march=native on such a CPU)");
#endif
}

// act (M, inner) = silu(x Wg^T) * (x Wu^T) for a gate_up weight packed as one (gate's panels,
// then up's): each column block pairs gate panel j with up panel j (both already in the packed
// tiles), and its sums go from the tiles straight to `silu_rows` (the layer's SiLU-and-multiply
// row loop, handed in so that both routes run the same code) instead of to a (M, 2 inner) product
// that a second pass would read back: at a 512-token chunk that product is 6 MB a layer, and
// the pass over it was bound by that traffic. The sums are bf16_linear's, value for value (a
// tile's sums do not depend on the panel beside it), so act has the bits of bf16_linear, then
// silu_rows over its rows. inner: a multiple of 16.
void bf16_silu_mul_into(const at::Tensor& x, const at::Tensor& packed, int64_t inner,
                        at::Tensor& act, SiluRows silu_rows) {
  TORCH_CHECK(inner > 0 && inner % kN == 0, "bf16_silu_mul: inner must be a multiple of 16");
  const int64_t ks_count = check_operands("bf16_silu_mul", x, packed, 2 * inner, act, inner);
  const int64_t m = x.size(0);
  if (m == 0) return;
#if CONVEYOR_AMX
  TORCH_CHECK(available(), "bf16_silu_mul: this CPU (or the kernel plan) has no AMX-BF16");
  linear_runs().fetch_add(1, std::memory_order_relaxed);
  const at::Tensor xb = round_rows(x, ks_count);
  const uint16_t* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* ap = act.data_ptr<float>();
  constexpr int64_t kGroup = 16;  // as bf16_linear_into: a group's weights from L2
  const int64_t blocks = inner / kN, threads = at::get_num_threads();
  const int64_t tile = kM * kK;
  at::parallel_for(0, blocks, (blocks + threads - 1) / threads, [&](int64_t b0, int64_t b1) {
    configure();
    // A row tile's gate and up sums side by side, as silu_rows reads a gate_up row: 16 + 16.
    alignas(64) float pair[kM * 2 * kN];
    for (int64_t g = b0; g < b1; g += kGroup) {
      for (int64_t r0 = 0; r0 < m; r0 += 2 * kM) {
        const uint16_t* x0 = xbp + (r0 / kM) * ks_count * tile;
        const bool two_rows = r0 + kM < m;
        for (int64_t j = g; j < std::min(b1, g + kGroup); ++j) {
          const uint16_t* wg = wp + j * ks_count * tile;
          const uint16_t* wu = wp + (blocks + j) * ks_count * tile;
          if (two_rows) {
            block<true, true>(x0, wg, wu, ks_count);
          } else {
            block<false, true>(x0, wg, wu, ks_count);
          }
          for (int half = 0; half < (two_rows ? 2 : 1); ++half) {
            const int64_t first = r0 + half * kM, rows = std::min(kM, m - first);
            tile_store(2 * half, pair, 2 * kN * sizeof(float));
            tile_store(2 * half + 1, pair + kN, 2 * kN * sizeof(float));
            for (int64_t r = 0; r < rows; ++r)
              silu_rows(pair + r * 2 * kN, ap + (first + r) * inner + j * kN, 1, kN);
          }
        }
      }
    }
    _tile_release();
  });
#else
  (void)act;
  (void)silu_rows;
  TORCH_CHECK(false, "bf16_silu_mul: this build has no AMX-BF16 (-march=native on such a CPU)");
#endif
}

// ------------------------------------------------------------------------ int8 block tiles
// Generated rows of block-quantized weights on AMX-INT8 tiles: the same bits as the panel
// kernels' int8 route (gemm/panel_gemm.cpp, BlockVec::IntTile), which this replaces from the
// kernel plan's row count on (set_int8_from). Why that is exact: per token t, column n and
// block b the panel kernel computes the integer isum = sum_j q[n][j] xq[t][j] and folds it as
//   acc = fma(dw[n][b] * xd[t][b], float(isum), acc);  q4: acc = fma(xs[t][b], mw[n][b], acc)
// for b = 0, 1, .. in order. A tile dot product over the 32 k of one block gives the same
// integer (integer sums are exact in any order), and the fold below is the same instructions in
// the same order, so every value has the same bits whichever route ran it.
//
// Layout: the panels feed the tiles as packed (no copy of the weights). A panel's block is
// 16 columns x 32 k as chunks of 16 columns x 4 k, which is AMX's B operand already (row g,
// bytes 4c .. 4c + 3 = column c's k = 4g .. 4g + 3):
//   q8: 8 chunks of q + 128 (unsigned): tdpbsud (signed activations x unsigned weights) sums
//       isum + 128 * sum_j xq[t][j], and the fold takes 128 x the block's integer sum off;
//   q4: 4 chunks with k = 4g .. in the low nibbles and k = 16 + 4g .. in the high ones: split
//       once per panel into a thread's scratch (nb x 512 bytes) that all token tiles then read.
// Activations: the int8 rows as quantized for the panels, zero rows up to a multiple of 16; a
// tile of 16 rows x 32 bytes is loaded from them in place (stride K).
// block_argmax's approximate pass (the lm_head's greedy rows) takes the same tiles: each row's
// bounds over a panel from the folded values, as the panels compute them (Int8Blocks::lo).
// Memory: no weight bytes beyond the panels; per call the activations' padding rows (< 16 x K
// bytes), a block-major copy of the activations' per-block values (RowTable, 2 x rows x nb x 4
// bytes) and, q4, a thread's nb x 512-byte scratch.
// Loop order: threads split the panels (balanced_for, pieces of 2); per panel, token tiles of
// 16 rows; per tile, the blocks pipelined over four sum tiles (int8_tile), each stored to a
// 1 KiB scratch and folded into 16 vector accumulators (one per row, lanes = columns).

namespace {

std::atomic<int64_t>& int8_from_rows() {
  static std::atomic<int64_t> rows{32};  // the kernel plan's default (model/plan.py)
  return rows;
}

std::atomic<int64_t>& int8_runs() {
  static std::atomic<int64_t> count{0};
  return count;
}

#if CONVEYOR_AMX_INT8
bool probe_int8() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 25) & 1u;  // AMX-INT8
}

// Tiles 0..3: int32 sums 16 x 16; 4, 5: activations 16 rows x 32 bytes; 6, 7: weights 8 rows
// (k / 4) x 64 bytes (16 columns x 4 k).
void configure_int8() {
  alignas(64) TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 32;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  __asm__ volatile("" : : "r"(&cfg) : "memory");  // see configure()
  _tile_loadconfig(&cfg);
}

// A row tile's per-block activation values, block-major: for block b, its 16 rows' xd, and xs
// (q4) or xi (q8), at [b * 16 + r]. The fold reads a block's 16 rows from one line each, at
// fixed offsets, where the row-major arrays put them a row (nb values) apart: 16 more addresses
// to keep, which GCC spilled to the stack and reloaded at every block (5-10% of a copy of the
// kernel on one thread; ~4% of a 128-row decode step's projections).
struct RowTable {
  std::vector<float> xd, xs;
  std::vector<int32_t> xi;
  RowTable(const Int8Blocks& a, bool q4) {
    const int64_t rows = (a.tokens + 15) / 16 * 16, nb = a.nb;
    xd.resize(rows * nb);
    if (q4) xs.resize(rows * nb);
    else xi.resize(rows * nb);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = (t / 16) * nb * 16 + b * 16 + t % 16;
        xd[at] = a.xd[t * nb + b];
        if (q4) xs[at] = a.xs[t * nb + b];
        else xi[at] = a.xi[t * nb + b];
      }
  }
};

// acc[r] (16 columns of row r) folds block b's integer sums (scratch: 16 rows x 16 int32); xd,
// xs / xi: the row tile's RowTable entries of block b.
template <bool Q4>
inline void fold(__m512 (&acc)[16], const int32_t* sums, const float* xd, const float* xs,
                 const int32_t* xi, const int16_t* dwp, const int16_t* mwp, int64_t b) {
  const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dwp + b * 16)));
  __m512 mw;
  if constexpr (Q4) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mwp + b * 16)));
  // Unrolled, so that acc stays in registers: as a loop GCC kept it on the stack, and its
  // loads and stores (32 a block with the tile store's) bounded the kernel.
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    __m512i isum = _mm512_load_si512(sums + r * 16);
    if constexpr (!Q4) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * xi[r]));
    const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r]));
    acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[r]);
    if constexpr (Q4) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r]), mw, acc[r]);
  }
}

// One block's sums into tile C from activation tile A and weight tile W (immediates).
#define CONVEYOR_INT8_BLOCK(C, A, W, xa, wb, stride) \
  do {                                               \
    _tile_zero(C);                                   \
    _tile_loadd(A, xa, stride);                      \
    _tile_loadd(W, wb, 64);                          \
    _tile_dpbsud(C, A, W);                           \
  } while (0)

// 16 rows from row0 against one panel (wp: nb blocks of 512 bytes as B tiles) into y. Software
// pipelined in three stages over the four sum tiles and their four scratch buffers: blocks
// b + 2, b + 3 go to the tile unit, blocks b, b + 1 are stored, and blocks b - 2, b - 1 (stored
// one stage earlier) are folded. In program order store then fold, each block waited for its
// dot product and then for its store to reach the cache before the vectors could read it,
// and the tile unit idled meanwhile. The fold still takes the blocks one by one in order.
template <bool Q4>
void int8_tile(const Int8Blocks& a, const RowTable& table, const uint8_t* wp,
               const int16_t* dwp, const int16_t* mwp, int64_t row0, int64_t col0,
               int32_t (*sums)[256]) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xa = a.xq + row0 * a.k;
  const int64_t nb = a.nb;
#define ISSUE(C, A, W, b) CONVEYOR_INT8_BLOCK(C, A, W, xa + (b) * 32, wp + (b) * 512, a.k)
  const int64_t at = row0 * nb;  // the row tile's RowTable entries
  const float* xd = table.xd.data() + at;
  const float* xs = Q4 ? table.xs.data() + at : nullptr;
  const int32_t* xi = Q4 ? nullptr : table.xi.data() + at;
#define FOLD(C, b) fold<Q4>(acc, sums[C], xd + (b) * 16, xs ? xs + (b) * 16 : nullptr, \
                            xi ? xi + (b) * 16 : nullptr, dwp, mwp, b)
  ISSUE(0, 4, 6, 0);
  if (nb > 1) ISSUE(1, 5, 7, 1);
  int64_t b = 0;
  for (; b < nb; b += 4) {
    if (b + 2 < nb) ISSUE(2, 4, 6, b + 2);
    if (b + 3 < nb) ISSUE(3, 5, 7, b + 3);
    _tile_stored(0, sums[0], 64);
    if (b + 1 < nb) _tile_stored(1, sums[1], 64);
    if (b >= 4) {
      FOLD(2, b - 2);
      FOLD(3, b - 1);
    }
    if (b + 4 < nb) ISSUE(0, 4, 6, b + 4);
    if (b + 5 < nb) ISSUE(1, 5, 7, b + 5);
    if (b + 2 < nb) _tile_stored(2, sums[2], 64);
    if (b + 3 < nb) _tile_stored(3, sums[3], 64);
    FOLD(0, b);
    if (b + 1 < nb) FOLD(1, b + 1);
  }
  if (b - 2 < nb) FOLD(2, b - 2);
  if (b - 1 < nb) FOLD(3, b - 1);
#undef ISSUE
#undef FOLD
  const int64_t rows = std::min<int64_t>(16, a.tokens - row0);
  const int64_t cols = std::min<int64_t>(16, a.n_out - col0);
  if (a.lo != nullptr) {  // block_argmax: each row's bounds over the panel, as the panels'
    const __mmask16 valid = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 w = _mm512_maskz_loadu_ps(valid, a.wmax + col0);
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const int64_t panels = (a.n_out + 15) / 16;
    for (int r = 0; r < rows; ++r) {
      const __m512 c = _mm512_set1_ps(a.c[row0 + r]);
      const int64_t at = (row0 + r) * panels + col0 / 16;
      a.lo[at] = _mm512_reduce_max_ps(_mm512_mask_blend_ps(valid, none, _mm512_fnmadd_ps(c, w, acc[r])));
      a.hi[at] = _mm512_reduce_max_ps(_mm512_mask_blend_ps(valid, none, _mm512_fmadd_ps(c, w, acc[r])));
    }
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    if (r >= rows) break;
    float* dst = a.y + (row0 + r) * a.n_out + col0;
    if (cols == 16) {
      _mm512_storeu_ps(dst, acc[r]);
    } else {
      _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << cols) - 1), acc[r]);
    }
  }
}
#undef CONVEYOR_INT8_BLOCK

// A q4 panel's blocks as B tiles: per block, the low nibbles of its 4 chunks (k = 0 .. 15),
// then the high ones (k = 16 .. 31).
void split_nibbles(const uint8_t* src, int64_t nb, uint8_t* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, src += 256, dst += 512) {
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(src + g * 64);
      _mm512_store_si512(dst + g * 64, _mm512_and_si512(v, low));
      _mm512_store_si512(dst + (4 + g) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  }
}

template <bool Q4>
void int8_run(const Int8Blocks& a) {
  const RowTable table(a, Q4);
  conveyor::balance::balanced_for(a.panels, 2, [&](int64_t p0, int64_t p1) {
    configure_int8();
    alignas(64) int32_t sums[4][256];
    std::unique_ptr<uint8_t[]> split_store;
    uint8_t* split = nullptr;
    if constexpr (Q4) {
      split_store.reset(new uint8_t[a.nb * 512 + 64]);
      split = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(split_store.get()) + 63) & ~uintptr_t{63});
    }
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* wp = a.wq + p * a.nb * (Q4 ? 256 : 512);
      if constexpr (Q4) {
        split_nibbles(wp, a.nb, split);
        wp = split;
      }
      const int16_t* dwp = a.dw + p * a.nb * 16;
      const int16_t* mwp = Q4 ? a.mw + p * a.nb * 16 : nullptr;
      for (int64_t row0 = 0; row0 < a.tokens; row0 += 16)
        int8_tile<Q4>(a, table, wp, dwp, mwp, row0, p * 16, sums);
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool int8_usable() {
#if CONVEYOR_AMX_INT8
  static const bool usable = conveyor::gemm::amx::usable() && probe_int8();
  return usable;
#else
  return false;
#endif
}

void set_int8_from(int64_t rows) { int8_from_rows().store(rows); }

int64_t int8_from() { return int8_from_rows().load(); }

bool int8_takes(int64_t rows) {
  const int64_t from = int8_from_rows().load();
  return from > 0 && rows >= from && int8_usable() && allowed().load();
}

int64_t int8_linear_runs() { return int8_runs().load(); }

void int8_block_linear(const Int8Blocks& a) {
#if CONVEYOR_AMX_INT8
  TORCH_CHECK(int8_usable(), "int8_block_linear: no AMX-INT8 here");
  int8_runs().fetch_add(1, std::memory_order_relaxed);
  if (a.mw != nullptr) return int8_run<true>(a);
  return int8_run<false>(a);
#else
  TORCH_CHECK(false, "int8_block_linear: this build has no AMX-INT8");
#endif
}

}  // namespace conveyor::gemm::amx
