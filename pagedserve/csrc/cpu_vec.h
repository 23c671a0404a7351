// One vector register of floats for the CPU kernels (GCC's vector extensions: paged
// attention, layer ops, fixed-order GEMM, int8 row maxima): 16 lanes with AVX-512 (half
// the instructions of AVX2 for the same work), else 8 (the compiler splits or fuses it for
// other widths). loadv widens kLanes values of any dtype to float32; storev writes
// float32 or bfloat16. (cpu_ops.py keys the build on this header too.)

#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve_vec {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));

// kLanes values at p as float32: bfloat16 is the top half of a float32, so it converts
// with a widen and a shift; other dtypes convert one by one.
// Always inlined: GCC would otherwise call it out of line from functions compiled without
// fast-math (int8_ops_cpu.cpp's PRECISE), a call per register.
template <typename T>
__attribute__((always_inline)) inline vf loadv(const T* p) {
  vf x;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&x, p, sizeof(x));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#ifdef __AVX512F__
    // one vpmovzxwd (GCC splits __builtin_convertvector's widening into halves)
    const __m512i w =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const vi bits = reinterpret_cast<vi>(_mm512_slli_epi32(w, 16));
#else
    vu16 h;
    std::memcpy(&h, p, sizeof(h));
    const vi bits = __builtin_convertvector(h, vi) << 16;
#endif
    std::memcpy(&x, &bits, sizeof(x));
  } else {
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(p[i]);
  }
  return x;
}

__attribute__((always_inline)) inline void storev(float* p, vf x) {
  std::memcpy(p, &x, sizeof(x));
}

// x rounded to bfloat16 as c10::BFloat16 rounds a float (nearest even, NaN as 0x7FC0), in
// integer arithmetic: fast-math may not fold the NaN test away. Always inlined, as loadv.
__attribute__((always_inline)) inline void storev(c10::BFloat16* p, vf x) {
  typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));
  vu32 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const vu32 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  const vu32 nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;  // all ones where NaN
  const vu16 top = __builtin_convertvector((rounded & ~nan) | (nan & 0x7FC0u), vu16);
  std::memcpy(p, &top, sizeof(top));
}

}  // namespace pagedserve_vec
