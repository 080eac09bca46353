// balanced_for: the parallel loop of the memory-bound kernels (gemm/small_gemm.cpp,
// gemm/quant_gemm.cpp).
//
// Why: a decode step's matmul streams its weights from memory, and at::parallel_for's static
// split gives each thread one half. The two cores do not stream at the same pace (their share
// of the memory bandwidth differs from call to call), so one of them finished its half early
// and waited: over a one-row float32 step's 121 matmuls, 2.6-3.9 ms of one thread's time in
// 24-27 ms (timed per call on the 2-core Xeon). Here each thread still starts on one contiguous
// share and reads it front to back (one stream for the hardware prefetcher; handing out small
// pieces round-robin measured 4-15% slower), but claims it a piece at a time, and a thread whose
// share is done takes the back half of the fullest share left. Measured against the static
// split on SmolLM2-135M's float32 projections (one row, 30 of each, weights from memory,
// alternating): medians +2-10% GB/s by shape.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace conveyor::balance {

// What is left of one share, [front, back), in one atomic word (front in the low half): the
// owner's claims from the front and a thief's from the back can never overlap.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};
};

inline uint64_t pack(int64_t front, int64_t back) {
  return static_cast<uint64_t>(back) << 32 | static_cast<uint32_t>(front);
}
inline int64_t front_of(uint64_t r) { return static_cast<int64_t>(r & 0xffffffffu); }
inline int64_t back_of(uint64_t r) { return static_cast<int64_t>(r >> 32); }

// Claims pieces from the share's front and runs fn on each, until the share is empty.
template <typename F>
void drain(Share& share, int64_t piece, const F& fn) {
  uint64_t cur = share.range.load(std::memory_order_relaxed);
  while (front_of(cur) < back_of(cur)) {
    const int64_t front = front_of(cur), back = back_of(cur);
    const int64_t next = std::min(front + piece, back);
    if (share.range.compare_exchange_weak(cur, pack(next, back), std::memory_order_relaxed)) {
      fn(front, next);
      cur = share.range.load(std::memory_order_relaxed);
    }
  }
}

// Moves the back half (whole pieces) of the fullest share into `mine`; false when no share has
// more than one piece left (its owner finishes that sooner than a thief could take it over).
// Every split lands on a multiple of `piece` counted from 0, so the pieces fn sees are the same
// whoever runs them and however shares change hands: a kernel whose last, short tile of a range
// computes its rows another way (small_gemm's one-row tiles) gives every row the same bits on
// one thread or many.
inline bool steal(Share* shares, int64_t num_shares, Share& mine, int64_t piece) {
  while (true) {
    int64_t victim = -1, most = piece;
    for (int64_t s = 0; s < num_shares; ++s) {
      const uint64_t r = shares[s].range.load(std::memory_order_relaxed);
      if (back_of(r) - front_of(r) > most) victim = s, most = back_of(r) - front_of(r);
    }
    if (victim < 0) return false;
    uint64_t cur = shares[victim].range.load(std::memory_order_relaxed);
    const int64_t front = front_of(cur), back = back_of(cur);
    if (back - front <= piece) continue;  // claimed meanwhile: look again
    const int64_t left = (back - front + piece - 1) / piece;  // >= 2; front is piece-aligned
    const int64_t split = front + (left - left / 2) * piece;  // the owner keeps the front half
    if (shares[victim].range.compare_exchange_strong(cur, pack(front, split),
                                                      std::memory_order_relaxed)) {
      mine.range.store(pack(split, back), std::memory_order_relaxed);
      return true;
    }
  }
}

// fn(begin, end) over [0, count) in pieces of `piece` items (the last one may be shorter), on
// torch's threads, as described above; inline on the calling thread inside a parallel region.
template <typename F>
void balanced_for(int64_t count, int64_t piece, const F& fn) {
  if (count <= 0) return;
  TORCH_CHECK(count < (int64_t{1} << 32) && piece > 0, "balanced_for: 0 < piece, count < 2^32");
  const int64_t pieces = (count + piece - 1) / piece;
  const int64_t n = std::min<int64_t>(at::get_num_threads(), pieces);
  if (n <= 1 || at::in_parallel_region()) {
    fn(0, count);
    return;
  }
  std::unique_ptr<Share[]> shares(new Share[n]);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t front = pieces * s / n * piece;
    const int64_t back = std::min(count, pieces * (s + 1) / n * piece);
    shares[s].range.store(pack(front, back), std::memory_order_relaxed);
  }
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) drain(shares[s], piece, fn);
    while (steal(shares.get(), n, shares[first], piece)) drain(shares[first], piece, fn);
  });
}

}  // namespace conveyor::balance
