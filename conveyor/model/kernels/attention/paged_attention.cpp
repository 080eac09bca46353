// Paged attention over a whole step (decode rows and prompt chunks together), reading the KV
// cache in place; the KV write through a slot mapping; rotary embedding in place. CPU, float32
// and float64 (the equivalence tests run the model in float64 through this same code).
// The cache may also hold float16, bfloat16 or fp8 e4m3 for a float32 model (--kv-cache-dtype):
// half or a quarter of the bytes of the bandwidth-bound inner loops; values are widened to
// float32 as they are loaded (F16C for float16, a 16-bit shift for bfloat16, a shift and a
// multiply for fp8) and rounded to nearest even when written (fp8: clamped to +-448 first).
//
// Data layout
//   kv_cache   (2, num_blocks, num_kv_heads, block_size * head_dim), contiguous. One (block,
//              kv head) tile is block_size * head_dim values:
//                kv_cache[0]: keys transposed, (head_dim, block_size): the scores of one query
//                             against a block are head_dim broadcast-FMAs over block_size keys,
//                             vectorised across keys, with no horizontal sums;
//                kv_cache[1]: values, (block_size, head_dim): P @ V adds rows of head_dim.
//   q          (T, H, D) with any strides (the projections hand over transposed views);
//              out (T, H, D) contiguous.
//   query_start (S + 1,) int64: rows of sequence s are [query_start[s], query_start[s + 1]).
//   seq_lens   (S,) int64: tokens of s in the cache after this step's write (context + new);
//              new row i of s sits at position seq_lens[s] - q_len + i (causal limit).
//   block_tables (S, W) int64: block ids of s, only the first ceil(seq_len / block_size) read.
//
// Work split and loop order
//   A work item is (sequence, kv head, tile of up to 64 / G query tokens), G the GQA group:
//   the query heads that share a kv head are processed together, a tile holding tokens x G
//   rows, so each K/V tile loaded from memory serves all of them. Items are sorted by
//   decreasing cost (keys x rows) and handed out through an atomic counter inside one
//   at::parallel_for region (costs differ a lot: a decode row against 2k keys vs. a chunk's
//   first tile), so threads finish together.
//   Per item: the scaled query rows are copied into a local tile (M x D); then for each group
//   of up to 4 KV blocks (kGroupBlocks) up to the tile's last causal position:
//     1. S = Q K^T for each block of the group (M x block_size): rows in register groups (up
//        to 8 rows x block_size keys of accumulators), one key row loaded per d for the group;
//     2. one online-softmax update per row over the group's keys: running max m and sum l,
//        P = exp(S - m_new) (vector exp for float32), causal and sequence-end masking by a
//        per-row key limit, the accumulator rescaled only when m grows;
//     3. acc += P V (M x D) block by block: accumulators in registers, 8 vectors of a row at
//        a time, three rows sharing each V load where 32 vector registers exist (AVX-512).
//   Finally out = acc / l. Memory traffic per item: each K/V tile of the sequence read once.
//   Vectors are isa/vec.h's (GCC vector extensions, -O3 -march=native): 64 bytes with AVX-512
//   (on a Zen 5: decode rows 1.5x and a 512-token chunk 2.3x faster than 32-byte ones; an
//   Intel Xeon measured them no faster, earlier), 32 bytes with AVX2 + FMA. Head dims 64/128
//   with block sizes 16/32 are compiled with constant trip counts; other shapes run scalar
//   loops with runtime bounds.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ops.h"
#include "isa/vec.h"

namespace conveyor::attention {

namespace {

using namespace conveyor::vec;

constexpr float kFp8Max = 448.0f;  // the largest finite fp8 e4m3 value

struct Shape {
  int64_t block_size;
  int64_t head_dim;
};

// One vector of T from kLanes<T> cache values of type C: the cache type is T itself, or a
// 16-bit float (float32 models only) widened exactly on the way in.
template <typename T, typename C>
inline Vec<T> load_cache(const C* p) {
  if constexpr (std::is_same_v<T, C>) {
    return load(p);
  } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
    static_assert(std::is_same_v<T, float>, "a bfloat16 cache is read by float32 models only");
#if defined(__AVX2__) && kVecBytesIs32
    __m128i h;
    std::memcpy(&h, p, sizeof(h));
    // bf16 is float's top half: zero-extend each lane to 32 bits and shift it up.
    return (Vec<T>)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    typedef uint16_t Bits16 __attribute__((vector_size(kVecBytes / 2)));
    typedef uint32_t Bits32 __attribute__((vector_size(kVecBytes)));
    Bits16 h;
    std::memcpy(&h, p, sizeof(h));
    const Bits32 bits = __builtin_convertvector(h, Bits32) << 16;
    return reinterpret_cast<const Vec<T>&>(bits);
#endif
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    static_assert(std::is_same_v<T, float>, "an fp8 cache is read by float32 models only");
#if defined(__F16C__) && defined(__AVX2__) && kVecBytesIs32
    // e4m3 (bias 7) moved into float16's bit positions (bias 15) is the value times 2^-8, for
    // normal and subnormal codes alike: F16C widens it (no slow denormal path, unlike the same
    // trick in float32) and one multiply restores the scale. NaN codes are never written.
    __m128i b;
    std::memcpy(&b, p, 8);
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
    return (Vec<T>)_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
#elif defined(__AVX512F__)
    __m128i b;
    std::memcpy(&b, p, 16);
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i h =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    return (Vec<T>)_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
#else
    Vec<T> v;
    for (int i = 0; i < kLanes<T>; ++i) v[i] = static_cast<float>(p[i]);
    return v;
#endif
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<C, c10::Half>,
                  "a float16 cache is read by float32 models only");
#if defined(__F16C__) && kVecBytesIs32
    __m128i h;
    std::memcpy(&h, p, sizeof(h));
    return (Vec<T>)_mm256_cvtph_ps(h);
#elif defined(__AVX512F__)
    __m256i h;
    std::memcpy(&h, p, sizeof(h));
    return (Vec<T>)_mm512_cvtph_ps(h);
#else
    Vec<T> v;
    for (int i = 0; i < kLanes<T>; ++i) v[i] = static_cast<float>(p[i]);
    return v;
#endif
  }
}

// Asks the lines of one tile into L2 (prefetcht2 on x86), ahead of its use. Inline assembly,
// not __builtin_prefetch: GCC 12 deleted the builtin from the specialised loops this kernel had
// it in (no prefetch instruction was left in any decode row's Q K^T or P V), silently.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

inline void prefetch_tile(const void* tile, int lines) {
  const char* p = static_cast<const char*>(tile);
  for (int i = 0; i < lines; ++i) prefetch_line(p + i * 64);
}

constexpr int kScoreSplit = 2;  // partial sums of a score (qk_rows)

// Out of line, like pv_rows: inlined into run_item, GCC 12 kept their accumulator arrays in
// memory and stored every one of them at each step of the loop (16 vector stores per 16 FMAs
// in Q K^T), which bound the loops; a call per register group costs nothing beside them.
// Multi-row items (a prompt chunk's float32 rows, a verification's 1 + k rows) 1.4-1.5x faster
// on a Zen 4; decode rows (bound by reading the cache) the same.
#define CONVEYOR_OUT_OF_LINE __attribute__((noinline))

// S[r][j] = sum_d q[r][d] * kt[d][j] for R rows; kt is one (head_dim, block_size) key tile.
// PF: the lines of `next` (a tile read later) are prefetched a few per step of the loop over d,
// rather than in one burst before it (see kPrefetchBlocks).
template <typename T, typename C, int R, int BS, int D, bool PF = false>
CONVEYOR_OUT_OF_LINE void qk_rows(const T* __restrict q, const C* __restrict kt,
                                  T* __restrict s, Shape sh, const C* next = nullptr) {
  if constexpr (BS != 0) {
    constexpr int NV = BS / kLanes<T>;
    // Two independent partial sums over d (even and odd d), added at the end: a decode row's
    // GQA group alone then keeps twice the FMA chains in flight. The split is the same for
    // every row count, so a row's score has one order whether it decodes alone or sits in a
    // prompt chunk's tile (a split chosen by the group's size made those differ in the last
    // bits, and a cache hit then changed a greedy answer).
    constexpr int SPLIT = kScoreSplit;
    static_assert(SPLIT == 2 && D % SPLIT == 0, "two partial sums, over even and odd d");
    // Two arrays, not one of [SPLIT]: GCC 12 held a [2][R][NV] array in memory and stored all
    // of it at every step of the loop over d (R = 3, decode rows), even out of line.
    Vec<T> even[R][NV], odd[R][NV];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) even[r][i] = odd[r][i] = Vec<T>{};
    for (int d = 0; d < D; d += SPLIT) {
      if constexpr (PF) {
        constexpr int kLines = BS * D * sizeof(C) / 64, kSteps = D / SPLIT;
        for (int l = d / SPLIT * kLines / kSteps; l < (d / SPLIT + 1) * kLines / kSteps; ++l)
          prefetch_line(reinterpret_cast<const char*>(next) + l * 64);
      }
      Vec<T> ke[NV], ko[NV];
      for (int i = 0; i < NV; ++i) {
        ke[i] = load_cache<T>(kt + d * BS + i * kLanes<T>);
        ko[i] = load_cache<T>(kt + (d + 1) * BS + i * kLanes<T>);
      }
      for (int r = 0; r < R; ++r) {
        const Vec<T> qe = broadcast(q[r * D + d]), qo = broadcast(q[r * D + d + 1]);
        // Fused in every instantiation (isa/vec.h: fmadd); the two partial sums keep enough
        // chains in flight for it (split, as in pv_rows, cost decode rows ~8% here).
        for (int i = 0; i < NV; ++i) {
          even[r][i] = fmadd<T>(qe, ke[i], even[r][i]);
          odd[r][i] = fmadd<T>(qo, ko[i], odd[r][i]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) store(s + r * BS + i * kLanes<T>, even[r][i] + odd[r][i]);
  } else {
    const int bs = static_cast<int>(sh.block_size);
    const int dim = static_cast<int>(sh.head_dim);
    for (int r = 0; r < R; ++r) {
      T* srow = s + r * bs;
      for (int j = 0; j < bs; ++j) srow[j] = 0;
      for (int d = 0; d < dim; ++d) {
        const T qv = q[r * dim + d];
        const C* krow = kt + d * bs;
        for (int j = 0; j < bs; ++j) srow[j] += qv * static_cast<T>(krow[j]);
      }
    }
  }
}

// Rows per register group: accumulators (R x BS / lanes x kScoreSplit vectors) plus key rows
// fit the vector registers.
template <typename T, int BS>
constexpr int kRowGroup =
    BS == 0 ? 4 : std::max(1, std::min(8, (kRegisters - 4) / (kScoreSplit * BS / kLanes<T>)));

template <typename T, typename C, int BS, int D, int R, bool PF = false>
inline void qk_tail(const T* q, const C* kt, T* s, int rows, Shape sh, const C* next = nullptr) {
  if constexpr (R > 0) {
    if (rows == R) return qk_rows<T, C, R, BS, D, PF>(q, kt, s, sh, next);
    return qk_tail<T, C, BS, D, R - 1, PF>(q, kt, s, rows, sh, next);
  }
}

// S = Q K^T for all rows.
// PF: the first register group prefetches the tile `next` as it goes (qk_rows).
template <typename T, typename C, int BS, int D, bool PF = false>
inline void qk_block(const T* q, const C* kt, T* s, int rows, Shape sh, const C* next = nullptr) {
  const int dim = D ? D : static_cast<int>(sh.head_dim);
  const int bs = BS ? BS : static_cast<int>(sh.block_size);
  constexpr int G = kRowGroup<T, BS>;
  int r = 0;
  if constexpr (PF) {
    if (rows < G) return qk_tail<T, C, BS, D, G - 1, true>(q, kt, s, rows, sh, next);
    qk_rows<T, C, G, BS, D, true>(q, kt, s, sh, next);
    r = G;
  }
  for (; r + G <= rows; r += G) qk_rows<T, C, G, BS, D>(q + r * dim, kt, s + r * bs, sh);
  if (r < rows) qk_tail<T, C, BS, D, G - 1>(q + r * dim, kt, s + r * bs, rows - r, sh);
}

// acc[r][:] += sum_{j < n} p[r][j] * v[j][:] for RP rows at once (each V row loaded once for
// them); the accumulators stay in registers, 8 vectors of each row at a time.
// PF: the lines of `next` are prefetched a few per key (D * sizeof(C) bytes each), as qk_rows.
template <typename T, typename C, int D, int RP, bool PF = false>
CONVEYOR_OUT_OF_LINE void pv_rows(const T* __restrict p, int bs, const C* __restrict v,
                                  T* __restrict acc, int n, const C* next = nullptr) {
  constexpr int L = kLanes<T>;
  constexpr int NV = D / L;
  // Up to 8 vectors of a row at a time, a divisor of NV (latent attention's 576 float32
  // values are 36 vectors: 6 at a time). Each value's sum over the keys is the same chain
  // whatever the grouping.
  constexpr int NC = NV % 8 == 0 ? 8 : NV % 6 == 0 ? 6 : NV % 4 == 0 ? 4 : NV < 8 ? NV : 1;
  static_assert(NV % NC == 0, "pv_rows: groups of whole vectors");
  for (int c0 = 0; c0 < NV; c0 += NC) {
    Vec<T> a[RP][NC];
    for (int r = 0; r < RP; ++r)
      for (int i = 0; i < NC; ++i) a[r][i] = load(acc + r * D + (c0 + i) * L);
    for (int j = 0; j < n; ++j) {
      if constexpr (PF) {
        constexpr int kLinesPerKey = (D * sizeof(C) + 63) / 64;
        if (c0 == 0)
          for (int l = 0; l < kLinesPerKey; ++l)
            prefetch_line(reinterpret_cast<const char*>(next) + (j * kLinesPerKey + l) * 64);
      }
      Vec<T> pb[RP];
      for (int r = 0; r < RP; ++r) pb[r] = broadcast(p[r * bs + j]);
      const C* vrow = v + j * D + c0 * L;
      for (int i = 0; i < NC; ++i) {
        const Vec<T> vi = load_cache<T>(vrow + i * L);
        // One fixed form in every instantiation (isa/vec.h: madd).
        for (int r = 0; r < RP; ++r) a[r][i] = madd<T>(pb[r], vi, a[r][i]);
      }
    }
    for (int r = 0; r < RP; ++r)
      for (int i = 0; i < NC; ++i) store(acc + r * D + (c0 + i) * L, a[r][i]);
  }
}

// acc += P V for all rows; v is one (block_size, head_dim) tile. Rows in threes where the
// registers allow it (AVX-512 machines have 32 of them for 32-byte vectors).
template <typename T, typename C, int BS, int D, bool PF = false>
inline void pv_block(const T* __restrict p, const C* __restrict v, T* __restrict acc, int rows,
                     int n, Shape sh, const C* next = nullptr) {
  const int bs = BS ? BS : static_cast<int>(sh.block_size);
  if constexpr (D != 0) {
    // Rows in threes with 32 registers (24 accumulators: a decode row's GQA group of 3 in one
    // pass over V), else one at a time; then the rest.
    constexpr int RP = kRegisters >= 32 ? 3 : 1;
    if (n <= 0) return;
    int r = 0;
    if constexpr (PF) {  // the first call prefetches `next` (pv_rows)
      if (rows >= RP) {
        pv_rows<T, C, D, RP, true>(p, bs, v, acc, n, next);
      } else if (rows == 2) {
        pv_rows<T, C, D, 2, true>(p, bs, v, acc, n, next);
      } else {
        pv_rows<T, C, D, 1, true>(p, bs, v, acc, n, next);
      }
      r = std::min(rows, RP >= 2 && rows == 2 ? 2 : RP);
    }
    for (; r + RP <= rows; r += RP) pv_rows<T, C, D, RP>(p + r * bs, bs, v, acc + r * D, n);
    if (RP == 3 && r + 2 <= rows) {
      pv_rows<T, C, D, 2>(p + r * bs, bs, v, acc + r * D, n);
      r += 2;
    }
    for (; r < rows; ++r) pv_rows<T, C, D, 1>(p + r * bs, bs, v, acc + r * D, n);
  } else {
    const int dim = static_cast<int>(sh.head_dim);
    for (int r = 0; r < rows; ++r) {
      T* arow = acc + r * dim;
      const T* prow = p + r * bs;
      for (int j = 0; j < n; ++j) {
        const T pj = prow[j];
        const C* vrow = v + j * dim;
        for (int d = 0; d < dim; ++d) arow[d] += pj * static_cast<T>(vrow[d]);
      }
    }
  }
}

struct WorkItem {
  int64_t seq;
  int64_t first_token;  // first query token of the tile, relative to the sequence's rows
  int64_t num_tokens;
  int64_t kv_head;
  int64_t cost;
  // A decode row's keys may be split into parts (see split_keys): this item reads blocks
  // [block_begin, block_end) and leaves its softmax state in partial slot `partial`; -1: all
  // blocks, and the item writes the output itself.
  int64_t block_begin = 0, block_end = -1, partial = -1;
};

// Softmax state of a part of a split decode row group: per row m, l and acc (head_dim).
template <typename T>
struct Partials {
  int64_t rows, dim;
  std::vector<T> data;
  T* slot(int64_t i) { return data.data() + i * rows * (2 + dim); }
};

// Blocks whose scores go through one online-softmax update: each row's running max, its
// rescaling and the horizontal max and sum of its weights then come once per 64 keys instead
// of once per 16 (30 layers of 32 decode rows x 512 keys from L3: ~4 ms of ~28 in the softmax,
// 28 -> 26.5 ms with the groups).
constexpr int kGroupBlocks = 4;

template <typename T>
struct Scratch {
  std::vector<T> q, s, acc, m, l;
  std::vector<T> k, v;  // the group's K/V tiles widened from a 16-bit cache (many-row items)
  // Per block of the group and row: the keys of the block it may see are [low, limit).
  std::vector<int> limit, low;
  explicit Scratch(int64_t rows, Shape sh)
      : q(rows * sh.head_dim), s(kGroupBlocks * rows * sh.block_size), acc(rows * sh.head_dim),
        m(rows), l(rows), k(kGroupBlocks * sh.block_size * sh.head_dim),
        v(kGroupBlocks * sh.block_size * sh.head_dim), limit(kGroupBlocks * rows),
        low(kGroupBlocks * rows) {}
};

// Rows from which a 16-bit tile is widened once into scratch rather than at every load: a
// prompt tile's rows reload each V vector (one or two FMAs per load), decode rows (a GQA group)
// read it about once. Below it the tiles are also prefetched (run_item). Speculative
// verifications sit between the two: 1 + k tokens times the GQA group, 9-27 rows an item for
// SmolLM2 at k = 8. With the threshold at 8 they were widened, and the widening pass stalled on
// every tile's first touch; at 32 they read the tiles in place, prefetched (Zen 4, 30 layers
// with their own float16 caches, 2 threads, ranges over 2-6 runs of best-of-20): one
// sequence's 9 rows at 400 tokens 2.6-2.7 -> 2.4-2.7 ms, 8 sequences' 9 rows 20-22 -> 17-19 ms,
// 4 sequences' 5 rows 4.4-5.0 -> 3.7-4.0 ms; 64 decode rows and a 512-token prompt unchanged
// within noise, a 32-token float32 chunk (tiles of 33 and 30 rows) 6.2-6.5 -> 6.4-6.7 ms.
// Bits unchanged: widening converts exactly, and the loops' order does not depend on it.
// With 16 registers (AVX2) Q K^T takes 3 rows a pass, so a 9-row item converted each key tile
// three times in place: 8 stays (the AVX2 build run on the same Zen 4: one sequence's 9 rows
// 2.9-3.1 -> 3.2-3.3 ms at 32).
constexpr int kWidenRows = kRegisters >= 32 ? 32 : 8;

template <typename T, typename C>
inline void widen(const C* src, T* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes<T> <= n; i += kLanes<T>) store(dst + i, load_cache<T>(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

struct Inputs {
  const int64_t* query_start;
  const int64_t* seq_lens;
  const int64_t* block_tables;
  int64_t table_width;
  int64_t num_heads, num_kv_heads;
  int64_t q_strides[3];
  double scale;
  bool split_keys;  // may split a step's few decode rows by key blocks (split_keys below)
  // Per sequence, its leading rows that are prompt tokens on the tile route
  // (attention/amx_attention.cpp computes them; this kernel the rest); nullptr: none.
  const int64_t* prompt_tokens = nullptr;
  // Sliding-window attention: a row at position p sees keys (p - window, p], as transformers'
  // sliding_window_overlay; 0: every earlier key.
  int64_t window = 0;
  // Soft-capped scores (Gemma 2): s -> tanh(s / softcap) * softcap before the softmax; 0: none.
  double softcap = 0;
  // Attention sinks (GPT-OSS): per query head a logit that joins each row's softmax and has no
  // value: a row's weights sum to l / (l + exp(sink - m)); nullptr: none.
  const double* sinks = nullptr;
};

// The softmax's denominator of a row of query head `head` whose scores have max m and sum of
// exp(s - m) l: l, plus the head's sink.
template <typename T>
inline T denominator(const Inputs& in, int64_t head, T m, T l) {
  return in.sinks ? l + std::exp(static_cast<T>(in.sinks[head]) - m) : l;
}


// Online softmax over a group of nb blocks for every row. Block i's scores are the sub-buffer
// s + i * rows * block_size (rows x block_size) and become its weights P; row r may see keys
// [low[i * rows + r], limit[i * rows + r]) of block i (an empty range: none). A group in which
// a row sees no key leaves its state (m, l, acc) as it was, bit for bit.
template <typename T, int BS>
inline void softmax_group(T* s, const int* limit, const int* low, int nb, Scratch<T>& w,
                          int rows, Shape sh) {
  const int bs = BS ? BS : static_cast<int>(sh.block_size);
  const int dim = static_cast<int>(sh.head_dim);
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  for (int r = 0; r < rows; ++r) {
    const T m_old = w.m[r];
    T m_new = m_old;
    T sum = 0;
    if constexpr (BS != 0 && BS % kLanes<T> == 0) {
      constexpr int L = kLanes<T>, NV = BS / L;
      Vec<T> iota;
      for (int i = 0; i < L; ++i) iota[i] = static_cast<T>(i);
      Vec<T> mx = broadcast(kNegInf);
      for (int b = 0; b < nb; ++b) {  // masked keys become -inf; the max over the group
        T* srow = s + (b * rows + r) * BS;
        const T n = static_cast<T>(limit[b * rows + r]);
        const T lo = static_cast<T>(low[b * rows + r]);
        for (int i = 0; i < NV; ++i) {
          Vec<T> x = load(srow + i * L);
          const Vec<T> key = iota + static_cast<T>(i * L);
          x = (key < n) & (key >= lo) ? x : broadcast(kNegInf);
          store(srow + i * L, x);
          mx = mx > x ? mx : x;
        }
      }
      for (int i = 0; i < L; ++i) m_new = mx[i] > m_new ? mx[i] : m_new;
      if (m_new == kNegInf) {  // no visible key in the group (a fully masked row)
        for (int b = 0; b < nb; ++b) std::fill_n(s + (b * rows + r) * BS, BS, T(0));
        continue;
      }
      Vec<T> total = {};
      for (int b = 0; b < nb; ++b) {
        T* srow = s + (b * rows + r) * BS;
        for (int i = 0; i < NV; ++i) {
          const Vec<T> x = load(srow + i * L);
          Vec<T> p = vexp<T>(x - m_new);
          p = x == kNegInf ? Vec<T>{} : p;  // masked keys weigh exactly 0
          store(srow + i * L, p);
          total += p;
        }
      }
      for (int i = 0; i < L; ++i) sum += total[i];
    } else {
      for (int b = 0; b < nb; ++b) {
        const T* srow = s + (b * rows + r) * bs;
        const int n = limit[b * rows + r];
        for (int j = std::max(low[b * rows + r], 0); j < n; ++j)
          m_new = srow[j] > m_new ? srow[j] : m_new;
      }
      if (m_new == kNegInf) {
        for (int b = 0; b < nb; ++b) std::fill_n(s + (b * rows + r) * bs, bs, T(0));
        continue;
      }
      for (int b = 0; b < nb; ++b) {
        T* srow = s + (b * rows + r) * bs;
        const int n = limit[b * rows + r], lo = low[b * rows + r];
        for (int j = 0; j < bs; ++j) {
          const T p = j < n && j >= lo ? std::exp(srow[j] - m_new) : T(0);
          srow[j] = p;
          sum += p;
        }
      }
    }
    if (m_new != m_old) {
      const T alpha = m_old == kNegInf ? T(0) : std::exp(m_old - m_new);
      T* arow = w.acc.data() + r * dim;
      for (int d = 0; d < dim; ++d) arow[d] *= alpha;
      w.l[r] *= alpha;
      w.m[r] = m_new;
    }
    w.l[r] += sum;
  }
}

// s -> tanh(s / cap) * cap over n scores, as transformers' eager attention soft-caps them.
// float32 in vectors: tanh(u) = 1 - 2 / (e^2|u| + 1) with u's sign, and its odd Taylor series
// below |u| = 1/8 (where the first form cancels; the series' first omitted term is < 3e-10):
// within ~1e-7 of std::tanh (a score near 50 is 4e-6 apart from its float32 neighbours), and
// the scalar loop's cost off Gemma 2's prompt chunks. float64 (the equivalence tests) keeps
// std::tanh.
template <typename T>
void soft_cap(T* s, int64_t n, T cap) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + kLanes<float> <= n; i += kLanes<float>) {
      const Vec<float> u = load(s + i) / cap;
      const Vec<float> a = u < 0.0f ? -u : u;
      const Vec<float> far = 1.0f - 2.0f / (vexp<float>(a + a) + 1.0f);
      const Vec<float> u2 = u * u;
      const Vec<float> near =
          u * (1.0f + u2 * (-1.0f / 3 + u2 * (2.0f / 15 + u2 * (-17.0f / 315))));
      const Vec<float> t = a < 0.125f ? near : (u < 0.0f ? -far : far);
      store(s + i, t * cap);
    }
  }
  for (; i < n; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

// Tiles sit at scattered places (a block table is any list of block ids), so the hardware
// prefetcher, which follows a stream within a 4 KiB page, starts every tile cold. The K and V
// tiles kPrefetchBlocks blocks ahead are asked into L2 while a block's Q K^T and P V run (the
// first ones of an item all at once before it). Only for items of fewer than kWidenRows rows
// (decode rows, verifications), which are bound by reading the cache: a many-row item computes
// long enough on each tile for the hardware to keep up. Measured on a Zen 4 (2 threads,
// SmolLM2's heads, float16 cache, 30 layers each with its own cache): 64 decode rows at 256
// tokens 30-34 -> 18-21 ms, 8 decode rows 4.1 -> 2.1 ms, with no prefetch at all against bursts
// of whole tiles before each block.
constexpr int64_t kPrefetchBlocks = 2;
// Whether the tiles ahead are prefetched a few lines per step inside Q K^T and P V (the shapes
// compiled with constant trip counts; in instantiations of their own, PF, so that the many-row
// items' loops hold no prefetch: an asm statement there cost them up to 1.6x through worse
// register allocation) rather than in one burst before each block. On a Zen 3 (float16 cache,
// 1-128 decode rows x 300-2048 tokens from memory, each build in its own process) the spread
// lines ran 1.04-1.26x faster than the bursts, the same bits.
template <int BS, int D>
constexpr bool kSpreadPrefetch = BS != 0 && D != 0;

template <typename T, typename C, int BS, int D>
void run_item(const WorkItem& item, const Inputs& in, const T* qp, const C* kc, const C* vc,
              T* out, Scratch<T>& w, Partials<T>& partials, Shape sh) {
  const int bs = static_cast<int>(sh.block_size);
  const int dim = static_cast<int>(sh.head_dim);
  const int64_t group = in.num_heads / in.num_kv_heads;
  const int rows = static_cast<int>(item.num_tokens * group);
  const int64_t row0 = in.query_start[item.seq] + item.first_token;
  const int64_t q_len = in.query_start[item.seq + 1] - in.query_start[item.seq];
  const int64_t seq_len = in.seq_lens[item.seq];
  const int64_t pos0 = seq_len - q_len + item.first_token;  // position of the tile's first token
  const T scale = static_cast<T>(in.scale);

  // Row r = token * group + g.
  for (int64_t t = 0; t < item.num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const T* src = qp + (row0 + t) * in.q_strides[0] +
                     (item.kv_head * group + g) * in.q_strides[1];
      T* dst = w.q.data() + (t * group + g) * dim;
      for (int d = 0; d < dim; ++d) dst[d] = src[d * in.q_strides[2]] * scale;
    }
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows * dim, T(0));
  std::fill(w.m.begin(), w.m.begin() + rows, -std::numeric_limits<T>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows, T(0));

  const int64_t num_keys = pos0 + item.num_tokens;  // keys the tile's last token sees
  const int64_t* table = in.block_tables + item.seq * in.table_width;
  const int64_t tile = sh.block_size * sh.head_dim;
  const int tile_lines = static_cast<int>((tile * static_cast<int64_t>(sizeof(C)) + 63) / 64);
  int* limit = w.limit.data();
  int* low = w.low.data();
  const int64_t block_end = item.block_end >= 0 ? item.block_end : (num_keys + bs - 1) / bs;
  // With a window, the blocks before the tile's first row's window are skipped, from a multiple
  // of kGroupBlocks: a row's softmax groups are then the same blocks in any tile (a group it
  // sees nothing of leaves it unchanged), so its result does not depend on the tile.
  const int64_t first_key = in.window > 0 ? std::max<int64_t>(0, pos0 - in.window + 1) : 0;
  const int64_t block_begin =
      std::max(item.block_begin, first_key / bs / kGroupBlocks * kGroupBlocks);
  const bool widened = !std::is_same_v<T, C> && rows >= kWidenRows;
  const bool stream = rows < kWidenRows;  // few rows: prefetch the tiles ahead (see above)
  for (int64_t b0 = block_begin; b0 < block_end; b0 += kGroupBlocks) {
    const int nb = static_cast<int>(std::min<int64_t>(kGroupBlocks, block_end - b0));
    int n[kGroupBlocks];  // keys in each block (the last block of a sequence may be partial)
    int64_t offsets[kGroupBlocks];  // each block's K (and V) tile in its half of the cache
    // The tiles kPrefetchBlocks blocks ahead of each block of the group (nullptr: none).
    const C* k_next[kGroupBlocks] = {};
    const C* v_next[kGroupBlocks] = {};
    for (int i = 0; i < nb; ++i) {
      const int64_t b = b0 + i, base = b * bs;
      const int64_t offset = offsets[i] = (table[b] * in.num_kv_heads + item.kv_head) * tile;
      if (b == block_begin) {
        for (int64_t a = b; a < std::min(b + kPrefetchBlocks, block_end); ++a) {
          const int64_t first = (table[a] * in.num_kv_heads + item.kv_head) * tile;
          prefetch_tile(kc + first, tile_lines);
          prefetch_tile(vc + first, tile_lines);
        }
      }
      if (stream && b + kPrefetchBlocks < block_end) {
        const int64_t ahead = (table[b + kPrefetchBlocks] * in.num_kv_heads + item.kv_head) * tile;
        k_next[i] = kc + ahead;
        v_next[i] = vc + ahead;
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t visible = pos0 + r / group + 1 - base;  // keys [base, pos] are visible
        limit[i * rows + r] = static_cast<int>(std::clamp<int64_t>(visible, 0, bs));
        const int64_t hidden = in.window > 0 ? visible - in.window : 0;  // keys before the window
        low[i * rows + r] = static_cast<int>(std::clamp<int64_t>(hidden, 0, bs));
      }
      n[i] = static_cast<int>(std::min<int64_t>(num_keys - base, bs));
      T* si = w.s.data() + i * rows * bs;
      if (widened) {
        widen(kc + offset, w.k.data() + i * tile, tile);
        widen(vc + offset, w.v.data() + i * tile, tile);
        qk_block<T, T, BS, D>(w.q.data(), w.k.data() + i * tile, si, rows, sh);
      } else {
        if (k_next[i] && kSpreadPrefetch<BS, D>)
          qk_block<T, C, BS, D, true>(w.q.data(), kc + offset, si, rows, sh, k_next[i]);
        else if (k_next[i])
          prefetch_tile(k_next[i], tile_lines);
        if (!k_next[i] || !kSpreadPrefetch<BS, D>)
          qk_block<T, C, BS, D>(w.q.data(), kc + offset, si, rows, sh);
      }
      if (in.softcap > 0) soft_cap(si, rows * bs, static_cast<T>(in.softcap));
    }
    softmax_group<T, BS>(w.s.data(), limit, low, nb, w, rows, sh);
    for (int i = 0; i < nb; ++i) {
      const T* si = w.s.data() + i * rows * bs;
      if (widened) {
        pv_block<T, T, BS, D>(si, w.v.data() + i * tile, w.acc.data(), rows, n[i], sh);
      } else {
        if (v_next[i] && kSpreadPrefetch<BS, D> && n[i] == bs) {
          pv_block<T, C, BS, D, true>(si, vc + offsets[i], w.acc.data(), rows, n[i], sh,
                                      v_next[i]);
        } else {
          if (v_next[i]) prefetch_tile(v_next[i], tile_lines);
          pv_block<T, C, BS, D>(si, vc + offsets[i], w.acc.data(), rows, n[i], sh);
        }
      }
    }
  }

  if (item.partial >= 0) {  // rows (m, l, acc) for merge_parts
    T* slot = partials.slot(item.partial);
    for (int r = 0; r < rows; ++r) {
      T* row = slot + r * (2 + dim);
      row[0] = w.m[r];
      row[1] = w.l[r];
      std::copy(w.acc.begin() + r * dim, w.acc.begin() + (r + 1) * dim, row + 2);
    }
    return;
  }
  for (int64_t t = 0; t < item.num_tokens; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int r = static_cast<int>(t * group + g);
      const T inv = T(1) / denominator(in, item.kv_head * group + g, w.m[r], w.l[r]);
      const T* arow = w.acc.data() + r * dim;
      T* dst = out + ((row0 + t) * in.num_heads + item.kv_head * group + g) * dim;
      for (int d = 0; d < dim; ++d) dst[d] = arow[d] * inv;
    }
  }
}

std::vector<WorkItem> plan(const Inputs& in, int64_t num_seqs, int64_t tokens_per_tile) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = in.query_start[s + 1] - in.query_start[s];
    const int64_t context = in.seq_lens[s] - q_len;
    const int64_t skip = in.prompt_tokens ? in.prompt_tokens[s] : 0;  // the tiles' rows
    for (int64_t t0 = skip; t0 < q_len; t0 += tokens_per_tile) {
      const int64_t n = std::min(tokens_per_tile, q_len - t0);
      const int64_t cost = (context + t0 + n) * n + 64;
      for (int64_t h = 0; h < in.num_kv_heads; ++h) items.push_back({s, t0, n, h, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

// A step of few items (one or two requests decoding: a few kv heads each) would leave
// threads idle, or one thread with twice another's keys (3 kv heads on 2 threads). Such a
// step's decode items are split by key blocks into parts of at least kMinPartBlocks blocks,
// up to kSplitTarget items in all; each part leaves its softmax state (m, l, acc) and
// merge_parts combines them, as flash-decoding does. The split depends on the step only, not
// on the thread count, so a row's result does too; but it does depend on the step, so a
// batch-invariant model (split_keys false) never splits: a row then sums its keys in one
// order whether it decodes alone, next to others or inside a prompt chunk.
constexpr int64_t kSplitTarget = 8;
constexpr int64_t kMinPartBlocks = 4;

// Returns the number of partial slots used; rewrites split items in place.
int64_t split_keys(std::vector<WorkItem>& items, const Inputs& in, int64_t block_size) {
  const int64_t count = static_cast<int64_t>(items.size());
  if (!in.split_keys || count == 0 || count >= kSplitTarget) return 0;
  const int64_t parts_wanted = (kSplitTarget + count - 1) / count;
  std::vector<WorkItem> split;
  int64_t slots = 0;
  for (const WorkItem& item : items) {
    const int64_t blocks = (in.seq_lens[item.seq] + block_size - 1) / block_size;
    const int64_t parts = std::min(parts_wanted, blocks / kMinPartBlocks);
    if (item.num_tokens != 1 || parts < 2) {
      split.push_back(item);
      continue;
    }
    for (int64_t p = 0; p < parts; ++p) {
      WorkItem part = item;
      part.block_begin = blocks * p / parts;
      part.block_end = blocks * (p + 1) / parts;
      part.cost = item.cost / parts;
      part.partial = slots++;
      split.push_back(part);
    }
  }
  items.swap(split);
  return slots;
}

// out rows of every split item from its parts' softmax states (consecutive slots).
template <typename T>
void merge_parts(const std::vector<WorkItem>& items, const Inputs& in, Partials<T>& partials,
                 T* out) {
  const int64_t group = in.num_heads / in.num_kv_heads, dim = partials.dim;
  for (size_t i = 0; i < items.size();) {
    const WorkItem& first = items[i];
    size_t end = i;
    while (end < items.size() && items[end].partial >= 0 && items[end].seq == first.seq &&
           items[end].kv_head == first.kv_head)
      ++end;
    if (first.partial < 0) {
      ++i;
      continue;
    }
    const int64_t row0 = in.query_start[first.seq] + first.first_token;
    for (int64_t g = 0; g < group; ++g) {
      T m = -std::numeric_limits<T>::infinity();
      for (size_t j = i; j < end; ++j) m = std::max(m, partials.slot(items[j].partial)[g * (2 + dim)]);
      T l = 0;
      T* dst = out + (row0 * in.num_heads + first.kv_head * group + g) * dim;
      std::fill(dst, dst + dim, T(0));
      for (size_t j = i; j < end; ++j) {
        const T* row = partials.slot(items[j].partial) + g * (2 + dim);
        if (row[1] == T(0)) continue;
        const T weight = std::exp(row[0] - m);
        l += row[1] * weight;
        for (int64_t d = 0; d < dim; ++d) dst[d] += row[2 + d] * weight;
      }
      const T inv = T(1) / denominator(in, first.kv_head * group + g, m, l);
      for (int64_t d = 0; d < dim; ++d) dst[d] *= inv;
    }
    i = end;
  }
}

template <typename T, typename C, int BS, int D>
void attention_impl(const Inputs& in, int64_t num_seqs, const T* qp, const C* kc, const C* vc,
                    T* out, Shape sh) {
  const int64_t group = in.num_heads / in.num_kv_heads;
  // Up to 64 rows (tokens x group) per tile: the tile's Q, S and accumulator stay in L1/L2.
  int64_t tokens_per_tile = std::max<int64_t>(1, 64 / group);
  const int64_t max_rows = tokens_per_tile * group;
  std::vector<WorkItem> items = plan(in, num_seqs, tokens_per_tile);
  // Few items of several tokens each (a one-request verification of 1 + k rows: 3 kv heads,
  // one tile each, on 2 threads) leave a thread idle for a whole item: halve the tiles until
  // there are kSplitTarget items or single tokens. A row's arithmetic does not depend on its
  // tile (each row sums its own keys in the same order in any tile), so results do not change;
  // each tile reads the sequence's K/V again, from cache at these sizes.
  while (static_cast<int64_t>(items.size()) < kSplitTarget && tokens_per_tile > 1) {
    tokens_per_tile = (tokens_per_tile + 1) / 2;
    items = plan(in, num_seqs, tokens_per_tile);
  }
  const int64_t num_slots = split_keys(items, in, sh.block_size);
  Partials<T> partials{group, sh.head_dim, std::vector<T>(num_slots * group * (2 + sh.head_dim))};
  // Parts are handed out by cost like the rest; merge_parts finds each item's parts in order.
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<T> scratch(max_rows, sh);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      run_item<T, C, BS, D>(items[order[i]], in, qp, kc, vc, out, scratch, partials, sh);
    }
  });
  if (num_slots > 0) merge_parts(items, in, partials, out);
}

template <typename T, typename C>
void dispatch_shape(const Inputs& in, int64_t num_seqs, const T* qp, const C* kc, const C* vc,
                    T* out, Shape sh) {
#define CONVEYOR_CASE(BS, D)                                                   \
  if (sh.block_size == BS && sh.head_dim == D) {                             \
    return attention_impl<T, C, BS, D>(in, num_seqs, qp, kc, vc, out, sh); \
  }
  CONVEYOR_CASE(16, 64)
  CONVEYOR_CASE(16, 128)
  CONVEYOR_CASE(32, 64)
  CONVEYOR_CASE(32, 128)
  // Gemma 2 / 3's heads, and Gemma 4's sliding (256) and full (512) layers'
  CONVEYOR_CASE(16, 256)
  CONVEYOR_CASE(32, 256)
  CONVEYOR_CASE(16, 512)
  CONVEYOR_CASE(32, 512)
  // latent attention (model/mla.py): kv_lora_rank 512 + 64 rope dims, DeepSeek-V2 / V3's
  CONVEYOR_CASE(16, 576)
  CONVEYOR_CASE(32, 576)
#undef CONVEYOR_CASE
  attention_impl<T, C, 0, 0>(in, num_seqs, qp, kc, vc, out, sh);
}

// Shapes, and every block the kernel will read inside the cache: a bad table must raise, not
// read out of bounds (O(blocks read), small next to the attention itself).
void check_metadata(const at::Tensor& query_start, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, int64_t block_size, int64_t num_blocks,
                    int64_t num_rows) {
  for (const auto* t : {&query_start, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: metadata must be contiguous int64 CPU tensors");
  }
  const int64_t num_seqs = seq_lens.size(0), width = block_tables.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  query_start.size(0) == num_seqs + 1,
              "paged_attention: block_tables (S, W), seq_lens (S,), query_start (S + 1,)");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_rows,
              "paged_attention: query_start must run from 0 to q.size(0)");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s], needed = (lens[s] + block_size - 1) / block_size;
    TORCH_CHECK(q_len >= 0 && lens[s] >= q_len && needed <= width,
                "paged_attention: sequence ", s, " has ", q_len, " new rows, length ", lens[s],
                " and a table of ", width, " blocks");
    for (int64_t b = 0; b < needed; ++b) {
      const int64_t block = tables[s * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_attention: block id ", block,
                  " outside the cache of ", num_blocks, " blocks");
    }
  }
}

// f(T{}, C{}) for the model dtype T and the cache dtype C: the same floating type, or a 16-bit
// float cache for a float32 model.
template <typename F>
void dispatch_types(at::ScalarType model, at::ScalarType cache, const char* name, F&& f) {
  if (model == at::kFloat && cache == at::kFloat) return f(float{}, float{});
  if (model == at::kDouble && cache == at::kDouble) return f(double{}, double{});
  if (model == at::kFloat && cache == at::kHalf) return f(float{}, c10::Half{});
  if (model == at::kFloat && cache == at::kBFloat16) return f(float{}, c10::BFloat16{});
  if (model == at::kFloat && cache == at::kFloat8_e4m3fn) return f(float{}, c10::Float8_e4m3fn{});
  TORCH_CHECK(false, name, ": cache dtype ", cache, " with model dtype ", model,
              " (supported: the same float32/float64, or a float16/bfloat16/fp8 cache for "
              "float32)");
}

}  // namespace

// Per sequence, how many of its leading rows prompt_rows ([begin, end) pairs, ascending) holds;
// they must be leading rows (a prompt precedes what is generated). Empty: no prompt rows.
static std::vector<int64_t> prompt_counts(const at::Tensor& query_start,
                                          const std::vector<int64_t>& prompt_rows) {
  const int64_t num_seqs = query_start.size(0) - 1;
  const int64_t* qs = query_start.data_ptr<int64_t>();
  TORCH_CHECK(prompt_rows.size() % 2 == 0, "paged_attention: prompt_rows are (begin, end) pairs");
  if (prompt_rows.empty()) return {};
  std::vector<int64_t> counts(num_seqs, 0);
  int64_t s = 0, previous = 0;
  for (size_t i = 0; i < prompt_rows.size(); i += 2) {
    const int64_t begin = prompt_rows[i], end = prompt_rows[i + 1];
    TORCH_CHECK(previous <= begin && begin < end && end <= qs[num_seqs],
                "paged_attention: prompt_rows must be ascending, non-empty ranges of q's rows");
    previous = end;
    for (int64_t row = begin; row < end;) {
      while (qs[s + 1] <= row) ++s;
      TORCH_CHECK(row == qs[s] + counts[s],
                  "paged_attention: a sequence's prompt rows must be its leading rows");
      const int64_t upto = std::min(end, qs[s + 1]);
      counts[s] += upto - row;
      row = upto;
    }
  }
  return counts;
}

std::atomic<bool>& prompt_attention_on() {
  static std::atomic<bool> on{true};
  return on;
}

void set_prompt_attention(bool on) { prompt_attention_on().store(on); }

// Attention of all rows of a step: q (T, H, D) -> out (T, H, D). The step's K/V must already
// be in the cache (write_kv). prompt_rows ([begin, end) pairs): rows that are prompt tokens of
// a model on the prompt route, computed on AMX tiles (attention/amx_attention.cpp).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t block_size,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, bool split_keys,
                           const std::vector<int64_t>& prompt_rows, int64_t window,
                           double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention: window and softcap are >= 0");
  TORCH_CHECK(!sinks || (sinks->dim() == 1 && sinks->size(0) == q.size(1)),
              "paged_attention: sinks (H,), one per query head");
  std::vector<double> sink_values;
  if (sinks) {
    const at::Tensor values = sinks->to(at::kDouble).contiguous();
    sink_values.assign(values.data_ptr<double>(), values.data_ptr<double>() + values.numel());
  }
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && kv_cache.size(0) == 2,
              "paged_attention: q (T, H, D), kv_cache (2, blocks, kv heads, block_size * D)");
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_attention: kv_cache must be contiguous");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = kv_cache.size(2);
  TORCH_CHECK(block_size > 0 && num_heads % num_kv_heads == 0 &&
                  kv_cache.size(3) == block_size * head_dim,
              "paged_attention: head counts or cache tile size do not match");
  check_metadata(query_start, seq_lens, block_tables, block_size, kv_cache.size(1), q.size(0));
  at::Tensor out = at::empty({q.size(0), num_heads, head_dim}, q.options());
  // A plan without the bfloat16 attention keeps prompt rows on this kernel (their projections
  // still take the tiles): the attention tiles' own cost and quality, measured apart. The tiles
  // attend to every earlier key with plain scores: a windowed or soft-capped layer's prompt rows
  // stay here too.
  const bool plain = window == 0 && softcap == 0 && !sinks;
  const std::vector<int64_t> prompt = prompt_attention_on().load() && plain
                                          ? prompt_counts(query_start, prompt_rows)
                                          : std::vector<int64_t>{};
  if (!prompt.empty())
    amx::prompt_attention(q, kv_cache, block_size, query_start, seq_lens, block_tables,
                                   scale, prompt, out);
  const Inputs in{query_start.data_ptr<int64_t>(),
                  seq_lens.data_ptr<int64_t>(),
                  block_tables.data_ptr<int64_t>(),
                  block_tables.size(1),
                  num_heads,
                  num_kv_heads,
                  {q.stride(0), q.stride(1), q.stride(2)},
                  scale,
                  split_keys,
                  prompt.empty() ? nullptr : prompt.data(),
                  window,
                  softcap,
                  sinks ? sink_values.data() : nullptr};
  const Shape sh{block_size, head_dim};
  const int64_t half = kv_cache.stride(0);
  dispatch_types(q.scalar_type(), kv_cache.scalar_type(), "paged_attention", [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    const C* cache = kv_cache.data_ptr<C>();
    dispatch_shape<T, C>(in, seq_lens.size(0), q.data_ptr<T>(), cache, cache + half,
                         out.data_ptr<T>(), sh);
  });
  return out;
}

// A value as the cache stores it. fp8 e4m3 has no infinity and c10's conversion turns what
// exceeds its range into NaN: values are clamped to +-448 first (as the reference path does).
template <typename C, typename T>
inline C to_cache(T value) {
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    return static_cast<C>(std::clamp(static_cast<float>(value), -kFp8Max, kFp8Max));
  } else {
    return static_cast<C>(value);
  }
}

// n values of one row (stride apart) into cache type C, contiguous: to_cache's bits. float32
// to float16 16 (or 8) at a time: F16C's conversion rounds to nearest even, as c10's does.
template <typename T, typename C>
inline void row_to_cache(const T* src, int64_t stride, C* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<C, c10::Half>) {
#if defined(__AVX512F__) || defined(__F16C__)
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif
#if defined(__AVX512F__)
    if (stride == 1)
      for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), kRound));
#elif defined(__F16C__)
    if (stride == 1)
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
#endif
  }
  for (; i < n; ++i) dst[i] = to_cache<C>(src[i * stride]);
}

// Scatter the step's new keys/values (T, Hkv, D), any strides, into their cache slots
// (slot = block * block_size + offset; a negative slot is skipped). A 16-bit cache gets the
// values rounded to nearest even, bit for bit as torch's .to(float16 / bfloat16).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping, int64_t block_size) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && kv_cache.is_contiguous() &&
                  v.scalar_type() == k.scalar_type(),
              "write_kv: k, v (T, Hkv, D) of one dtype; contiguous cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0),
              "write_kv: slot_mapping (T,) int64");
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), dim = k.size(2);
  TORCH_CHECK(kv_cache.size(2) == num_kv_heads && kv_cache.size(3) == block_size * dim,
              "write_kv: cache tile does not match k");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t tile = block_size * dim;
  const int64_t num_slots = kv_cache.size(1) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "write_kv: slot ", slots[t], " outside the cache");
  }
  dispatch_types(k.scalar_type(), kv_cache.scalar_type(), "write_kv", [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    C* kc = kv_cache.data_ptr<C>();
    C* vc = kc + kv_cache.stride(0);
    at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
      std::vector<C> key(dim);  // a key row converted, then written down its tile's column
      for (int64_t t = begin; t < end; ++t) {
        if (slots[t] < 0) continue;
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* ks = kp + t * k.stride(0) + h * k.stride(1);
          const T* vs = vp + t * v.stride(0) + h * v.stride(1);
          C* kt = kc + (block * num_kv_heads + h) * tile + offset;
          C* vt = vc + (block * num_kv_heads + h) * tile + offset * dim;
          row_to_cache(ks, k.stride(2), key.data(), dim);
          for (int64_t d = 0; d < dim; ++d) kt[d * block_size] = key[d];
          row_to_cache(vs, v.stride(2), vt, dim);
        }
      }
    });
  });
}

// Rotary embedding in place, rotate-half (GPT-NeoX) form as transformers' Llama:
// x[:h] <- x[:h] cos[:h] - x[h:] sin[:h],  x[h:] <- x[h:] cos[h:] + x[:h] sin[h:],  h = D / 2.
// q (T, H, D), k (T, Hkv, D) with any strides; cos, sin (T, D) contiguous: the rows of the
// step's positions, gathered once per step.
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_embedding: q (T, H, D), k (T, Hkv, D)");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "rotary_embedding: cos, sin (T, D) contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "rotary_embedding: one dtype for q, k, cos, sin");
  const int64_t num_tokens = q.size(0), dim = q.size(2), half = dim / 2;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    auto rotate = [&](at::Tensor& x, int64_t t) {
      scalar_t* base = x.data_ptr<scalar_t>() + t * x.stride(0);
      const scalar_t* c = cp + t * dim;
      const scalar_t* s = sp + t * dim;
      const int64_t sd = x.stride(2);
      for (int64_t h = 0; h < x.size(1); ++h) {
        scalar_t* row = base + h * x.stride(1);
        int64_t i = 0;
        if (sd == 1) {  // the same expressions on vectors of lanes
          constexpr int L = kLanes<scalar_t>;
          for (; i + L <= half; i += L) {
            const Vec<scalar_t> x1 = load(row + i), x2 = load(row + i + half);
            store(row + i, x1 * load(c + i) - x2 * load(s + i));
            store(row + i + half, x2 * load(c + i + half) + x1 * load(s + i + half));
          }
        }
        for (; i < half; ++i) {
          const scalar_t x1 = row[i * sd], x2 = row[(i + half) * sd];
          row[i * sd] = x1 * c[i] - x2 * s[i];
          row[(i + half) * sd] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    };
    at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(q, t);
        rotate(k, t);
      }
    });
  });
}

// Transparent huge pages for a large tensor not yet touched (Linux, THP in "madvise" mode):
// the KV cache is read tile by tile at scattered places, and with 4 KiB pages nearly every
// tile is a TLB miss (about 3% of a decode step's attention time here). Returns whether the
// advice was taken.
bool advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (start + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (start + t.nbytes()) & ~(kHuge - 1);
  if (last <= first) return false;
  return madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE) == 0;
#else
  return false;
#endif
}

}  // namespace conveyor::attention
