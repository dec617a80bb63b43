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

// dst[0:n] = narrow<uint16_t>(src[0:n]), 16 or 8 at a time where the compiler targets AVX-512 or
// AVX2 (the scalar loop does not vectorize inside every kernel: a bf16 linear's output loop ran
// one element at a time, ~3% of a bf16 int4 decode step). The same bits as `narrow`, NaN included.
inline void narrow_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    const __m512i rounded = _mm512_srli_epi32(biased, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(out));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    const __m256i rounded = _mm256_srli_epi32(biased, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i out = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    // packus works per 128-bit half ([0:4] [0:4] | [4:8] [4:8]); the permute joins the halves.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) dst[i] = narrow<uint16_t>(src[i]);
}

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
