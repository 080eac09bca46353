// Vectors for the compiled CPU ops: GCC vector extensions, built with -march=native.
#pragma once

#include <cstring>

namespace conveyor_vec {

// 32-byte vectors (8 floats, 4 doubles) everywhere: with AVX-512 the compiler still has 32
// registers for them; 64-byte vectors measured slower here (latency-bound accumulators).
constexpr int kVecBytes = 32;
#if defined(__AVX512F__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif
template <typename T>
struct VecOf {
  typedef T type __attribute__((vector_size(kVecBytes)));
};
template <typename T>
using Vec = typename VecOf<T>::type;
template <typename T>
constexpr int kLanes = kVecBytes / sizeof(T);

template <typename T>
inline Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename T>
inline Vec<T> broadcast(T x) {
  // Folds to one broadcast, or into the FMA's memory operand (x - 0 == x for every x, -0
  // included); a lane-by-lane fill compiled to shuffles.
  return x - Vec<T>{};
}

}  // namespace conveyor_vec
