// y += the LoRA delta of a step's adapter rows (CPU, float32 and float64), in one pass.
//
// Layout (lora/slots.py): per projection, every resident slot's A^T side by side, a (in,
// slots * W), and B dense, b (slots * W, out), W = S * R: slice s (q, k, v; gate, up; or the
// one) of slot k owns columns k * W + s * R .. + R of a and the same rows of b, its B^T times
// its scaling in its own columns [columns[s], columns[s + 1]) and zero elsewhere. Row i of the
// step, of slot k, gets
//
//     y[i, c] += sum_r (x[i] . a[:, k W + s R + r]) * b[k W + s R + r, c]   for c in slice s.
//
// Why a kernel: with torch ops this was a threaded MKL call per shrink, and a gather, a matmul
// and a scatter per adapter and projection, each with microseconds of arithmetic; forks and
// barriers took ~25% of a 32-row step with 4 adapters (perf), and the shrink ran every row
// against every slot and the expand every slice against every column (zeros). Here one
// parallel region per projection runs tiles of kRows rows of one slot: the shrink against that
// slot's W columns of a only (vectors across the columns, down a's rows: no sums across lanes),
// then the expand of each slice over its own columns only (a slot's a and b are read from L2
// once per tile, not once per row).
//
// One order per value, whatever the batch: a row in a tile of kRows and a row alone run the
// same fused multiply-adds on their own accumulators (the tiles only share loads): each shrink
// value its even-k and odd-k terms, each summed in k order, then added; each output value
// y + s_0 b_0 + s_1 b_1 + ... in r order. The torch reference (lora/slots.py:
// ProjectionSlots.reference) adds the same terms in another order: the two agree to rounding,
// not bitwise.
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "isa/vec.h"

namespace conveyor::lora {

namespace {

using namespace conveyor::vec;

constexpr int kRows = 4;                              // rows of a tile
constexpr int kShrinkVecs = kRegisters >= 32 ? 2 : 1;  // vectors of a's columns per shrink step
constexpr int kExpandVecs = kRegisters >= 32 ? 4 : 2;  // vectors of columns per expand step
// (shrink_step and expand_step are kept out of line: inlined into the tile loop, GCC left one
// instance's accumulators on the stack.)

// acc + x * y, fused, always. GCC contracts `acc += x * y` into an FMA in most loops but not
// all: one instantiation of the AVX2 build kept a multiply and an add, so a row alone and the
// same row in a tile of four came out a rounding apart. The intrinsics pin it.
template <typename T>
inline Vec<T> madd(Vec<T> acc, Vec<T> x, Vec<T> y) {
#if defined(__x86_64__) && defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return _mm512_fmadd_ps(x, y, acc);
  else return _mm512_fmadd_pd(x, y, acc);
#elif defined(__x86_64__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) return _mm256_fmadd_ps(x, y, acc);
  else return _mm256_fmadd_pd(x, y, acc);
#else
  for (int i = 0; i < kLanes<T>; ++i) acc[i] = std::fma(x[i], y[i], acc[i]);
  return acc;
#endif
}

// s[i * width + j0 ..] = x_i A^T for the tile's rows, V vectors of a's columns: every value is
// the sum of its even-k terms plus the sum of its odd-k terms, each taken in k order (two
// chains of FMAs per accumulator keep the FMA units busy when a slot is one vector wide).
template <typename T, int TT, int V>
[[gnu::noinline]] void shrink_step(const T* const* xr, const T* a, int64_t lda, int64_t in,
                                   int64_t j0, int64_t width, T* s) {
  Vec<T> even[TT][V], odd[TT][V];
  for (int i = 0; i < TT; ++i)
    for (int v = 0; v < V; ++v) even[i][v] = odd[i][v] = Vec<T>{};
  int64_t k = 0;
  for (; k + 2 <= in; k += 2) {
    Vec<T> a0[V], a1[V];
    for (int v = 0; v < V; ++v) {
      a0[v] = load(a + k * lda + j0 + v * kLanes<T>);
      a1[v] = load(a + (k + 1) * lda + j0 + v * kLanes<T>);
    }
    for (int i = 0; i < TT; ++i) {
      const Vec<T> x0 = broadcast(xr[i][k]), x1 = broadcast(xr[i][k + 1]);
      for (int v = 0; v < V; ++v) {
        even[i][v] = madd<T>(even[i][v], x0, a0[v]);
        odd[i][v] = madd<T>(odd[i][v], x1, a1[v]);
      }
    }
  }
  if (k < in)
    for (int i = 0; i < TT; ++i)
      for (int v = 0; v < V; ++v) {
        const Vec<T> last = load(a + k * lda + j0 + v * kLanes<T>);
        even[i][v] = madd<T>(even[i][v], broadcast(xr[i][k]), last);
      }
  for (int i = 0; i < TT; ++i)
    for (int v = 0; v < V; ++v) store(s + i * width + j0 + v * kLanes<T>, even[i][v] + odd[i][v]);
}

// shrink_step for one column past the last whole vector, in the same order (std::fma: fused as
// the vector FMAs are, whatever the compiler makes of a scalar loop).
template <typename T, int TT>
inline void shrink_column(const T* const* xr, const T* a, int64_t lda, int64_t in, int64_t j,
                          int64_t width, T* s) {
  for (int i = 0; i < TT; ++i) {
    T even = 0, odd = 0;
    int64_t k = 0;
    for (; k + 2 <= in; k += 2) {
      even = std::fma(xr[i][k], a[k * lda + j], even);
      odd = std::fma(xr[i][k + 1], a[(k + 1) * lda + j], odd);
    }
    if (k < in) even = std::fma(xr[i][k], a[k * lda + j], even);
    s[i * width + j] = even + odd;
  }
}

// y_i[c0 .. c0 + V vectors) += sum_r s_i[r] b_r[...] for the tile's rows, in r order.
template <typename T, int TT, int V>
[[gnu::noinline]] void expand_step(T* const* yr, const T* s, int64_t width, const T* b,
                                   int64_t out, int64_t rank, int64_t c0) {
  Vec<T> acc[TT][V];
  for (int i = 0; i < TT; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = load(yr[i] + c0 + v * kLanes<T>);
  for (int64_t r = 0; r < rank; ++r) {
    Vec<T> bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load(b + r * out + c0 + v * kLanes<T>);
    for (int i = 0; i < TT; ++i) {
      const Vec<T> sv = broadcast(s[i * width + r]);
      for (int v = 0; v < V; ++v) acc[i][v] = madd<T>(acc[i][v], sv, bv[v]);
    }
  }
  for (int i = 0; i < TT; ++i)
    for (int v = 0; v < V; ++v) store(yr[i] + c0 + v * kLanes<T>, acc[i][v]);
}

struct Shape {
  int64_t in, out, lda, width, rank;
  const std::vector<int64_t>* columns;  // the slices' boundaries
};

// TT rows of one slot (x rows xr, y rows yr; a_slot, b_slot: the slot's columns of a, rows of
// b): the shrink into s (TT * width), then each slice's expand over its own columns.
template <typename T, int TT>
void run_tile(const T* const* xr, T* const* yr, const T* a_slot, const T* b_slot,
              const Shape& sh, T* s) {
  constexpr int64_t lanes = kLanes<T>, shrink = kShrinkVecs * lanes, expand = kExpandVecs * lanes;
  int64_t j = 0;
  for (; j + shrink <= sh.width; j += shrink)
    shrink_step<T, TT, kShrinkVecs>(xr, a_slot, sh.lda, sh.in, j, sh.width, s);
  for (; j + lanes <= sh.width; j += lanes)
    shrink_step<T, TT, 1>(xr, a_slot, sh.lda, sh.in, j, sh.width, s);
  for (; j < sh.width; ++j) shrink_column<T, TT>(xr, a_slot, sh.lda, sh.in, j, sh.width, s);
  const std::vector<int64_t>& columns = *sh.columns;
  for (size_t sl = 0; sl + 1 < columns.size(); ++sl) {
    const T* b_slice = b_slot + sl * sh.rank * sh.out;
    const T* s_slice = s + sl * sh.rank;
    const int64_t c1 = columns[sl + 1];
    int64_t c = columns[sl];
    for (; c + expand <= c1; c += expand)
      expand_step<T, TT, kExpandVecs>(yr, s_slice, sh.width, b_slice, sh.out, sh.rank, c);
    for (; c + lanes <= c1; c += lanes)
      expand_step<T, TT, 1>(yr, s_slice, sh.width, b_slice, sh.out, sh.rank, c);
    for (; c < c1; ++c)  // the columns past the last whole vector, in the same order (fused)
      for (int i = 0; i < TT; ++i) {
        T sum = yr[i][c];
        for (int64_t r = 0; r < sh.rank; ++r)
          sum = std::fma(s_slice[i * sh.width + r], b_slice[r * sh.out + c], sum);
        yr[i][c] = sum;
      }
  }
}

template <typename T>
void lora_add_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const std::vector<at::Tensor>& rows, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& columns, int64_t width) {
  const Shape sh{x.size(1), y.size(1), a.size(1), width,
                 width / static_cast<int64_t>(columns.size() - 1), &columns};
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  struct Tile {
    const int64_t* rows;
    int64_t slot;
    int count;  // kRows, or 1 for the rows past a slot's last whole tile
  };
  std::vector<Tile> tiles;
  for (size_t g = 0; g < rows.size(); ++g) {
    const int64_t n = rows[g].numel();
    const int64_t* idx = rows[g].data_ptr<int64_t>();
    int64_t i = 0;
    for (; i + kRows <= n; i += kRows) tiles.push_back({idx + i, slots[g], kRows});
    for (; i < n; ++i) tiles.push_back({idx + i, slots[g], 1});
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> s(kRows * width);
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tile = tiles[t];
      const T* xr[kRows];
      T* yr[kRows];
      for (int i = 0; i < tile.count; ++i) {
        xr[i] = xp + tile.rows[i] * x_stride;
        yr[i] = yp + tile.rows[i] * y_stride;
      }
      const T* a_slot = ap + tile.slot * width;  // its columns of a
      const T* b_slot = bp + tile.slot * width * sh.out;
      if (tile.count == kRows)
        run_tile<T, kRows>(xr, yr, a_slot, b_slot, sh, s.data());
      else
        run_tile<T, 1>(xr, yr, a_slot, b_slot, sh, s.data());
    }
  });
}

}  // namespace

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
              const std::vector<at::Tensor>& rows, const std::vector<int64_t>& slots,
              const std::vector<int64_t>& columns, int64_t num_slots) {
  TORCH_CHECK(y.device().is_cpu() && x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) &&
                  x.stride(1) == 1 && y.stride(1) == 1,
              "lora_add: x (T, in) and y (T, out) on the CPU, rows contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kDouble),
              "lora_add: x, y, a and b of one dtype, float32 or float64");
  TORCH_CHECK(num_slots > 0 && a.is_contiguous() && b.is_contiguous() &&
                  a.size(1) % num_slots == 0 && b.size(0) == a.size(1) &&
                  a.size(0) == x.size(1) && b.size(1) == y.size(1),
              "lora_add: a (in, slots * W) and b (slots * W, out), contiguous");
  const int64_t width = a.size(1) / num_slots;
  TORCH_CHECK(columns.size() >= 2 && columns.front() == 0 && columns.back() == y.size(1) &&
                  std::is_sorted(columns.begin(), columns.end()) &&
                  width % static_cast<int64_t>(columns.size() - 1) == 0,
              "lora_add: columns, the slices' boundaries from 0 to out, S of them dividing W");
  TORCH_CHECK(rows.size() == slots.size(), "lora_add: one row tensor per slot");
  for (size_t g = 0; g < rows.size(); ++g) {
    TORCH_CHECK(slots[g] >= 0 && slots[g] < num_slots, "lora_add: a slot out of range");
    TORCH_CHECK(rows[g].scalar_type() == at::kLong && rows[g].is_contiguous() &&
                    rows[g].device().is_cpu(),
                "lora_add: rows, contiguous int64 CPU tensors");
    const int64_t* idx = rows[g].data_ptr<int64_t>();
    for (int64_t i = 0; i < rows[g].numel(); ++i)
      TORCH_CHECK(idx[i] >= 0 && idx[i] < y.size(0), "lora_add: a row out of range");
  }
  if (y.scalar_type() == at::kFloat)
    lora_add_typed<float>(y, x, a, b, rows, slots, columns, width);
  else
    lora_add_typed<double>(y, x, a, b, rows, slots, columns, width);
}

}  // namespace conveyor::lora
