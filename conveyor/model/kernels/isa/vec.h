// Vectors for the compiled CPU ops: GCC vector extensions, built with -march=native.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace conveyor::vec {

// 64-byte vectors (16 floats, 8 doubles) with AVX-512, 32-byte ones (AVX2) elsewhere. On the
// Zen 5 (full-width AVX-512) 64-byte vectors made paged attention 1.5x faster for decode rows
// streamed from memory and 2.3x for a 512-token prompt chunk (an Intel Xeon measured them no
// faster than 32-byte ones, earlier). Code may use kVecBytesIs32 in #if to pick intrinsics.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#define kVecBytesIs32 0
#else
constexpr int kVecBytes = 32;
#define kVecBytesIs32 1
#endif
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

// Multiply-adds in a fixed form. Left to itself GCC fuses `acc += x * y` into an FMA in some
// loops and not in others (with -march=native on an AMD Zen it avoids FMA chains, by a
// heuristic that sees each loop on its own): two instantiations of one loop (paged attention's
// widened float32 tiles and its 16-bit cache read in place) then differed in the last bits on
// a Zen 3, and a quantized model's rounded activations turned that into another greedy answer.
// A loop that must give the same bits in every instantiation calls fmadd or madd.
#if defined(__tune_znver1__) || defined(__tune_znver2__) || defined(__tune_znver3__) || \
    defined(__tune_znver4__) || defined(__tune_znver5__)
#define CONVEYOR_SPLIT_MADD 1
#else
#define CONVEYOR_SPLIT_MADD 0
#endif

// a * b + c rounded once (one FMA), however the compiler would have contracted it.
template <typename T>
inline Vec<T> fmadd(Vec<T> a, Vec<T> b, Vec<T> c) {
#if defined(__FMA__) || defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
#if kVecBytesIs32
    return (Vec<T>)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return (Vec<T>)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
  } else if constexpr (std::is_same_v<T, double>) {
#if kVecBytesIs32
    return (Vec<T>)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
    return (Vec<T>)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#endif
  }
#endif
  for (int i = 0; i < kLanes<T>; ++i) c[i] = std::fma(a[i], b[i], c[i]);
  return c;
}

// c + a * b for a latency-bound accumulator chain: on a Zen a multiply and an add the
// compiler cannot fuse (the add's 3-cycle latency on its own pipes keeps more chains in flight
// than a 5-cycle FMA: FMAs in both of paged attention's loops made a 512-token chunk's
// attention 1.25-1.4x slower there, FMAs in Q K^T alone did not), elsewhere one FMA.
template <typename T>
inline Vec<T> madd(Vec<T> a, Vec<T> b, Vec<T> c) {
#if CONVEYOR_SPLIT_MADD
  Vec<T> product = a * b;
  asm("" : "+v"(product));  // opaque to the optimizer: the product is rounded, then added
  return c + product;
#else
  return fmadd<T>(a, b, c);
#endif
}

// e^x lane by lane. float32: a range reduction to x = n ln2 + r and a degree-6 polynomial in r
// (Cephes' expf), within ~2 ulp; inputs are clamped to [-87, 88] (e^-87 ~ 1e-38, e^88 ~ 1.7e38:
// the softmax's and silu's results are the same for anything beyond). Other types: std::exp.
template <typename T>
inline Vec<T> vexp(Vec<T> x) {
  if constexpr (std::is_same_v<T, float>) {
    typedef int32_t Int __attribute__((vector_size(kVecBytes)));
    x = x < -87.0f ? broadcast(-87.0f) : x;
    x = x > 88.0f ? broadcast(88.0f) : x;
    const Vec<T> t = x * 1.44269504088896341f + 12582912.0f;  // round(x log2 e) in low bits
    const Int n = reinterpret_cast<const Int&>(t) - 0x4B400000;
    const Vec<T> nf = t - 12582912.0f;
    const Vec<T> r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    const Vec<T> z = r * r;
    Vec<T> y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const Int scale = (n + 127) << 23;
    return y * reinterpret_cast<const Vec<T>&>(scale);
  } else {
    for (int i = 0; i < kLanes<T>; ++i) x[i] = std::exp(x[i]);
    return x;
  }
}

}  // namespace conveyor::vec
