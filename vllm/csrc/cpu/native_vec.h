/*
 * at::vec's vector types compiled for this CPU, and what the kernels' hot loops need that at::vec
 * lacks: a fast exp over fp32 lanes (the softmax numerators, SiLU) and a max without NaN checks.
 *
 * The at::vec headers pick their SIMD width from CPU_CAPABILITY_* macros, which torch's own build
 * sets per kernel file; here they follow the instruction sets -march=native enabled. CPU_CAPABILITY
 * names the inline namespace of the vector types: a name of our own keeps them apart from any copy
 * compiled into libtorch.
 *
 * exp_fast semantics: exp_fast(x) = exp(x) lane by lane, within 2 ulp of the correctly rounded value for
 * x in [-87, 88.7] (a normal result); 0 or a subnormal below, +inf above 88.72; NaN stays NaN.
 *
 * On AVX-512 it is 11 instructions: n = round(x / ln 2), r = x - n ln 2 (|r| <= ln 2 / 2), a degree-5
 * polynomial for exp(r) (coefficients fitted to the relative error on that range: 1.6e-7), and
 * vscalefps for 2^n, which over- and underflows as exp does without the masks and blends an
 * integer-exponent construction needs; at::vec's exp_u20 (20 ulp) takes 19. Elsewhere exp_fast is
 * exp_u20. The softmax numerators on exp_u20 and at::vec::maximum were 18% of a bf16 2,048-token
 * prompt's attention on Zen 4 (one thread); on exp_fast and max_fast the attention took 0.92x the time.
 */

#pragma once

#define CPU_CAPABILITY vllm_cpu_native
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/cpu/vec/vec.h>

namespace vllm_cpu_bits {

template <typename Vec>
inline Vec exp_fast(const Vec& x) {
  return x.exp_u20();
}

// max(a, b) lane by lane where a NaN need not win: at::vec::maximum propagates NaN with a compare,
// a mask move and an or per vector, 4 instructions where vmaxps is 1. (A NaN logit still makes
// its row's softmax NaN: exp(NaN - max) is NaN.)
template <typename Vec>
inline Vec max_fast(const Vec& a, const Vec& b) {
  return at::vec::maximum(a, b);
}

#if defined(CPU_CAPABILITY_AVX512)
inline __m512 exp_fast_512(__m512 x) {
  // max/min return their second operand when one is NaN: x comes last so a NaN stays NaN.
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts (Cody-Waite): the first has 15 significant bits, so its product with n
  // (|n| <= 150) is exact and r keeps its accuracy at large |n| (one part left ~4 ulp at exp(-85)).
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00827952940016985f), r, _mm512_set1_ps(0.04189842566847801f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.16667814552783966f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.49999144673347473f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999996423721313f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline at::vec::Vectorized<float> exp_fast(const at::vec::Vectorized<float>& x) { return exp_fast_512(x); }

inline at::vec::Vectorized<float> max_fast(const at::vec::Vectorized<float>& a, const at::vec::Vectorized<float>& b) {
  return _mm512_max_ps(a, b);
}
#endif

}  // namespace vllm_cpu_bits
