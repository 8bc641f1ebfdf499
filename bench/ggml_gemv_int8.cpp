// A PROTOTYPE for bench.ggml_gemv_speed, not part of the engine: llama.cpp's way of computing a one-token GEMV on
// GGUF blocks — x quantized once to int8 per 32 inputs (Q8_0 of x: d = max|x|/127, q = round(x/d)), then integer
// dot products (AVX-512 VNNI vpdpbusd on 256-bit vectors, u8 × s8) per block, scaled in fp32 — for Q5_0, Q8_0 and
// Q4_K rows, to set beside Kiln's float-activation kernel (native_cpu.cpp's gemv512_row, x kept in fp32). It
// rounds x, so its outputs differ from gguf's dequantization then a float matmul by ~0.5 % (relative): the bench
// reports that too. Built by the bench with g++ -O3 -march=native; needs AVX512_VNNI and AVX512VL.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
inline float h2f(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return _cvtsh_ss(h); }
inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// q4_k: sub-block j's 6-bit scale and min (ggml's get_scale_min_k4)
inline void scale_min(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) { sc = q[j] & 63; m = q[j + 4] & 63; }
    else { sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}
}  // namespace

extern "C" {
// x [K] → qx int8 [K], dx [K/32] its scales, sq [K/32] Σ qx a block, sx [K/32] Σ x a block (fp32, for Q4_K's mins)
void quant_x(const float* x, int K, int8_t* qx, float* dx, int32_t* sq, float* sx) {
    for (int b = 0; b < K / 32; ++b) {
        float amax = 0.f, s = 0.f;
        for (int i = 0; i < 32; ++i) { amax = std::fmax(amax, std::fabs(x[32 * b + i])); s += x[32 * b + i]; }
        const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
        int t = 0;
        for (int i = 0; i < 32; ++i) { const int q = (int)std::nearbyint(x[32 * b + i] * id); qx[32 * b + i] = (int8_t)q; t += q; }
        dx[b] = d; sq[b] = t; sx[b] = s;
    }
}

// y [N] for N rows of GGML type t (6 q5_0, 8 q8_0, 12 q4_k) on the quantized x
void int_gemv(int t, const uint8_t* w, int N, int K, const int8_t* qx, const float* dx, const int32_t* sq,
              const float* sx, float* y) {
    const __m128i low = _mm_set1_epi8(15);
    const __m256i low8 = _mm256_set1_epi8(15);
    const size_t row_bytes = t == 12 ? (size_t)K / 256 * 144 : (size_t)K / 32 * (t == 6 ? 22 : 34);
    for (int n = 0; n < N; ++n) {
        const uint8_t* row = w + (size_t)n * row_bytes;
        _mm_prefetch((const char*)row + 4096, _MM_HINT_T0);
        __m256 acc = _mm256_setzero_ps();
        float corr = 0.f;
        if (t == 12) {
            for (int bi = 0; bi < K / 256; ++bi) {
                const uint8_t* b = row + (size_t)bi * 144;
                const float d = h2f(b), dmin = h2f(b + 2);
                for (int c = 0; c < 4; ++c) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * c));
                    const __m256i lo = _mm256_and_si256(v, low8), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low8);
                    const int j0 = 8 * bi + 2 * c;
                    int sc, m;
                    scale_min(2 * c, b + 4, sc, m);
                    __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i*)(qx + 32 * j0)));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc * dx[j0]), _mm256_cvtepi32_ps(p), acc);
                    corr += dmin * m * sx[j0];
                    scale_min(2 * c + 1, b + 4, sc, m);
                    p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, _mm256_loadu_si256((const __m256i*)(qx + 32 * (j0 + 1))));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc * dx[j0 + 1]), _mm256_cvtepi32_ps(p), acc);
                    corr += dmin * m * sx[j0 + 1];
                }
            }
        } else {
            const int size = t == 6 ? 22 : 34;
            for (int bi = 0; bi < K / 32; ++bi) {
                const uint8_t* b = row + (size_t)bi * size;
                const __m256i xq = _mm256_loadu_si256((const __m256i*)(qx + 32 * bi));
                const float d = h2f(b) * dx[bi];
                __m256i p;
                if (t == 6) {       // codes c in 0..31 (nibble | fifth bit), w = d (c - 16): Σ c·qx - 16 Σ qx
                    uint32_t qh;
                    std::memcpy(&qh, b + 2, 4);
                    const __m128i v = _mm_loadu_si128((const __m128i*)(b + 6));
                    __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
                    c = _mm256_or_si256(c, _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(16)));
                    p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xq);
                    corr += d * 16.f * (float)sq[bi];
                } else {            // s8 × s8 as |w| × sign(x, w), llama.cpp's trick
                    const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 2));
                    p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q));
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc);
            }
        }
        y[n] = hsum8(acc) - corr;
    }
}
}  // extern "C"
