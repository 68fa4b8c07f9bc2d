// One exp for the CPU kernels (cpu_kernels.cc, attention.cc): included by both.
#pragma once
#include <cstdint>
#include <cstring>

// exp(x) for x in [-80, 0] (callers clamp): x = k ln2 + r, |r| <= ln2/2, exp(r) by a degree-7
// polynomial (Cephes expf coefficients), 2^k through the exponent bits. Plain arithmetic, so the
// loops vectorize without -ffast-math (which would also break NaN propagation); softmax through
// it matches paddle's to 1e-6 relative (tests/test_kernels.py).
__attribute__((always_inline)) inline float exp_neg(float x) {
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;   // round to nearest
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// exp_neg on 8 lanes (the same reduction and polynomial, written with intrinsics: gcc leaves the
// scalar version's loops unvectorized, ~5 ns per element), x clamped to [-80, 0] here.
__attribute__((always_inline)) inline __m256 exp8_neg(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-80.f)), _mm256_setzero_ps());
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
