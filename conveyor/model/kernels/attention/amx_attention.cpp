// Attention of a step's prompt rows in bfloat16, float32 sums and softmax: the prompt route's
// attention (model/prompt_route.py says which rows take it; attention/paged_attention.cpp computes
// every other row and calls this for these). A 512-token prompt chunk spent 130-150 ms of its
// ~360-450 in attention with float32 vectors; here S = Q K^T and acc += P V are bfloat16 dot
// products, and what is left is the softmax. Two engines run the same operands in the same layout:
// AMX tiles (TileEngine) where the CPU has AMX-BF16: a tile dot product per 16 x 16 x 32;
// AVX512-BF16's vdpbf16ps (DotEngine) where it has only that (a Zen 4 or 5): 16 float lanes
// each summing a pair of products per instruction, twice float32's FMAs. A tile's row of pairs
// is exactly one such operand (16 keys, or 16 columns, x a pair of k), so the packed K, V and P
// tiles are shared; Q's pair of d is broadcast to the 16 lanes.
//
// First, every group of 64 keys (absolute positions 64g .. 64g + 63) that a step's prompt rows
// read, per (sequence, kv head): K and V widened from the cache (any cache dtype) and rounded to
// bfloat16 tiles in AMX's pair layout, once (KvGroups), over the threads. Then per item
// (sequence, kv head, up to 128 rows: tokens x the GQA group, as attention/paged_attention.cpp):
// Q (scaled) rounded to bfloat16 tiles once; then for each group up to the item's last causal key:
//   1. S = Q K^T: four 16-key score tiles per row tile, the head dim summed in the tile unit;
//   2. per row: the running max over its visible keys, P = e^(S - max) rounded to bfloat16, the
//      sum l of the rounded weights (so the weights applied and the normaliser agree), the
//      accumulator rescaled when the max grows;
//   3. acc += P V in the tile unit, the accumulator loaded from and stored back to float32.
// out = acc / l.
//
// One reduction order per row. Every value a row gets depends on its own query, its position
// and the cache only: the key groups sit at fixed positions, a tile dot product sums each row
// on its own, a row's masked keys weigh exactly 0 and a group it cannot see adds exactly 0. So
// a prompt row gets the same bits whatever chunk, tile, step or thread computes it
// (tests/unit/test_amx_attention.py; tests/equivalence/test_batch_invariance.py end to end).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "ops.h"

#if CONVEYOR_AMX || CONVEYOR_BF16_DOT
#include <immintrin.h>

#include "isa/vec.h"
#endif

namespace conveyor::attention::amx {

#if CONVEYOR_AMX || CONVEYOR_BF16_DOT
namespace {

constexpr int kM = 16;                  // rows of a tile
constexpr int kSubKeys = 16;            // keys of one score tile
constexpr int kGroupKeys = 64;          // keys per online-softmax update
constexpr int kSubs = kGroupKeys / kSubKeys;
constexpr int kTileValues = kM * 32;    // bfloat16 values of one tile (16 rows x 64 bytes)
constexpr int64_t kItemRows = 128;      // rows (tokens x group) per item

// 64-byte aligned scratch of n values.
template <typename V>
struct Aligned {
  V* p;
  explicit Aligned(int64_t n)
      : p(static_cast<V*>(std::aligned_alloc(64, ((n * sizeof(V) + 63) / 64) * 64))) {}
  ~Aligned() { std::free(p); }
  V& operator[](int64_t i) { return p[i]; }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

struct Dims {
  int64_t head_dim, padded;  // padded: head_dim rounded up to 32 (k of a tile row)
  int64_t kc() const { return padded / 32; }  // tiles of Q, and of K per key tile
  int64_t ct() const { return padded / 16; }  // column tiles of V and of the accumulator
};

struct Scratch {
  int64_t rows_p;  // rows padded to whole tiles
  Aligned<uint16_t> q, p;
  Aligned<float> s, acc, m, l;
  std::vector<int64_t> pos;  // each row's position; -1: padding
  Scratch(int64_t max_rows, const Dims& dm)
      : rows_p((max_rows + kM - 1) / kM * kM),
        q(rows_p / kM * dm.kc() * kTileValues),
        p(rows_p / kM * 2 * kTileValues),
        s(kSubs * rows_p * kSubKeys),
        acc(rows_p * dm.padded),
        m(rows_p),
        l(rows_p * kSubKeys),
        pos(rows_p) {}
};

// 16 cache values widened to float32 (exactly).
template <typename C>
inline __m512 load16(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<C, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    alignas(64) float f[16];
    for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
    return _mm512_load_ps(f);
  }
}

// a, b rounded to bfloat16 (nearest even) and interleaved, a0 b0 a1 b1 ..: one tile row of a
// pair-layout operand (row r of a K or V tile holds the pair of k values 2r, 2r + 1).
inline void pair_row(__m512 a, __m512 b, uint16_t* dst) {
  alignas(64) static const uint16_t kOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                  21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low half
  _mm512_store_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), ab));
}

inline __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

struct Item {
  int64_t seq, first_token, num_tokens, kv_head, cost;
};

struct Args {
  const float* q;
  int64_t q_strides[3];
  const int64_t *query_start, *seq_lens, *block_tables;
  int64_t table_width, num_heads, num_kv_heads, block_size;
  float scale;
  float* out;
};

// The keys an item's last token sees: its sequence's context and prompt rows up to it.
inline int64_t item_keys(const Item& item, const Args& a) {
  const int64_t q_len = a.query_start[item.seq + 1] - a.query_start[item.seq];
  return a.seq_lens[item.seq] - q_len + item.first_token + item.num_tokens;
}

// The group's keys [k0, k0 + 64) of kv head h as K tiles (sub-block n, d tile c) at kt and V
// tiles (key half j, column tile c) at vt; keys from `valid` on are zeros.
template <typename C>
void load_group(const C* kc, const C* vc, const int64_t* table, int64_t h, const Args& a,
                const Dims& dm, int64_t k0, int64_t valid, uint16_t* kt, uint16_t* vt) {
  const int64_t bs = a.block_size, dim = dm.head_dim;
  const int64_t tile = bs * dim;  // one (block, kv head) tile of the cache
  const __m512 zero = _mm512_setzero_ps();
  // K: the cache holds each block transposed, (head_dim, block_size): a 16-key row of one d is
  // contiguous when the 16 keys sit in one block (block sizes that are multiples of 16).
  for (int n = 0; n < kSubs; ++n) {
    const int64_t first_key = k0 + n * kSubKeys, keys = std::clamp<int64_t>(valid - n * kSubKeys, 0, 16);
    uint16_t* dst = kt + n * dm.kc() * kTileValues;
    if (keys == 0) {
      std::memset(dst, 0, dm.kc() * kTileValues * sizeof(uint16_t));
      continue;
    }
    const __mmask16 mask = first(keys);
    alignas(64) float gathered[2][16];
    const C* base = nullptr;
    if (bs % kSubKeys == 0)
      base = kc + (table[first_key / bs] * a.num_kv_heads + h) * tile + first_key % bs;
    for (int64_t d = 0; d < dm.padded; d += 2) {
      __m512 rows[2];
      for (int i = 0; i < 2; ++i) {
        if (d + i >= dim) {
          rows[i] = zero;
        } else if (base) {
          rows[i] = _mm512_maskz_mov_ps(mask, load16(base + (d + i) * bs));
        } else {  // any block size: key by key
          for (int j = 0; j < 16; ++j) {
            const int64_t key = first_key + j;
            gathered[i][j] = j < keys ? static_cast<float>(
                                            kc[(table[key / bs] * a.num_kv_heads + h) * tile +
                                               (d + i) * bs + key % bs])
                                      : 0.0f;
          }
          rows[i] = _mm512_load_ps(gathered[i]);
        }
      }
      pair_row(rows[0], rows[1], dst + (d / 32) * kTileValues + (d % 32) / 2 * 32);
    }
  }
  // V: (block_size, head_dim) per block, a key's values contiguous; one block lookup per 16
  // keys where they share a block (a division per key cost as much as the tile products).
  const C* block_rows = nullptr;
  for (int64_t j = 0; j < kGroupKeys; j += 2) {
    const C* row[2];
    if (j % kSubKeys == 0 && bs % kSubKeys == 0) {
      const int64_t key = k0 + j;
      block_rows = vc + (table[key / bs] * a.num_kv_heads + h) * tile + (key % bs) * dim;
    }
    for (int i = 0; i < 2; ++i) {
      const int64_t key = k0 + j + i;
      row[i] = j + i >= valid ? nullptr
               : block_rows   ? block_rows + (j % kSubKeys + i) * dim
                              : vc + (table[key / bs] * a.num_kv_heads + h) * tile + (key % bs) * dim;
    }
    uint16_t* dst = vt + (j / 32) * dm.ct() * kTileValues + (j % 32) / 2 * 32;
    for (int64_t c = 0; c < dm.ct(); ++c) {
      const bool inside = c * 16 < dim;
      pair_row(row[0] && inside ? load16(row[0] + c * 16) : zero,
               row[1] && inside ? load16(row[1] + c * 16) : zero, dst + c * kTileValues);
    }
  }
}

#if CONVEYOR_AMX
// Sum tiles 0..3 <- the four score tiles of row tile mt (zeroed first).
inline void scores(const uint16_t* qt, const uint16_t* kt, int64_t kc_count, float* s,
                   int64_t rows_p) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t sub = kc_count * kTileValues;  // one 16-key sub-block's K tiles
  for (int64_t c = 0; c < kc_count; ++c) {
    _tile_loadd(4, qt + c * kTileValues, 64);
    _tile_loadd(6, kt + c * kTileValues, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, kt + sub + c * kTileValues, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, kt + 2 * sub + c * kTileValues, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, kt + 3 * sub + c * kTileValues, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
  // Score tile n of these rows at s[n][rows][16]: 16 rows x 16 floats.
  const int64_t stride = kSubKeys * sizeof(float), n_stride = rows_p * kSubKeys;
  _tile_stored(0, s, stride);
  _tile_stored(1, s + n_stride, stride);
  _tile_stored(2, s + 2 * n_stride, stride);
  _tile_stored(3, s + 3 * n_stride, stride);
}

// acc[rows of tile mt][columns of N column tiles from c0] += P V over the group's 64 keys.
template <int N>
inline void weighted_values(const uint16_t* pt, const uint16_t* vt, int64_t ct, int64_t c0,
                            float* acc, int64_t padded) {
  static_assert(N == 2 || N == 4, "two or four column tiles at a time");
  const int64_t stride = padded * sizeof(float);
  float* a = acc + c0 * 16;
  _tile_loadd(0, a, stride);
  _tile_loadd(1, a + 16, stride);
  if constexpr (N == 4) {
    _tile_loadd(2, a + 32, stride);
    _tile_loadd(3, a + 48, stride);
  }
  for (int j = 0; j < 2; ++j) {  // keys 32 j .. 32 j + 31
    const uint16_t* v = vt + (j * ct + c0) * kTileValues;
    _tile_loadd(4, pt + j * kTileValues, 64);
    _tile_loadd(6, v, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, v + kTileValues, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (N == 4) {
      _tile_loadd(6, v + 2 * kTileValues, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, v + 3 * kTileValues, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, a, stride);
  _tile_stored(1, a + 16, stride);
  if constexpr (N == 4) {
    _tile_stored(2, a + 32, stride);
    _tile_stored(3, a + 48, stride);
  }
}

struct TileEngine {
  static void begin() { gemm::amx::configure(); }
  static void end() { _tile_release(); }
  static void scores(const uint16_t* qt, const uint16_t* kt, int64_t kc_count, float* s,
                     int64_t rows_p) {
    conveyor::attention::amx::scores(qt, kt, kc_count, s, rows_p);
  }
  static void values(const uint16_t* pt, const uint16_t* vt, int64_t ct, float* acc,
                     int64_t padded) {
    int64_t c0 = 0;
    for (; c0 + 4 <= ct; c0 += 4) weighted_values<4>(pt, vt, ct, c0, acc, padded);
    if (c0 < ct) weighted_values<2>(pt, vt, ct, c0, acc, padded);
  }
};
#endif

// The same products on AVX512-BF16: lane j of vdpbf16ps adds a[2j] b[2j] + a[2j + 1] b[2j + 1]
// to its float32 sum, so one tile row of K (16 keys x a pair of d) or of V (16 columns x a
// pair of keys) is one operand, and the other is a row's pair of Q (or of P) broadcast. Each
// sum runs over the pairs in order, tile after tile, as the tile unit walks them: a row's
// values depend on its own operands only. Rows in groups of kDotRows: 4 x 4 sums and 4
// operands stay in registers.
struct DotEngine {
  static constexpr int kDotRows = 4;
  static void begin() {}
  static void end() {}
  static __m512bh pair(const uint16_t* p) {  // the two bfloat16 at p, in every lane
    int32_t bits;
    std::memcpy(&bits, p, sizeof(bits));
    return (__m512bh)_mm512_set1_epi32(bits);
  }
  static __m512bh row(const uint16_t* p) { return (__m512bh)_mm512_load_si512(p); }

  // acc[i][n] += the products of one tile's 16 pairs: row i of the A operand (a: 16 rows of
  // 32 bfloat16, kDotRows of them from here) against operand row n of b[n] (16 lanes x a pair).
  template <int N>
  static void tile_pairs(__m512 (&acc)[kDotRows][N], const uint16_t* a,
                         const uint16_t* const (&b)[N]) {
    for (int pr = 0; pr < 16; ++pr) {
      __m512bh bv[N];
      for (int n = 0; n < N; ++n) bv[n] = row(b[n] + pr * 32);
      for (int i = 0; i < kDotRows; ++i) {
        const __m512bh av = pair(a + i * 32 + 2 * pr);
        for (int n = 0; n < N; ++n) acc[i][n] = _mm512_dpbf16_ps(acc[i][n], av, bv[n]);
      }
    }
  }

  // s[n][r][16] = the four 16-key score blocks of the tile's 16 rows (s laid out as TileEngine
  // stores them: sub-block n at n * rows_p * 16).
  static void scores(const uint16_t* qt, const uint16_t* kt, int64_t kc_count, float* s,
                     int64_t rows_p) {
    const int64_t sub = kc_count * kTileValues, n_stride = rows_p * kSubKeys;
    for (int r0 = 0; r0 < kM; r0 += kDotRows) {
      __m512 acc[kDotRows][kSubs];
      for (int i = 0; i < kDotRows; ++i)
        for (int n = 0; n < kSubs; ++n) acc[i][n] = _mm512_setzero_ps();
      for (int64_t c = 0; c < kc_count; ++c) {  // d = 32 c .. 32 c + 31
        const uint16_t* k[kSubs];
        for (int n = 0; n < kSubs; ++n) k[n] = kt + n * sub + c * kTileValues;
        tile_pairs<kSubs>(acc, qt + c * kTileValues + r0 * 32, k);
      }
      for (int i = 0; i < kDotRows; ++i)
        for (int n = 0; n < kSubs; ++n)
          _mm512_storeu_ps(s + n * n_stride + (r0 + i) * kSubKeys, acc[i][n]);
    }
  }

  // acc[16 rows][padded] += P V over the group's 64 keys, N column blocks of 16 at a time.
  template <int N>
  static void values_columns(const uint16_t* pt, const uint16_t* vt, int64_t ct, int64_t c0,
                             float* acc, int64_t padded) {
    for (int r0 = 0; r0 < kM; r0 += kDotRows) {
      __m512 a[kDotRows][N];
      for (int i = 0; i < kDotRows; ++i)
        for (int c = 0; c < N; ++c) a[i][c] = _mm512_loadu_ps(acc + (r0 + i) * padded + (c0 + c) * 16);
      for (int j = 0; j < 2; ++j) {  // keys 32 j .. 32 j + 31
        const uint16_t* v[N];
        for (int c = 0; c < N; ++c) v[c] = vt + (j * ct + c0 + c) * kTileValues;
        tile_pairs<N>(a, pt + j * kTileValues + r0 * 32, v);
      }
      for (int i = 0; i < kDotRows; ++i)
        for (int c = 0; c < N; ++c) _mm512_storeu_ps(acc + (r0 + i) * padded + (c0 + c) * 16, a[i][c]);
    }
  }
  static void values(const uint16_t* pt, const uint16_t* vt, int64_t ct, float* acc,
                     int64_t padded) {
    int64_t c0 = 0;
    for (; c0 + 4 <= ct; c0 += 4) values_columns<4>(pt, vt, ct, c0, acc, padded);
    if (c0 < ct) values_columns<2>(pt, vt, ct, c0, acc, padded);  // ct is even (padded / 16)
  }
};

// Every group of keys a step's prompt rows read, as K and V tiles (load_group), converted once
// per (sequence, kv head) and shared by its items. Each item converted its own groups before,
// up to its last key: a 2048-token prompt's 49 items per kv head (42 tokens of a GQA group of 3
// each) converted its first group 49 times. A sequence's groups run to its furthest item's last
// key, so an earlier item's last group holds real keys past its own last one where it held
// zeros: its rows weigh them exactly 0 (softmax_tile), and 0 times a finite cached value adds
// exactly 0, so no bit changes (a value that overflowed a float16 cache to inf already made NaN
// of the rows before it in its own item).
// A 2048-token prompt's attention (benchmarks step): 181-182 -> 154-156 ms; 1024: 56 -> 50-51.
struct KvGroups {
  int64_t kv_heads, k_values, group_values;  // values of a group's K tiles, and of K and V
  std::vector<int64_t> keys;   // per (sequence, kv head): the keys its furthest item sees
  std::vector<int64_t> first;  // per (sequence, kv head): its first group's index
  Aligned<uint16_t> tiles;

  template <typename C>
  KvGroups(const std::vector<Item>& items, const Args& a, const C* kc, const C* vc,
           const Dims& dm)
      : kv_heads(a.num_kv_heads),
        k_values(kSubs * dm.kc() * kTileValues),
        group_values(k_values + 2 * dm.ct() * kTileValues),
        keys(furthest_keys(items, a)),
        first(keys.size()),
        tiles(count_groups() * group_values) {
    // (sequence, kv head, group) per task, every group of every pair
    std::vector<std::array<int64_t, 3>> tasks;
    for (int64_t pair = 0; pair < static_cast<int64_t>(keys.size()); ++pair)
      for (int64_t g = 0; g * kGroupKeys < keys[pair]; ++g)
        tasks.push_back({pair / kv_heads, pair % kv_heads, g});
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const auto [seq, h, g] = tasks[t];
        uint16_t* kt = tiles.p + (first[seq * kv_heads + h] + g) * group_values;
        const int64_t k0 = g * kGroupKeys;
        load_group(kc, vc, a.block_tables + seq * a.table_width, h, a, dm, k0,
                   std::min<int64_t>(keys[seq * kv_heads + h] - k0, kGroupKeys), kt,
                   kt + k_values);
      }
    });
  }
  const uint16_t* k(int64_t seq, int64_t h, int64_t g) const {
    return tiles.p + (first[seq * kv_heads + h] + g) * group_values;
  }

 private:
  // Per (sequence, kv head): the keys its furthest item sees (0: no item).
  std::vector<int64_t> furthest_keys(const std::vector<Item>& items, const Args& a) const {
    int64_t seqs = 0;
    for (const Item& item : items) seqs = std::max(seqs, item.seq + 1);
    std::vector<int64_t> most(seqs * kv_heads, 0);
    for (const Item& item : items) {
      int64_t& k = most[item.seq * kv_heads + item.kv_head];
      k = std::max(k, item_keys(item, a));
    }
    return most;
  }
  // Fills first; the groups in all.
  int64_t count_groups() {
    int64_t total = 0;
    for (size_t pair = 0; pair < keys.size(); ++pair) {
      first[pair] = total;
      total += (keys[pair] + kGroupKeys - 1) / kGroupKeys;
    }
    return total;
  }
};

// e^(s - m) for the 16 scores s of a vector, m its row's running max: as 2^t, t = s log2(e) -
// m log2(e) in one rounding, split into n = round(t) and f = t - n in [-1/2, 1/2], 2^f by its
// degree-5 Taylor polynomial (within 4e-6 of it, ~1/1000 of a bfloat16 ulp, which is where the
// weight is rounded next) and scaled by 2^n in one instruction (vscalefps: exactly 0 far below,
// no clamp or integer arithmetic). 9 instructions against the general vexp's ~19 (isa/vec.h). A
// lane past the row's keys may come out anything; the caller zeroes it.
inline __m512 exp_shifted(__m512 s, __m512 m_log2e) {
  const __m512 t = _mm512_fmsub_ps(s, _mm512_set1_ps(1.44269504088896341f), m_log2e);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.3333558146e-3f);  // ln(2)^i / i!, i = 5 .. 0
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Online softmax of row tile mt's 16 rows over the group [k0, k0 + 64): their P rows into the P
// tiles, m, the sums l and the accumulator rows updated. Keys past a row's position weigh
// exactly 0. In two passes over the rows, so that no row waits on the one before: first each
// row's new max, and the factor alpha = e^(m_old - m_new) of all 16 at once (exactly 1 where the
// max stayed, so the rescale is unconditional and exact there: no branch on the data); then the
// weights. l is kept as 16 lanes of partial sums (w.l, a row's 16 floats), each lane the sum of
// its keys' rounded weights (a pair at a time, vdpbf16ps against 1.0), reduced once at the end.
inline void softmax_tile(int64_t mt, int64_t k0, Scratch& w, const Dims& dm) {
  const int64_t n_stride = w.rows_p * kSubKeys, r0 = mt * kM;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float m_new[kM];
  int64_t visible[kM];
  for (int i = 0; i < kM; ++i) {
    const int64_t r = r0 + i;
    visible[i] = w.pos[r] + 1 - k0;
    m_new[i] = w.m.p[r];
    if (visible[i] <= 0) continue;
    const float* s = w.s.p + r * kSubKeys;
    __m512 mx = neg_inf;
    for (int n = 0; n < kSubs; ++n)
      mx = _mm512_mask_max_ps(mx, first(visible[i] - n * kSubKeys), mx,
                              _mm512_load_ps(s + n * n_stride));
    m_new[i] = std::max(m_new[i], _mm512_reduce_max_ps(mx));
  }
  // e^(m_old - m_new): 1 where the max stayed, ~0 where there was none (-inf, clamped: the
  // row's sums are still 0 then).
  using conveyor::vec::Vec;
  const __m512 m_old = _mm512_load_ps(w.m.p + r0), m_cur = _mm512_load_ps(m_new);
  const __m512 diff = _mm512_sub_ps(m_old, m_cur);
  alignas(64) float alpha[kM];
  const Vec<float> factor = conveyor::vec::vexp<float>(reinterpret_cast<const Vec<float>&>(diff));
  _mm512_store_ps(alpha, reinterpret_cast<const __m512&>(factor));
  _mm512_store_ps(w.m.p + r0, m_cur);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bfloat16 1.0
  for (int i = 0; i < kM; ++i) {
    const int64_t r = r0 + i;
    uint16_t* prow = w.p.p + mt * 2 * kTileValues + i * 32;
    if (visible[i] <= 0) {  // a group past the row (or a padding row): no weight
      std::memset(prow, 0, 64);
      std::memset(prow + kTileValues, 0, 64);
      continue;
    }
    const float* s = w.s.p + r * kSubKeys;
    const __m512 m_log2e = _mm512_set1_ps(m_new[i] * 1.44269504088896341f);
    __m512 total = _mm512_setzero_ps();
    for (int n = 0; n < kSubs; n += 2) {
      const __m512 p0 = _mm512_maskz_mov_ps(first(visible[i] - n * kSubKeys),
                                            exp_shifted(_mm512_load_ps(s + n * n_stride), m_log2e));
      const __m512 p1 =
          _mm512_maskz_mov_ps(first(visible[i] - (n + 1) * kSubKeys),
                              exp_shifted(_mm512_load_ps(s + (n + 1) * n_stride), m_log2e));
      const __m512bh rounded = _mm512_cvtne2ps_pbh(p1, p0);  // keys 32 (n / 2) .. in order
      _mm512_store_si512(prow + (n / 2) * kTileValues, (__m512i)rounded);
      total = _mm512_dpbf16_ps(total, rounded, ones);
    }
    const __m512 av = _mm512_set1_ps(alpha[i]);
    float* arow = w.acc.p + r * dm.padded;
    for (int64_t d = 0; d < dm.padded; d += 16)
      _mm512_store_ps(arow + d, _mm512_mul_ps(_mm512_load_ps(arow + d), av));
    float* lrow = w.l.p + r * kSubKeys;
    _mm512_store_ps(lrow, _mm512_fmadd_ps(_mm512_load_ps(lrow), av, total));
  }
}

template <typename E>
void run_item(const Item& item, const Args& a, const KvGroups& kv, const Dims& dm, Scratch& w) {
  const int64_t group = a.num_heads / a.num_kv_heads, h = item.kv_head;
  const int64_t rows = item.num_tokens * group;
  const int64_t row_tiles = (rows + kM - 1) / kM, rows_p = w.rows_p;
  const int64_t row0 = a.query_start[item.seq] + item.first_token;
  const int64_t q_len = a.query_start[item.seq + 1] - a.query_start[item.seq];
  const int64_t pos0 = a.seq_lens[item.seq] - q_len + item.first_token;
  const int64_t kc_count = dm.kc();

  // Q: row r = token * group + g, scaled, rounded into tiles (row tile, d tile); zeros past.
  std::memset(w.q.p, 0, row_tiles * kc_count * kTileValues * sizeof(uint16_t));
  alignas(64) float qrow[1024];  // head_dim <= 1024 (checked)
  for (int64_t r = 0; r < row_tiles * kM; ++r) {
    w.pos[r] = r < rows ? pos0 + r / group : -1;
    w.m[r] = -std::numeric_limits<float>::infinity();
    std::fill_n(w.l.p + r * kSubKeys, kSubKeys, 0.0f);
    std::fill_n(w.acc.p + r * dm.padded, dm.padded, 0.0f);
    if (r >= rows) continue;
    const float* src = a.q + (row0 + r / group) * a.q_strides[0] +
                       (h * group + r % group) * a.q_strides[1];
    if (a.q_strides[2] == 1) {  // the usual layout: contiguous loads, not a gather
      for (int64_t d = 0; d < dm.head_dim; ++d) qrow[d] = src[d] * a.scale;
      std::fill(qrow + dm.head_dim, qrow + dm.padded, 0.0f);
    } else {
      for (int64_t d = 0; d < dm.padded; ++d)
        qrow[d] = d < dm.head_dim ? src[d * a.q_strides[2]] * a.scale : 0.0f;
    }
    for (int64_t c = 0; c < kc_count; ++c) {
      const __m512bh v =
          _mm512_cvtne2ps_pbh(_mm512_load_ps(qrow + c * 32 + 16), _mm512_load_ps(qrow + c * 32));
      _mm512_store_si512(w.q.p + ((r / kM) * kc_count + c) * kTileValues + (r % kM) * 32,
                         (__m512i)v);
    }
  }

  const int64_t num_keys = item_keys(item, a);
  for (int64_t k0 = 0; k0 < num_keys; k0 += kGroupKeys) {
    const uint16_t* kt = kv.k(item.seq, h, k0 / kGroupKeys);
    const uint16_t* vt = kt + kv.k_values;
    for (int64_t mt = 0; mt < row_tiles; ++mt) {  // each row tile on its own: scores, P, P V
      const int64_t last = std::min(rows, (mt + 1) * kM) - 1;  // the tile's furthest row
      if (w.pos[last] < k0) continue;  // the whole row tile is before this group
      E::scores(w.q.p + mt * kc_count * kTileValues, kt, kc_count,
                w.s.p + mt * kM * kSubKeys, rows_p);
      softmax_tile(mt, k0, w, dm);
      const uint16_t* pt = w.p.p + mt * 2 * kTileValues;
      E::values(pt, vt, dm.ct(), w.acc.p + mt * kM * dm.padded, dm.padded);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(w.l.p + r * kSubKeys));
    const float* arow = w.acc.p + r * dm.padded;
    float* dst = a.out + ((row0 + r / group) * a.num_heads + h * group + r % group) * dm.head_dim;
    for (int64_t d = 0; d < dm.head_dim; ++d) dst[d] = arow[d] * inv;
  }
}

// Items handed out costliest first through an atomic counter, so the threads finish together;
// the groups they read converted first, over the threads.
template <typename E, typename C>
void run(std::vector<Item>& items, const Args& a, const C* kc, const C* vc, const Dims& dm,
         int64_t max_rows) {
  const KvGroups kv(items, a, kc, vc, dm);
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    E::begin();
    Scratch w(max_rows, dm);
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1))
      run_item<E>(items[i], a, kv, dm, w);
    E::end();
  });
}

// The AMX engine where this process may use it, else AVX512-BF16's.
template <typename C>
void run_engine(std::vector<Item>& items, const Args& a, const C* kc, const C* vc, const Dims& dm,
                int64_t max_rows) {
#if CONVEYOR_AMX
  if (gemm::amx::available()) return run<TileEngine>(items, a, kc, vc, dm, max_rows);
#endif
  run<DotEngine>(items, a, kc, vc, dm, max_rows);
}

}  // namespace
#endif

namespace {
// Whether the kernel plan lets AVX512-BF16 run (set_bf16_dot, once at load: model/plan.py):
// a plan of avx2 or scalar keeps prompt rows off both engines.
std::atomic<bool>& bf16_dot_allowed() {
  static std::atomic<bool> on{true};
  return on;
}

// Calls of prompt_attention per engine: [0] AMX tiles, [1] AVX512-BF16 dot products.
std::array<std::atomic<int64_t>, 2>& engine_runs() {
  static std::array<std::atomic<int64_t>, 2> counts{};
  return counts;
}
}  // namespace

bool bf16_dot_usable() {
#if CONVEYOR_BF16_DOT
  static const bool cpu = __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
  return cpu;
#else
  return false;
#endif
}

void set_bf16_dot(bool on) { bf16_dot_allowed().store(on); }

std::string prompt_attention_isa() {
  if (gemm::amx::available()) return "amx";
  if (bf16_dot_usable() && bf16_dot_allowed().load()) return "avx512_bf16";
  return "";
}

std::map<std::string, int64_t> prompt_attention_runs() {
  return {{"amx", engine_runs()[0].load()}, {"avx512_bf16", engine_runs()[1].load()}};
}

void prompt_attention(const at::Tensor& q, const at::Tensor& kv_cache, int64_t block_size,
                      const at::Tensor& query_start, const at::Tensor& seq_lens,
                      const at::Tensor& block_tables, double scale,
                      const std::vector<int64_t>& prompt_tokens, at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat,
              "paged_attention: prompt rows take bfloat16 tiles, for float32 models only");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 1024,
              "paged_attention: prompt rows on tiles need a head dim that is a multiple of 16");
#if CONVEYOR_AMX || CONVEYOR_BF16_DOT
  TORCH_CHECK(!prompt_attention_isa().empty(),
              "paged_attention: this CPU (or the kernel plan) has neither AMX-BF16 nor "
              "AVX512-BF16 for prompt rows");
  const int64_t num_heads = q.size(1), num_kv_heads = kv_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tokens_per_item = std::max<int64_t>(1, kItemRows / group);
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  std::vector<Item> items;
  for (size_t s = 0; s < prompt_tokens.size(); ++s) {
    const int64_t context = lens[s] - (qs[s + 1] - qs[s]);
    for (int64_t t0 = 0; t0 < prompt_tokens[s]; t0 += tokens_per_item) {
      const int64_t n = std::min(tokens_per_item, prompt_tokens[s] - t0);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({static_cast<int64_t>(s), t0, n, h, (context + t0 + n) * n + 64});
    }
  }
  if (items.empty()) return;
  engine_runs()[gemm::amx::available() ? 0 : 1].fetch_add(1, std::memory_order_relaxed);
  const Args args{q.data_ptr<float>(),
                  {q.stride(0), q.stride(1), q.stride(2)},
                  qs,
                  lens,
                  block_tables.data_ptr<int64_t>(),
                  block_tables.size(1),
                  num_heads,
                  num_kv_heads,
                  block_size,
                  static_cast<float>(scale),
                  out.data_ptr<float>()};
  const Dims dm{head_dim, (head_dim + 31) / 32 * 32};
  const int64_t half = kv_cache.stride(0), max_rows = tokens_per_item * group;
  switch (kv_cache.scalar_type()) {
    case at::kFloat: {
      const float* c = kv_cache.data_ptr<float>();
      return run_engine(items, args, c, c + half, dm, max_rows);
    }
    case at::kHalf: {
      const c10::Half* c = kv_cache.data_ptr<c10::Half>();
      return run_engine(items, args, c, c + half, dm, max_rows);
    }
    case at::kBFloat16: {
      const c10::BFloat16* c = kv_cache.data_ptr<c10::BFloat16>();
      return run_engine(items, args, c, c + half, dm, max_rows);
    }
    case at::kFloat8_e4m3fn: {
      const c10::Float8_e4m3fn* c = kv_cache.data_ptr<c10::Float8_e4m3fn>();
      return run_engine(items, args, c, c + half, dm, max_rows);
    }
    default:
      TORCH_CHECK(false, "paged_attention: cache dtype ", kv_cache.scalar_type(),
                  " for prompt rows on tiles");
  }
#else
  (void)kv_cache, (void)block_size, (void)query_start, (void)seq_lens, (void)block_tables,
      (void)scale, (void)prompt_tokens, (void)out;
  TORCH_CHECK(false, "paged_attention: this build has neither AMX-BF16 nor AVX512-BF16 for prompt rows");
#endif
}

}  // namespace conveyor::attention::amx
