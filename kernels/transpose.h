// The 16x16 transpose of 32-bit elements in AVX-512 registers, shared by the AVX-512 GEMM (gemm.cpp:
// packing fp32 / widened bf16 weight panels), the AMX tile kernel (amx_gemm.cpp: VNNI-2 weight panels,
// a bf16 pair being one 32-bit element) and the swapped-operand AMX kernel (amx_swap.cpp: VNNI-2 panels
// of x, and its [n][m] accumulator tiles back to [m][n]). Compiled under the AVX-512 target attribute and
// force-inlined, so that it is callable from (and compiled into) code of any superset target (the AMX
// kernels' "amx-tile,amx-bf16,avx512..." functions, gemm.cpp's "avx512...,fma" ones).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include <cstdint>

#define ASCEND_TRANSPOSE_TARGET \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq"))) inline __attribute__((always_inline))

namespace ascend_kernels {

// out[j] = column j of the 16 rows r[0..15] (16 floats each); r is clobbered.
ASCEND_TRANSPOSE_TARGET void transpose16x16_regs(__m512* r, __m512* out) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved within 128-bit lanes
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // r[4g + c], lane l: column 4l + c of rows 4g..4g+3
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {  // gather lane l of the four groups: column 4l + c of all 16 rows
    const __m512 x0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    out[0 + c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    out[8 + c] = _mm512_shuffle_f32x4(x0, y0, 0xdd);
    out[4 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    out[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xdd);
  }
}

// dst row j (16 floats at dst + j * ldd) = column j of the 16 rows r[0..15]; r is clobbered.
ASCEND_TRANSPOSE_TARGET void transpose16x16_store(__m512* r, float* dst, int64_t ldd) {
  __m512 out[16];
  transpose16x16_regs(r, out);
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + j * ldd, out[j]);
}

// dst[j * ldd + i] = src[i * lds + j] (32-bit elements, j < 16) for i < rows; 0 for rows <= i < 16
ASCEND_TRANSPOSE_TARGET void transpose16x16_u32(const uint32_t* src, int64_t lds, int rows, uint32_t* dst,
                                                int64_t ldd) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i)
    r[i] = i < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(src + i * lds)) : _mm512_setzero_ps();
  transpose16x16_store(r, reinterpret_cast<float*>(dst), ldd);
}

}  // namespace ascend_kernels

#endif
