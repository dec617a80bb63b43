/*
 * bf16 as its bits (uint16_t) for the CPU kernels of this folder: exact widening to fp32 and
 * torch's rounding back. Branch-free, so loops over them vectorize (c10::BFloat16's own
 * conversions do not: a bf16 kernel built on them ran 10x slower than its fp32 twin).
 * `widen(float)` and `narrow<float>` are identities, so one template serves both dtypes;
 * `elements<T>` gives a tensor's data as that element type.
 */

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vllm_cpu_bits {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T narrow(float v);

template <>
inline float narrow<float>(float v) {
  return v;
}

// Round to nearest even, NaN to the quiet NaN: exactly c10::BFloat16's conversion, torch's casts.
template <>
inline uint16_t narrow<uint16_t>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}

#if defined(__AVX2__)
// 8 bf16 (their bits) -> the 8 fp32 of the same values, in registers: zero-extended to 32 bits and
// shifted into the high half (exact, as `widen`).
inline __m256 widen8(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }
#endif
#if defined(__AVX512F__)
// The same for 16.
inline __m512 widen16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
#endif
#if defined(__AVX512BF16__)
// 32 bf16 in a register as the 16 pairs vdpbf16ps multiplies (the same bits).
inline __m512bh as_bf16_pairs(__m512i bits) { return (__m512bh)bits; }
#endif

// The element type a kernel works on: fp32 as is, bf16 as its bits.
template <typename T>
T* elements(const at::Tensor& t);

template <>
inline float* elements<float>(const at::Tensor& t) {
  return t.data_ptr<float>();
}

template <>
inline uint16_t* elements<uint16_t>(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>());
}

}  // namespace vllm_cpu_bits
