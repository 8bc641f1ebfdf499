// One-token CPU GEMVs for the engine's decode step (engine.kernels.native builds and loads this file).
//
// int4pack_gemv: torch's CPU int4 operand (engine.quant.records: per 64 output rows, for each input k, 32
//   bytes whose low nibbles are rows 0..31 and high nibbles rows 32..63; (s, z) bf16 pairs [in/g, out, 2];
//   w = (q - 8)·s + z), computed as torch.ops.aten._weight_int4pack_mm_for_cpu computes it: x rounded to
//   bf16, fp32 accumulation, y rounded to bf16. Summed per group as s·Σq·x + (z - 8s)·Σx.
// q8_gemv: int8 codes [out, in] with an fp32 scale per 32 inputs (a GGUF Q8_0 matrix, its fp16 scales
//   widened): y = Σ_b d_b · Σ q·x, in fp32.
// int4_ffn: one quantized expert (gate|up and down int4pack operands) on one token, as quant_ffn computes it.
// ggml_matmul: y [M, N] = x [M, K] · Wᵀ for W [N, K] in any GGML type engine.quant.ggml lists (a GGUF's blocks as
//   the file holds them): each block unpacked once into int8 codes and a (scale, min) per sub-block, then for every
//   row of x Σ_s scale·(Σ q·x) - min·(Σ x), fp32 throughout (gguf's dequantization factored, another rounding). ggml_ffn: one expert on one token from three such matrices, each
//   in its own type.
// add_rms_norm, attn_decode: the rest of a one-token decode layer (residual add + RMSNorm; rotary, KV write
//   and attention over the cache), in the torch forms' operation order where it is elementwise (built with
//   -ffp-contract=off, so a*b + c*d is not fused into an FMA unless written so).
// The "exact prefill rows" region: many tokens of one sequence, each row computed by the one-token kernels' own
//   operations (int4_gemv is int4_gemv_rows with M = 1; attn_decode and attn_rows share rope_kv_write, and attn_rows'
//   keys-in-lanes attention repeats attend_head's operations in its order, checked against it at first use).
// The GEMVs and the attention split their work over `threads` OpenMP threads (torch's own libgomp once torch
// is loaded).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int PREFETCH = 4096;   // bytes ahead a weight stream is prefetched (4 KB beat 1 and 2 KB on the demo's shapes here)

inline float bf16_round(float v) {          // round to nearest even, as torch's float -> bfloat16
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return v;   // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    std::memcpy(&v, &u, 4);
    return v;
}

inline float bf16_to_float(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// A tile's (s, z) rows lie one group apart (N·4 bytes), 256 bytes each: a stride the hardware prefetcher does not
// follow, so the tile asks for all of them up front.
inline void prefetch_scales(const uint16_t* sz, int groups, int N, int row0) {
    for (int gi = 0; gi < groups; ++gi) {
        const char* p = (const char*)(sz + ((size_t)gi * N + row0) * 2);
        for (int l = 0; l < 256; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    }
}

// One 64-row tile of int4pack_gemv: y[0..64) for tile `nb`.
void int4_tile(const float* x, const float* xs, int K, int g, const uint8_t* tile, const uint16_t* sz, int N,
               int row0, float* y) {
    const int groups = K / g;
    prefetch_scales(sz, groups, N, row0);
#if defined(__AVX512F__)
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int gi = 0; gi < groups; ++gi) {
        __m512 ga[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = gi * g; k < (gi + 1) * g; ++k) {
            const uint8_t* b = tile + (size_t)k * 32;
            if (!(k & 1)) _mm_prefetch((const char*)b + PREFETCH, _MM_HINT_T0);
            __m128i b0 = _mm_loadu_si128((const __m128i*)b), b1 = _mm_loadu_si128((const __m128i*)(b + 16));
            __m512 xk = _mm512_set1_ps(x[k]);
            ga[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, low))), xk, ga[0]);
            ga[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, low))), xk, ga[1]);
            ga[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b0, 4), low))), xk, ga[2]);
            ga[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b1, 4), low))), xk, ga[3]);
        }
        // (s, z) of rows row0..row0+63 in group gi: 64 bf16 pairs, each pair one 32-bit lane (s low, z high)
        const uint16_t* p = sz + ((size_t)gi * N + row0) * 2;
        const __m512 sum = _mm512_set1_ps(xs[gi]);
        for (int j = 0; j < 4; ++j) {
            __m512i v = _mm512_loadu_si512((const void*)(p + 32 * j));
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
            acc[j] = _mm512_fmadd_ps(s, ga[j], acc[j]);
            acc[j] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z), sum, acc[j]);
        }
    }
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + 16 * j, acc[j]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int gi = 0; gi < groups; ++gi) {
        __m256 ga[8];
        for (auto& a : ga) a = _mm256_setzero_ps();
        for (int k = gi * g; k < (gi + 1) * g; ++k) {
            const uint8_t* b = tile + (size_t)k * 32;
            if (!(k & 1)) _mm_prefetch((const char*)b + PREFETCH, _MM_HINT_T0);
            __m128i b0 = _mm_loadu_si128((const __m128i*)b), b1 = _mm_loadu_si128((const __m128i*)(b + 16));
            __m128i n[4] = {_mm_and_si128(b0, low), _mm_and_si128(b1, low), _mm_and_si128(_mm_srli_epi16(b0, 4), low),
                            _mm_and_si128(_mm_srli_epi16(b1, 4), low)};
            __m256 xk = _mm256_set1_ps(x[k]);
            for (int j = 0; j < 4; ++j) {
                ga[2 * j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n[j])), xk, ga[2 * j]);
                ga[2 * j + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(n[j], 8))), xk,
                                                ga[2 * j + 1]);
            }
        }
        const uint16_t* p = sz + ((size_t)gi * N + row0) * 2;
        const __m256 sum = _mm256_set1_ps(xs[gi]);
        for (int j = 0; j < 8; ++j) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(p + 16 * j));
            __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
            acc[j] = _mm256_fmadd_ps(s, ga[j], acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z), sum, acc[j]);
        }
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(y + 8 * j, acc[j]);
#else
    float acc[64] = {0};
    for (int gi = 0; gi < groups; ++gi) {
        float ga[64] = {0};
        for (int k = gi * g; k < (gi + 1) * g; ++k) {
            const uint8_t* b = tile + (size_t)k * 32;
            for (int j = 0; j < 32; ++j) {
                ga[j] += float(b[j] & 15) * x[k];
                ga[32 + j] += float(b[j] >> 4) * x[k];
            }
        }
        const uint16_t* p = sz + ((size_t)gi * N + row0) * 2;
        for (int r = 0; r < 64; ++r) {
            float s = bf16_to_float(p[2 * r]), z = bf16_to_float(p[2 * r + 1]);
            acc[r] += s * ga[r] + (z - 8.0f * s) * xs[gi];
        }
    }
    // rows: lane j of quarter q is row 16q + j in the vector paths; here row r directly
    std::memcpy(y, acc, sizeof acc);
#endif
}


#if defined(__AVX512BF16__)
// One input pair j of a 32 x 32 int4 group at b: its 32 rows' weights as the bf16 of 128 + q, in the pair order
// the bf16 kernels dot (rows 0,2..30 | 1,3..31 | 32,34..62 | 33,35..63); shared by int4_tile_bf16 and its row
// forms, which must keep one order of operations (the same bits whatever the rows).
static inline __attribute__((always_inline)) void unpack_pair_bf16(const uint8_t* b, int j, __m512bh w[4]) {
    const __m512i lo16 = _mm512_set1_epi32(0x0000ffff), hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i nib = _mm512_set1_epi32(0x000f000f), bias = _mm512_set1_epi32(0x43004300);
    __m512i w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + 32 * j)));
    __m512i w2 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + 32 * (j + 16))));
    __m512i e = _mm512_ternarylogic_epi32(w1, _mm512_slli_epi32(w2, 16), lo16, 0xec);   // (A & C) | B
    __m512i o = _mm512_ternarylogic_epi32(_mm512_srli_epi32(w1, 16), w2, hi16, 0xf8);   // A | (B & C)
    w[0] = (__m512bh)_mm512_ternarylogic_epi32(e, nib, bias, 0xea);
    w[1] = (__m512bh)_mm512_ternarylogic_epi32(o, nib, bias, 0xea);
    w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(e, 4), nib, bias, 0xea);
    w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(o, 4), nib, bias, 0xea);
}

// Group gi's (s, z) of 64 rows from row0, one 32-bit lane a row, in unpack_pair_bf16's row order.
static inline __attribute__((always_inline)) void group_scales(const uint16_t* sz, int gi, int N, int row0,
                                                               __m512i v[4]) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const uint16_t* p = sz + ((size_t)gi * N + row0) * 2;
    const __m512i v0 = _mm512_loadu_si512((const void*)p), v1 = _mm512_loadu_si512((const void*)(p + 32));
    const __m512i v2 = _mm512_loadu_si512((const void*)(p + 64)), v3 = _mm512_loadu_si512((const void*)(p + 96));
    v[0] = _mm512_permutex2var_epi32(v0, even, v1);
    v[1] = _mm512_permutex2var_epi32(v0, odd, v1);
    v[2] = _mm512_permutex2var_epi32(v2, even, v3);
    v[3] = _mm512_permutex2var_epi32(v2, odd, v3);
}
#endif

#if defined(__AVX512BF16__)
// int4_tile with bf16 dot products (groups of 32 only): each weight becomes the bf16 of 128 + q (0x4300 | q, exact),
// two inputs k and k + 16 of a group are one bf16 pair, so one vdpbf16ps does 16 rows × 2 inputs; Σ(128 + q)·x
// - 128·Σx = Σq·x. The pairs hold even and odd rows (E, O): rows are interleaved back at the end. xp: per group
// 16 pairs (bf16 x[32g + j] | bf16 x[32g + 16 + j] << 16).
void int4_tile_bf16(const uint32_t* xp, const float* xs, int K, const uint8_t* tile, const uint16_t* sz, int N,
                    int row0, float* y) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    prefetch_scales(sz, K / 32, N, row0);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int gi = 0; gi < K / 32; ++gi) {
        // ga: rows 0,2..30 | 1,3..31 | 32,34..62 | 33,35..63, each Σ (128 + q)·x over the group
        __m512 ga[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        const uint8_t* b = tile + (size_t)gi * 32 * 32;
        for (int j = 0; j < 16; ++j) {
            if (!(j & 1)) {                    // the group 4 KB ahead, a line per input pair
                _mm_prefetch((const char*)b + PREFETCH + 32 * j, _MM_HINT_T0);
                _mm_prefetch((const char*)b + PREFETCH + 512 + 32 * j, _MM_HINT_T0);
            }
            __m512bh w[4];
            unpack_pair_bf16(b, j, w);
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[gi * 16 + j]);
            for (int q = 0; q < 4; ++q) ga[q] = _mm512_dpbf16_ps(ga[q], w[q], xb);
        }
        __m512i v[4];
        group_scales(sz, gi, N, row0, v);                           // (s, z) of a row: one 32-bit lane
        const __m512 sum = _mm512_set1_ps(xs[gi]);
        const __m512 off = _mm512_set1_ps(128.0f * xs[gi]);
        for (int q = 0; q < 4; ++q) {
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v[q], 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v[q], hi16));
            acc[q] = _mm512_fmadd_ps(s, _mm512_sub_ps(ga[q], off), acc[q]);
            acc[q] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z), sum, acc[q]);
        }
    }
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    _mm512_storeu_ps(y, _mm512_permutex2var_ps(acc[0], lo_idx, acc[1]));
    _mm512_storeu_ps(y + 16, _mm512_permutex2var_ps(acc[0], hi_idx, acc[1]));
    _mm512_storeu_ps(y + 32, _mm512_permutex2var_ps(acc[2], lo_idx, acc[3]));
    _mm512_storeu_ps(y + 48, _mm512_permutex2var_ps(acc[2], hi_idx, acc[3]));
}
#endif

#if defined(__AVX512BF16__)
// int4_tile_bf16 on M rows of x at once (exact prefill): a group's weights are unpacked once into the bf16 pairs
// int4_tile_bf16 makes and then dotted with every row, each row's accumulations the very operations int4_tile_bf16
// does for it, in its order (so its bits: tests/engine/test_exact_prefill.py). y: row 0's outputs row0..row0+63,
// rows ystride floats apart.
void int4_tile_bf16_rows(const uint32_t* xp, const float* xs, int M, int K, const uint8_t* tile, const uint16_t* sz,
                         int N, int row0, float* y, size_t ystride) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const int groups = K / 32;
    prefetch_scales(sz, groups, N, row0);
    __m512* acc = new __m512[(size_t)M * 4];
    for (size_t i = 0; i < (size_t)M * 4; ++i) acc[i] = _mm512_setzero_ps();
    __m512bh wv[16][4];
    for (int gi = 0; gi < groups; ++gi) {
        const uint8_t* b = tile + (size_t)gi * 32 * 32;
        for (int j = 0; j < 16; ++j) {
            if (!(j & 1)) {
                _mm_prefetch((const char*)b + PREFETCH + 32 * j, _MM_HINT_T0);
                _mm_prefetch((const char*)b + PREFETCH + 512 + 32 * j, _MM_HINT_T0);
            }
            unpack_pair_bf16(b, j, wv[j]);
        }
        __m512i v[4];
        group_scales(sz, gi, N, row0, v);
        __m512 s[4], zs[4];
        for (int q = 0; q < 4; ++q) {
            s[q] = _mm512_castsi512_ps(_mm512_slli_epi32(v[q], 16));
            zs[q] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[q], _mm512_castsi512_ps(_mm512_and_si512(v[q], hi16)));
        }
        // R rows at a time share each weight load (independent chains); a row's operations are the same for any R
        auto rows = [&](int m, auto r_) {
            constexpr int R = decltype(r_)::value;
            const uint32_t* xm[R];
            __m512 ga[R][4];
            for (int r = 0; r < R; ++r) {
                xm[r] = xp + (size_t)(m + r) * (K / 2) + gi * 16;
                for (int q = 0; q < 4; ++q) ga[r][q] = _mm512_setzero_ps();
            }
            for (int j = 0; j < 16; ++j) {
                __m512bh xb[R];
                for (int r = 0; r < R; ++r) xb[r] = (__m512bh)_mm512_set1_epi32((int)xm[r][j]);
                for (int q = 0; q < 4; ++q)
                    for (int r = 0; r < R; ++r) ga[r][q] = _mm512_dpbf16_ps(ga[r][q], wv[j][q], xb[r]);
            }
            for (int r = 0; r < R; ++r) {
                const float xsg = xs[(size_t)(m + r) * groups + gi];
                const __m512 sum = _mm512_set1_ps(xsg);
                const __m512 off = _mm512_set1_ps(128.0f * xsg);
                __m512* a = acc + (size_t)(m + r) * 4;
                for (int q = 0; q < 4; ++q) {
                    a[q] = _mm512_fmadd_ps(s[q], _mm512_sub_ps(ga[r][q], off), a[q]);
                    a[q] = _mm512_fmadd_ps(zs[q], sum, a[q]);
                }
            }
        };
        int m = 0;
        for (; m + 4 <= M; m += 4) rows(m, std::integral_constant<int, 4>{});
        for (; m < M; ++m) rows(m, std::integral_constant<int, 1>{});
    }
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (int m = 0; m < M; ++m) {
        const __m512* a = acc + (size_t)m * 4;
        float* ym = y + (size_t)m * ystride;
        _mm512_storeu_ps(ym, _mm512_permutex2var_ps(a[0], lo_idx, a[1]));
        _mm512_storeu_ps(ym + 16, _mm512_permutex2var_ps(a[0], hi_idx, a[1]));
        _mm512_storeu_ps(ym + 32, _mm512_permutex2var_ps(a[2], lo_idx, a[3]));
        _mm512_storeu_ps(ym + 48, _mm512_permutex2var_ps(a[2], hi_idx, a[3]));
    }
    delete[] acc;
}
#endif

#if defined(__AVX512BF16__)
// int4_tile_bf16 on R <= 4 rows (an expert's few tokens in a prefill): each pair of inputs' weights unpacked into
// registers once and dotted with every row at once — no unpacked copy of the tile (int4_tile_bf16_rows stores one:
// 64 vector stores a group, the most of a few rows' time) — each row's operations int4_tile_bf16's, in its order.
template <int R>
void int4_tile_bf16_few(const uint32_t* xp, const float* xs, int K, const uint8_t* tile, const uint16_t* sz, int N,
                        int row0, float* y, size_t ystride) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const int groups = K / 32;
    prefetch_scales(sz, groups, N, row0);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
    for (int gi = 0; gi < groups; ++gi) {
        __m512 ga[R][4];
        for (int r = 0; r < R; ++r)
            for (int q = 0; q < 4; ++q) ga[r][q] = _mm512_setzero_ps();
        const uint8_t* b = tile + (size_t)gi * 32 * 32;
        for (int j = 0; j < 16; ++j) {
            if (!(j & 1)) {
                _mm_prefetch((const char*)b + PREFETCH + 32 * j, _MM_HINT_T0);
                _mm_prefetch((const char*)b + PREFETCH + 512 + 32 * j, _MM_HINT_T0);
            }
            __m512bh w[4];
            unpack_pair_bf16(b, j, w);
            for (int r = 0; r < R; ++r) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[(size_t)r * (K / 2) + gi * 16 + j]);
                for (int q = 0; q < 4; ++q) ga[r][q] = _mm512_dpbf16_ps(ga[r][q], w[q], xb);
            }
        }
        __m512i v[4];
        group_scales(sz, gi, N, row0, v);
        for (int r = 0; r < R; ++r) {
            const float xsg = xs[(size_t)r * groups + gi];
            const __m512 sum = _mm512_set1_ps(xsg);
            const __m512 off = _mm512_set1_ps(128.0f * xsg);
            for (int q = 0; q < 4; ++q) {
                __m512 sq = _mm512_castsi512_ps(_mm512_slli_epi32(v[q], 16));
                __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v[q], hi16));
                acc[r][q] = _mm512_fmadd_ps(sq, _mm512_sub_ps(ga[r][q], off), acc[r][q]);
                acc[r][q] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sq, z), sum, acc[r][q]);
            }
        }
    }
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (int r = 0; r < R; ++r) {
        float* ym = y + (size_t)r * ystride;
        _mm512_storeu_ps(ym, _mm512_permutex2var_ps(acc[r][0], lo_idx, acc[r][1]));
        _mm512_storeu_ps(ym + 16, _mm512_permutex2var_ps(acc[r][0], hi_idx, acc[r][1]));
        _mm512_storeu_ps(ym + 32, _mm512_permutex2var_ps(acc[r][2], lo_idx, acc[r][3]));
        _mm512_storeu_ps(ym + 48, _mm512_permutex2var_ps(acc[r][2], hi_idx, acc[r][3]));
    }
}
#endif

// y [M, N] = x [M, K] · Wᵀ, row by row: each row of x computed exactly as a one-row call computes it (the same
// bf16 rounding, group sums and tile kernel), the tile loop outside so a tile's weights are read once for all M
// rows. int4_gemv is this with M = 1, so a row's bits do not depend on how many rows came with it (exact prefill).
void int4_gemv_rows(const float* x_in, int M, int K, const uint8_t* packed, const uint16_t* sz, int N, int g,
                    float* y, int threads) {
    const int groups = K / g;
    float* x = new float[(size_t)M * K];
    float* xs = new float[(size_t)M * groups + 1];
    for (int m = 0; m < M; ++m) {
        float* xm = x + (size_t)m * K;
        float* xsm = xs + (size_t)m * groups;
        for (int k = 0; k < K; ++k) xm[k] = bf16_round(x_in[(size_t)m * K + k]);
        for (int gi = 0; gi < groups; ++gi) {
            float s = 0.f;
            for (int k = gi * g; k < (gi + 1) * g; ++k) s += xm[k];
            xsm[gi] = s;
        }
    }
    const int tiles = N / 64;
#if defined(__AVX512BF16__)
    if (g == 32) {
        uint32_t* xp = new uint32_t[(size_t)M * (K / 2) + 1];
        for (int m = 0; m < M; ++m)
            for (int gi = 0; gi < K / 32; ++gi)
                for (int j = 0; j < 16; ++j) {
                    uint32_t a, b;
                    std::memcpy(&a, &x[(size_t)m * K + 32 * gi + j], 4);
                    std::memcpy(&b, &x[(size_t)m * K + 32 * gi + 16 + j], 4);
                    xp[(size_t)m * (K / 2) + 16 * gi + j] = (a >> 16) | (b & 0xffff0000u);
                }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int nb = 0; nb < tiles; ++nb) {
            const uint8_t* tile = packed + (size_t)nb * K * 32;
            if (M == 1)             // a decode step's GEMV
                int4_tile_bf16(xp, xs, K, tile, sz, N, nb * 64, y + nb * 64);
            else if (M <= 4)        // the same operations for each row, a few rows at once in registers
                (M == 2 ? int4_tile_bf16_few<2> : M == 3 ? int4_tile_bf16_few<3> : int4_tile_bf16_few<4>)(
                    xp, xs, K, tile, sz, N, nb * 64, y + nb * 64, N);
            else                    // the same operations for each row, the tile unpacked once for all of them
                int4_tile_bf16_rows(xp, xs, M, K, tile, sz, N, nb * 64, y + nb * 64, N);
            for (int m = 0; m < M; ++m)
                for (int r = nb * 64; r < nb * 64 + 64; ++r) y[(size_t)m * N + r] = bf16_round(y[(size_t)m * N + r]);
        }
        delete[] xp;
        delete[] x;
        delete[] xs;
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int nb = 0; nb < tiles; ++nb)
        for (int m = 0; m < M; ++m) {
            float* ym = y + (size_t)m * N;
            int4_tile(x + (size_t)m * K, xs + (size_t)m * groups, K, g, packed + (size_t)nb * K * 32, sz, N, nb * 64,
                      ym + nb * 64);
            for (int r = nb * 64; r < nb * 64 + 64; ++r) ym[r] = bf16_round(ym[r]);
        }
    delete[] x;
    delete[] xs;
}

void int4_gemv(const float* x_in, int K, const uint8_t* packed, const uint16_t* sz, int N, int g, float* y,
               int threads) {
    int4_gemv_rows(x_in, 1, K, packed, sz, N, g, y, threads);
}

// ---------------------------------------------------------------- GGML block types (engine.quant.ggml)

inline float fp16_to_float(uint16_t h) {    // exact, subnormals included
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {                                 // subnormal: renormalise
            int e = -1;
            uint32_t m = man;
            do { m <<= 1; ++e; } while (!(m & 0x400u));
            u = sign | uint32_t(127 - 15 - e) << 23 | (m & 0x3ffu) << 13;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | man << 13;
    } else {
        u = sign | (exp + 112u) << 23 | man << 13;
    }
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// A block's fp16 scale: F16C's conversion where there is one (exact too: every fp16 is an fp32, so the same values
// as fp16_to_float's, without its branches once a block in the GEMVs' inner loops).
inline float f16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return fp16_to_float(h);
#endif
}

constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct GgmlType { int block, size; };

// GGML type id -> (weights, bytes) a block; {0, 0}: a type Kiln has no kernel for.
inline GgmlType ggml_type(int t) {
    switch (t) {
        case 0: return {1, 4};     case 1: return {1, 2};     case 30: return {1, 2};
        case 2: return {32, 18};   case 3: return {32, 20};   case 6: return {32, 22};
        case 7: return {32, 24};   case 8: return {32, 34};   case 10: return {256, 84};
        case 11: return {256, 110}; case 12: return {256, 144}; case 13: return {256, 176};
        case 14: return {256, 210}; case 20: return {32, 18};  case 23: return {256, 136};
        default: return {0, 0};
    }
}

// q4_k / q5_k: sub-block j's 6-bit scale and min (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// q4_k / q5_k: all 8 sub-blocks' 6-bit scales and mins at once from the 12 packed bytes q (ggml's own word
// shuffle): sc[j], mn[j] equal scale_min_k4(j), in a few word operations instead of 8 calls' bit picking.
struct ScalesMinsK4 {
    uint8_t sc[8], mn[8];
    explicit ScalesMinsK4(const uint8_t* q) {
        constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
        uint32_t u[3];
        std::memcpy(u, q, 12);
        const uint32_t s[2] = {u[0] & k1, (u[2] & k2) | (((u[0] >> 6) & k3) << 4)};
        const uint32_t m[2] = {u[1] & k1, ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4)};
        std::memcpy(sc, s, 8);
        std::memcpy(mn, m, 8);
    }
};

// q3_k: its 16 6-bit scales, less 32, from the 12 packed bytes q (ggml's word shuffle; the same values as
// unpack_block's per-scale bit picking): sc[s] = (q[s % 8] >> 4·(s / 8) & 15 | (q[8 + s % 4] >> 2·(s / 4) & 3) << 4) - 32.
inline void scales_k3(const uint8_t* q, int8_t* sc) {
    constexpr uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f;
    uint32_t a[4];
    std::memcpy(a, q, 12);
    const uint32_t tmp = a[2];
    a[2] = ((a[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    a[3] = ((a[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    a[0] = (a[0] & k2) | ((tmp & k1) << 4);
    a[1] = (a[1] & k2) | (((tmp >> 2) & k1) << 4);
    uint8_t u[16];
    std::memcpy(u, a, 16);
    for (int s = 0; s < 16; ++s) sc[s] = int8_t(u[s] - 32);
}

// Weight i of a float-type row (f32, f16, bf16) at b.
inline float float_at(int t, const uint8_t* b, int i) {
    if (t == 0) {
        float v;
        std::memcpy(&v, b + 4 * (size_t)i, 4);
        return v;
    }
    uint16_t h;
    std::memcpy(&h, b + 2 * (size_t)i, 2);
    return t == 1 ? fp16_to_float(h) : bf16_to_float(h);
}

// A quantized block as int8 codes and a (scale, min) per sub-block of `sub` weights: w = sc[s]·q - mn[s]. Unpacking
// is byte work the compiler vectorizes; the dot product then costs what the int4 kernel's does (convert, FMA).
struct Unpacked {
    int8_t q[256];
    float sc[16], mn[16];
    int sub;
};

// 16 bytes of IQ4 nibbles → 32 code-book values (low nibbles first), by a table shuffle where there is SSSE3.
inline void iq4_codes(const uint8_t* b, int8_t* q) {
#if defined(__SSSE3__)
    const __m128i table = _mm_loadu_si128((const __m128i*)IQ4_NL_VALUES), low = _mm_set1_epi8(15);
    const __m128i v = _mm_loadu_si128((const __m128i*)b);
    _mm_storeu_si128((__m128i*)q, _mm_shuffle_epi8(table, _mm_and_si128(v, low)));
    _mm_storeu_si128((__m128i*)(q + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low)));
#else
    for (int r = 0; r < 16; ++r) {
        q[r] = IQ4_NL_VALUES[b[r] & 15];
        q[r + 16] = IQ4_NL_VALUES[b[r] >> 4];
    }
#endif
}

// 16 bytes → their low nibbles - off at lo[0..16), their high nibbles - off at hi[0..16).
inline void nibbles16(const uint8_t* b, int8_t* lo, int8_t* hi, int off) {
#if defined(__SSE2__)
    const __m128i v = _mm_loadu_si128((const __m128i*)b), low = _mm_set1_epi8(15), o = _mm_set1_epi8((char)off);
    _mm_storeu_si128((__m128i*)lo, _mm_sub_epi8(_mm_and_si128(v, low), o));
    _mm_storeu_si128((__m128i*)hi, _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low), o));
#else
    for (int r = 0; r < 16; ++r) {
        lo[r] = int8_t((b[r] & 15) - off);
        hi[r] = int8_t((b[r] >> 4) - off);
    }
#endif
}

inline void unpack_block(int t, const uint8_t* b, Unpacked& u) {
    int8_t* q = u.q;
    u.sub = 32;
    u.mn[0] = 0.f;
    switch (t) {
        case 2:                                       // q4_0
            u.sc[0] = f16_at(b);
            nibbles16(b + 2, q, q + 16, 8);
            return;
        case 20:                                      // iq4_nl
            u.sc[0] = f16_at(b);
            iq4_codes(b + 2, q);
            return;
        case 3:                                       // q4_1: w = d·q + m
            u.sc[0] = f16_at(b);
            u.mn[0] = -f16_at(b + 2);
            nibbles16(b + 4, q, q + 16, 0);
            return;
        case 6: case 7: {                             // q5_0, q5_1
            const bool one = t == 7;
            u.sc[0] = f16_at(b);
            if (one) u.mn[0] = -f16_at(b + 2);
            uint32_t qh;
            std::memcpy(&qh, b + (one ? 4 : 2), 4);
            const uint8_t* qs = b + (one ? 8 : 6);
            const int off = one ? 0 : 16;
            for (int j = 0; j < 16; ++j) {
                q[j] = int8_t(((qs[j] & 15) | ((qh >> j) & 1) << 4) - off);
                q[j + 16] = int8_t(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off);
            }
            return;
        }
        case 8:                                       // q8_0
            u.sc[0] = f16_at(b);
            std::memcpy(q, b + 2, 32);
            return;
        case 10: {                                    // q2_k
            const float d = f16_at(b + 80), dmin = f16_at(b + 82);
            u.sub = 16;
            for (int s = 0; s < 16; ++s) {
                u.sc[s] = d * float(b[s] & 15);
                u.mn[s] = dmin * float(b[s] >> 4);
            }
            for (int h = 0; h < 2; ++h)
                for (int sh = 0; sh < 4; ++sh)
                    for (int j = 0; j < 32; ++j) q[h * 128 + sh * 32 + j] = int8_t((b[16 + h * 32 + j] >> (2 * sh)) & 3);
            return;
        }
        case 11: {                                    // q3_k
            const float d = f16_at(b + 108);
            const uint8_t* sc = b + 96;
            u.sub = 16;
            for (int s = 0; s < 16; ++s) {
                const int lo = (sc[s % 8] >> (4 * (s / 8))) & 15, hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
                u.sc[s] = d * float((lo | hi << 4) - 32);
                u.mn[s] = 0.f;
            }
            for (int h = 0; h < 2; ++h)
                for (int sh = 0; sh < 4; ++sh)
                    for (int j = 0; j < 32; ++j) {
                        const int ql = (b[32 + h * 32 + j] >> (2 * sh)) & 3, bit = (b[j] >> (h * 4 + sh)) & 1;
                        q[h * 128 + sh * 32 + j] = int8_t(ql - (bit ? 0 : 4));
                    }
            return;
        }
        case 12: case 13: {                           // q4_k, q5_k
            const bool five = t == 13;
            const float d = f16_at(b), dmin = f16_at(b + 2);
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                scale_min_k4(j, b + 4, sc, m);
                u.sc[j] = d * float(sc);
                u.mn[j] = dmin * float(m);
            }
            const uint8_t* qs = b + (five ? 48 : 16);
            for (int c = 0; c < 4; ++c) {
                nibbles16(qs + 32 * c, q + 64 * c, q + 64 * c + 32, 0);
                nibbles16(qs + 32 * c + 16, q + 64 * c + 16, q + 64 * c + 48, 0);
            }
            if (five)
                for (int j = 0; j < 8; ++j)
                    for (int r = 0; r < 32; ++r) q[32 * j + r] = int8_t(q[32 * j + r] | ((b[16 + r] >> j) & 1) << 4);
            return;
        }
        case 14: {                                    // q6_k (ggml's dequantize_row_q6_K order)
            const float d = f16_at(b + 208);
            u.sub = 16;
            for (int s = 0; s < 16; ++s) {
                u.sc[s] = d * float(int8_t(b[192 + s]));
                u.mn[s] = 0.f;
            }
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                int8_t* o = q + 128 * h;
                for (int l = 0; l < 32; ++l) {
                    o[l] = int8_t(((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32);
                    o[l + 32] = int8_t(((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
                    o[l + 64] = int8_t(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
                    o[l + 96] = int8_t(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
                }
            }
            return;
        }
        case 23: {                                    // iq4_xs
            const float d = f16_at(b);
            uint16_t sh;
            std::memcpy(&sh, b + 2, 2);
            for (int j = 0; j < 8; ++j) {
                const int ls = (b[4 + j / 2] >> (4 * (j % 2))) & 15, hs = (sh >> (2 * j)) & 3;
                u.sc[j] = d * float((ls | hs << 4) - 32);
                u.mn[j] = 0.f;
                iq4_codes(b + 8 + 16 * j, q + 32 * j);
            }
            return;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// Σ_i w_i·x_i over one unpacked block of `n` weights, Σ_s sc[s]·(Σ q·x) - mn[s]·xs[s] (xs: x's sums per 16): the
// scaled products into acc (summed once a row, not once a block), the mins' part into mins.
#if defined(__AVX2__) && defined(__FMA__)
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline float acc_sum(Acc a) { return hsum(a); }
#else
using Acc = float;
inline Acc acc_zero() { return 0.f; }
inline float acc_sum(Acc a) { return a; }
#endif

inline void dot_unpacked(const Unpacked& u, const float* x, const float* xs16, int n, Acc& acc, float& mins) {
    const int per16 = u.sub / 16;
    for (int s = 0; s * u.sub < n; ++s) {
#if defined(__AVX2__) && defined(__FMA__)
        __m256 v = _mm256_setzero_ps();
        for (int i = s * u.sub; i < (s + 1) * u.sub; i += 8) {
            const __m128i q8 = _mm_loadl_epi64((const __m128i*)(u.q + i));
            v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), _mm256_loadu_ps(x + i), v);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(u.sc[s]), v, acc);
#else
        float v = 0.f;
        for (int i = s * u.sub; i < (s + 1) * u.sub; ++i) v += float(u.q[i]) * x[i];
        acc += u.sc[s] * v;
#endif
        if (u.mn[s] != 0.f) mins += u.mn[s] * (per16 == 2 ? xs16[2 * s] + xs16[2 * s + 1] : xs16[s]);
    }
}

inline bool is_float_type(int t) { return t == 0 || t == 1 || t == 30; }

// Σ w·x over n float-type weights (f32, f16, bf16) at b.
inline float dot_float(int t, const uint8_t* b, const float* x, int n) {
    int i = 0;
    float tail = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 w;
        if (t == 0) {
            w = _mm256_loadu_ps((const float*)b + i);
        } else if (t == 30) {
            w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(b + 2 * i))), 16));
        } else {
#if defined(__F16C__)
            w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 2 * i)));
#else
            float tmp[8];
            for (int j = 0; j < 8; ++j) tmp[j] = f16_at(b + 2 * (i + j));
            w = _mm256_loadu_ps(tmp);
#endif
        }
        acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + i), acc);
    }
    tail = hsum(acc);
#endif
    for (; i < n; ++i) tail += float_at(t, b, i) * x[i];
    return tail;
}

constexpr int GGML_ROWS = 16;        // rows of x an unpacked block is dotted with before the next chunk of x

// ---------------------------------------------------------------- one-token dense GEMV (issue 29: a GGUF's own blocks)
// The decode step's dense projections (attention, vocabulary, shared experts, a routed expert's matrices) multiply one
// row of x: the blocks are unpacked straight into registers (no Unpacked buffer), 16 codes widened to fp32 at a time,
// multiplied by x in fp32 and scaled per sub-block, round-robin over four accumulators so no FMA waits for the last.
// The same products as gguf's dequantization then an fp32 matmul (x is not rounded), another summation order.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KILN_GEMV512 1
struct Acc4 {
    const float* x;           // the row's inputs
    const float* xs16;        // their sums per 16 and per 32 (for the blocks' mins)
    const float* xs32;
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int i = 0;
    Acc4(const float* x_, const float* xs16_, const float* xs32_) : x(x_), xs16(xs16_), xs32(xs32_) {}
    // acc += scale · Σ q·x over 16 codes (int8 in the low 16 bytes of q) and inputs k0..k0+15
    inline void add16(__m128i q, int k0, float scale) {
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_loadu_ps(x + k0));
        a[i & 3] = _mm512_fmadd_ps(_mm512_set1_ps(scale), v, a[i & 3]);
        ++i;
    }
    // two sub-blocks of 16 (32 codes q, inputs k0..k0+31), scales s0 and s1
    inline void add16x2(__m256i q, int k0, float s0, float s1) {
        add16(_mm256_castsi256_si128(q), k0, s0);
        add16(_mm256_extracti128_si256(q, 1), k0 + 16, s1);
    }
    // acc += scale · Σ q·x over 32 codes (q) and inputs k0..k0+31: one sub-block of one scale
    inline void add32(__m256i q, int k0, float scale) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), _mm512_loadu_ps(x + k0));
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), _mm512_loadu_ps(x + k0 + 16), v);
        a[i & 3] = _mm512_fmadd_ps(_mm512_set1_ps(scale), v, a[i & 3]);
        ++i;
    }
    inline void add32u(__m256i q, int k0, float scale) { add32(q, k0, scale); }
    // codes q less `off` (q4_0's 8, q5_0's 16), subtracted first
    inline void add32_off(__m256i q, int k0, float scale, int off) {
        add32(_mm256_sub_epi8(q, _mm256_set1_epi8((char)off)), k0, scale);
    }
    inline void add16x2_off(__m256i q, int k0, float s0, float s1, int off) {
        add16x2(_mm256_sub_epi8(q, _mm256_set1_epi8((char)off)), k0, s0, s1);
    }
    // the blocks' mins: Σ coef·(x's sum over a 32, or over two 16s), summed apart and added or taken off at the end
    float mins = 0.f;
    inline void min32(int b, float coef) { mins += coef * xs32[b]; }
    inline void min16x2(int g, float d, float m0, float m1) { mins += d * (m0 * xs16[g] + m1 * xs16[g + 1]); }
    inline float sum() const {
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    }
    inline float result(int sign) const { return sign > 0 ? sum() + mins : sign < 0 ? sum() - mins : sum(); }
};

// Acc4 for R rows of x at once (a prefill's rows): each block's codes widened once, then each row's products and
// accumulators exactly as Acc4's, so each row gets gemv512_row's bits for it; result() writes out[m·stride].
template <int R>
struct AccRows {
    const float* x[R];
    const float* xs16[R];
    const float* xs32[R];
    float* out;
    size_t stride;
    __m512 a[R][4];
    float mins[R];
    int i = 0;
    AccRows(const float* x0, const float* xs16_0, const float* xs32_0, int K, float* out_, size_t stride_)
        : out(out_), stride(stride_) {
        for (int m = 0; m < R; ++m) {
            x[m] = x0 + (size_t)m * K, xs16[m] = xs16_0 + (size_t)m * (K / 16), xs32[m] = xs32_0 + (size_t)m * (K / 32);
            for (int j = 0; j < 4; ++j) a[m][j] = _mm512_setzero_ps();
            mins[m] = 0.f;
        }
    }
    // Acc4's round robin, kept in registers: each add goes to a[m][0], then the four rotate (a[m][p] holds Acc4's
    // accumulator (p + i) & 3), so no accumulator is indexed at run time
    inline void rotate() {
        for (int m = 0; m < R; ++m) {
            const __m512 t = a[m][0];
            a[m][0] = a[m][1], a[m][1] = a[m][2], a[m][2] = a[m][3], a[m][3] = t;
        }
        ++i;
    }
    inline void add16(__m128i q, int k0, float scale) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), sc = _mm512_set1_ps(scale);
        for (int m = 0; m < R; ++m) a[m][0] = _mm512_fmadd_ps(sc, _mm512_mul_ps(w, _mm512_loadu_ps(x[m] + k0)), a[m][0]);
        rotate();
    }
    inline void add16x2(__m256i q, int k0, float s0, float s1) {
        add16(_mm256_castsi256_si128(q), k0, s0);
        add16(_mm256_extracti128_si256(q, 1), k0 + 16, s1);
    }
    inline void add32(__m256i q, int k0, float scale) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
        const __m512 sc = _mm512_set1_ps(scale);
        for (int m = 0; m < R; ++m) {
            const __m512 v = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[m] + k0 + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(x[m] + k0)));
            a[m][0] = _mm512_fmadd_ps(sc, v, a[m][0]);
        }
        rotate();
    }
    inline void add32u(__m256i q, int k0, float scale) { add32(q, k0, scale); }
    inline void add32_off(__m256i q, int k0, float scale, int off) {
        add32(_mm256_sub_epi8(q, _mm256_set1_epi8((char)off)), k0, scale);
    }
    inline void add16x2_off(__m256i q, int k0, float s0, float s1, int off) {
        add16x2(_mm256_sub_epi8(q, _mm256_set1_epi8((char)off)), k0, s0, s1);
    }
    inline void min32(int b, float coef) {
        for (int m = 0; m < R; ++m) mins[m] += coef * xs32[m][b];
    }
    inline void min16x2(int g, float d, float m0, float m1) {
        for (int m = 0; m < R; ++m) mins[m] += d * (m0 * xs16[m][g] + m1 * xs16[m][g + 1]);
    }
    inline float result(int sign) {
        const int r = (4 - (i & 3)) & 3;                        // Acc4's accumulator j is at a[m][(j + r) & 3]
        for (int m = 0; m < R; ++m) {
            const __m512 a0 = a[m][r], a1 = a[m][(1 + r) & 3], a2 = a[m][(2 + r) & 3], a3 = a[m][(3 + r) & 3];
            const float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
            out[m * stride] = sign > 0 ? s + mins[m] : sign < 0 ? s - mins[m] : s;
        }
        return 0.f;
    }
};

// 16 bytes → 32 codes: the low nibbles (weights 0..15), then the high ones (16..31), as ggml's 32-blocks order them
inline __m256i nibbles32(const uint8_t* b) {
    const __m128i v = _mm_loadu_si128((const __m128i*)b), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

// 32 bytes → their low nibbles (32 codes) and their high nibbles (32 codes)
inline void nibbles64(const uint8_t* b, __m256i& lo, __m256i& hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)b), low = _mm256_set1_epi8(15);
    lo = _mm256_and_si256(v, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

// Σ w·x over one row of K weights of type t (one of gemv512_type's): the blocks' codes made in registers and handed
// to the accumulator A with their scales — Acc4 (x in fp32, gemv512_row) or AccQ8 (x rounded to 8 bits, q8_row).
// The type is a template argument, so each type's block loop is its own code (no type tests inside it). The row
// functions are always inlined into their loops: left to the compiler, a fourth caller (the lane's ggml_row1) made it
// call them out of line, and the float GEMVs lost up to 22 % (Q6_K; bench.ggml_gemv_speed).
template <int t, class A>
inline __attribute__((always_inline)) float row512_t(const uint8_t* row, A& acc, int K) {
    if constexpr (t == 2 || t == 3 || t == 6 || t == 7 || t == 8) {    // q4_0, q4_1, q5_0, q5_1, q8_0: 32-weight blocks
        const int size = t == 2 ? 18 : t == 3 ? 20 : t == 6 ? 22 : t == 7 ? 24 : 34;
        for (int bi = 0; bi < K / 32; ++bi) {
            const uint8_t* b = row + (size_t)bi * size;
            const float d = f16_at(b);
            __m256i q;
            if (t == 8) {                          // signed codes
                acc.add32(_mm256_loadu_si256((const __m256i*)(b + 2)), 32 * bi, d);
            } else if (t == 2 || t == 3) {         // codes 0..15, less 8 for q4_0
                q = nibbles32(b + (t == 2 ? 2 : 4));
                if (t == 2) acc.add32_off(q, 32 * bi, d, 8);
                else acc.add32u(q, 32 * bi, d);
            } else {                               // codes 0..31, less 16 for q5_0
                uint32_t qh;
                std::memcpy(&qh, b + (t == 6 ? 2 : 4), 4);
                q = _mm256_or_si256(nibbles32(b + (t == 6 ? 6 : 8)),
                                    _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(16)));
                if (t == 6) acc.add32_off(q, 32 * bi, d, 16);
                else acc.add32u(q, 32 * bi, d);
            }
            if (t == 3 || t == 7) acc.min32(bi, f16_at(b + 2));
        }
        return acc.result(1);
    } else if constexpr (t == 12 || t == 13) {    // q4_k, q5_k: 8 sub-blocks of 32, 6-bit (scale, min)
        const bool five = t == 13;
        const int size = five ? 176 : 144;
        for (int bi = 0; bi < K / 256; ++bi) {
            const uint8_t* b = row + (size_t)bi * size;
            const float d = f16_at(b), dmin = f16_at(b + 2);
            // q4_k's scales unpacked all at once (+13-17 %); q5_k's one by one (the word form was 7 % slower
            // there, its fifth bits' masks holding the registers)
            const ScalesMinsK4 sm(b + 4);
            auto scale_min = [&](int j, int& sc, int& m) {
                if (five) {
                    scale_min_k4(j, b + 4, sc, m);
                } else {
                    sc = sm.sc[j];
                    m = sm.mn[j];
                }
            };
            const uint8_t* qs = b + (five ? 48 : 16);
            uint32_t qh[8];
            if (five) {                            // bit j of byte r: sub-block j's weight r, fifth bit
                for (int j = 0; j < 8; ++j)
                    qh[j] = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(
                        _mm256_loadu_si256((const __m256i*)(b + 16)), 7 - j));
            }
            for (int c = 0; c < 4; ++c) {
                __m256i lo, hi;
                nibbles64(qs + 32 * c, lo, hi);
                if (five) {
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_movm_epi8(qh[2 * c]), _mm256_set1_epi8(16)));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_movm_epi8(qh[2 * c + 1]), _mm256_set1_epi8(16)));
                }
                int sc, m;
                scale_min(2 * c, sc, m);
                acc.add32u(lo, 256 * bi + 64 * c, d * float(sc));
                acc.min32(8 * bi + 2 * c, dmin * float(m));
                scale_min(2 * c + 1, sc, m);
                acc.add32u(hi, 256 * bi + 64 * c + 32, d * float(sc));
                acc.min32(8 * bi + 2 * c + 1, dmin * float(m));
            }
        }
        return acc.result(-1);
    } else if constexpr (t == 14) {    // q6_k: 16 sub-blocks of 16, int8 scales
        const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
        for (int bi = 0; bi < K / 256; ++bi) {
            const uint8_t* b = row + (size_t)bi * 210;
            const float d = f16_at(b + 208);
            const int8_t* sc = (const int8_t*)(b + 192);
            for (int h = 0; h < 2; ++h) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
                const __m256i q[4] = {             // codes 0..63, less 32
                    _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), two), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), two), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), two), 4))};
                const int kb = 256 * bi + 128 * h;
                for (int g = 0; g < 4; ++g)         // 32 weights l + 32g: sub-blocks 8h + 2g and 8h + 2g + 1
                    acc.add16x2_off(q[g], kb + 32 * g, d * float(sc[8 * h + 2 * g]), d * float(sc[8 * h + 2 * g + 1]), 32);
            }
        }
        return acc.result(0);
    } else if constexpr (t == 10) {    // q2_k: 16 sub-blocks of 16, 4-bit (scale, min), 2-bit codes
        for (int bi = 0; bi < K / 256; ++bi) {
            const uint8_t* b = row + (size_t)bi * 84;
            const float d = f16_at(b + 80), dmin = f16_at(b + 82);
            for (int h = 0; h < 2; ++h) {          // weights 128h + 32j + l: bits 2j of qs[32h + l]
                const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * h));
                for (int j = 0; j < 4; ++j) {
                    const int s = 8 * h + 2 * j, k0 = 256 * bi + 128 * h + 32 * j;
                    acc.add16x2(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)), k0,
                                d * float(b[s] & 15), d * float(b[s + 1] & 15));
                    acc.min16x2(k0 / 16, dmin, float(b[s] >> 4), float(b[s + 1] >> 4));
                }
            }
        }
        return acc.result(-1);
    } else if constexpr (t == 11) {    // q3_k: 16 sub-blocks of 16, 6-bit scales less 32, codes 0..3 less 4 unless hmask
        for (int bi = 0; bi < K / 256; ++bi) {
            const uint8_t* b = row + (size_t)bi * 110;
            const float d = f16_at(b + 108);
            int8_t sc[16];
            scales_k3(b + 96, sc);
            const __m256i hm = _mm256_loadu_si256((const __m256i*)b), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
            for (int h = 0; h < 2; ++h) {          // weights 128h + 32j + l: bits 2j of qs[32h + l], hmask bit 4h + j of byte l
                const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 32 + 32 * h));
                for (int j = 0; j < 4; ++j) {
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), three);
                    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one);
                    const __m256i code = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
                    const int s = 8 * h + 2 * j;
                    acc.add16x2(code, 256 * bi + 128 * h + 32 * j, d * float(sc[s]), d * float(sc[s + 1]));
                }
            }
        }
        return acc.result(0);
    } else if constexpr (t == 20 || t == 23) {    // iq4_nl (32-blocks), iq4_xs (8 sub-blocks of 32, 6-bit scales less 32)
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_NL_VALUES));
        if constexpr (t == 20) {
            for (int bi = 0; bi < K / 32; ++bi) {
                const uint8_t* b = row + (size_t)bi * 18;
                acc.add32(_mm256_shuffle_epi8(lut, nibbles32(b + 2)), 32 * bi, f16_at(b));
            }
        } else {
            for (int bi = 0; bi < K / 256; ++bi) {
                const uint8_t* b = row + (size_t)bi * 136;
                const float d = f16_at(b);
                uint16_t sh;
                std::memcpy(&sh, b + 2, 2);
                for (int j = 0; j < 8; ++j) {
                    const int ls = (b[4 + j / 2] >> (4 * (j % 2))) & 15, hs = (sh >> (2 * j)) & 3;
                    acc.add32(_mm256_shuffle_epi8(lut, nibbles32(b + 8 + 16 * j)), 256 * bi + 32 * j,
                              d * float((ls | hs << 4) - 32));
                }
            }
        }
        return acc.result(0);
    }
    return 0.f;
}

template <class A>
inline __attribute__((always_inline)) float row512(int t, const uint8_t* row, A& acc, int K) {
    switch (t) {
        case 2: return row512_t<2>(row, acc, K);
        case 3: return row512_t<3>(row, acc, K);
        case 6: return row512_t<6>(row, acc, K);
        case 7: return row512_t<7>(row, acc, K);
        case 8: return row512_t<8>(row, acc, K);
        case 12: return row512_t<12>(row, acc, K);
        case 13: return row512_t<13>(row, acc, K);
        case 14: return row512_t<14>(row, acc, K);
        case 10: return row512_t<10>(row, acc, K);
        case 11: return row512_t<11>(row, acc, K);
        case 20: return row512_t<20>(row, acc, K);
        case 23: return row512_t<23>(row, acc, K);
    }
    return 0.f;
}

inline bool gemv512_type(int t) { return ggml_type(t).block > 1; }       // every quantized type Kiln reads

// Σ w·x over one row, x in fp32; xs16, xs32: x's sums per 16 and per 32 inputs (for the mins).
inline __attribute__((always_inline)) float gemv512_row(int t, const uint8_t* row, const float* x, const float* xs16,
                                                        const float* xs32, int K) {
    Acc4 acc(x, xs16, xs32);
    return row512(t, row, acc, K);
}
#endif

// ---------------------------------------------------------------- int8 activations (opt-in: --cpu-activations int8)
// llama.cpp's way of computing a GGUF's blocks on a CPU: x rounded once to 8 bits as ggml-cpu rounds it for the
// weights' type (its vec_dot_type, in its x86 code), integer dot products of the weights' codes with those 8 bits,
// scaled in fp32:
//   Q8_0 (q4_0, q5_0, q8_0, iq4_nl)  per 32 inputs: a = max|x|, d = fp16(a/127), q = nearest-even(x·(127/a));
//   Q8_1 (q4_1, q5_1)                Q8_0's q and d, and s = fp16((a/127)·Σq), the sum a block's min multiplies;
//   Q8_K (the K-quants, iq4_xs)      per 256 inputs: m = the first x of largest |x|, q = min(127, nearest-even(x·i)),
//                                    i = -127/m, d = 1/i in fp32; its Σq per 16.
// So y = W·x̂ (a Q8_1 block's min times s rather than Σx̂), W gguf's dequantization and x̂ = d·q
// (engine.kernels.native.q8_reference is that function): not the float path's y = W·x, which is why it is a mode a
// model is loaded with (EngineConfig.cpu_activations), set around its passes (native.allow) and read by every GGUF
// GEMV here, whatever M (a prefill row keeps a decode step's bits).
int g_int8_activations = 0;

enum Q8Kind { Q8_0 = 0, Q8_1 = 1, Q8_K = 2 };
inline int q8_kind(int t) { return t == 3 || t == 7 ? Q8_1 : (t >= 10 && t <= 14) || t == 23 ? Q8_K : Q8_0; }

inline float fp16_round(float v) {           // to the nearest fp16, ties to even (GGML_CPU_FP32_TO_FP16), and back
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(v, 0));
#else
    uint32_t w;                              // ggml's ggml_compute_fp32_to_fp16, for a CPU without F16C
    std::memcpy(&w, &v, 4);
    float base = (std::fabs(v) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bb = (bias >> 1) + 0x07800000u;
    float fb;
    std::memcpy(&fb, &bb, 4);
    base = fb + base;
    uint32_t bits;
    std::memcpy(&bits, &base, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return fp16_to_float(uint16_t((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign)));
#endif
}

// x [K] (K % 32 == 0) as Q8_0 / Q8_1: codes q [K], d [K/32], Σq per 16 s16 [K/16], and per 32 the sums a block's min
// or offset multiplies: xs0 = d·Σq (Q8_0's), xs1 = s (Q8_1's).
inline void quantize_q8_32(const float* x, int K, int8_t* q, float* d, int16_t* s16, float* xs0, float* xs1) {
    for (int b = 0; b < K / 32; ++b) {
        const float* xb = x + 32 * b;
#if defined(__AVX512F__)
        // the scalar loop's operations, 16 at a time: x·id one multiply, rounded to nearest even
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d32 = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128((__m128i*)(q + 32 * b), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
        const int sa = _mm512_reduce_add_epi32(i0), sb = _mm512_reduce_add_epi32(i1), total = sa + sb;
        s16[2 * b] = (int16_t)sa;
        s16[2 * b + 1] = (int16_t)sb;
#else
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d32 = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        int total = 0;
        for (int h = 0; h < 2; ++h) {
            int sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; ++i) {
                const int v = (int)std::nearbyint(xb[i] * id);
                q[32 * b + i] = (int8_t)v;
                sum += v;
            }
            s16[2 * b + h] = (int16_t)sum;
            total += sum;
        }
#endif
        d[b] = fp16_round(d32);
        xs0[b] = d[b] * float(total);
        xs1[b] = fp16_round(d32 * float(total));
    }
}

// x [K] (K % 256 == 0) as Q8_K: codes q [K], d [K/32] (each 256's scale, once per 32 inputs, so a 32-block kernel
// reads it as it reads Q8_0's), Σq per 16 s16 [K/16], xs [K/32] = d·Σq per 32.
inline void quantize_q8_k(const float* x, int K, int8_t* q, float* d, int16_t* s16, float* xs) {
    for (int b = 0; b < K / 256; ++b) {
        const float* xb = x + 256 * b;
        float amax = 0.f, m = 0.f;
#if defined(__AVX512F__)
        __m512 mx = _mm512_setzero_ps();
        for (int g = 0; g < 16; ++g) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * g)));
        amax = _mm512_reduce_max_ps(mx);
        for (int g = 0; amax != 0.f && g < 16; ++g) {     // the first x of largest |x|, as the scalar scan finds it
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * g)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) {
                m = xb[16 * g + __builtin_ctz(at)];
                break;
            }
        }
#else
        for (int i = 0; i < 256; ++i) {
            const float ax = std::fabs(xb[i]);
            if (ax > amax) {
                amax = ax;
                m = xb[i];
            }
        }
#endif
        const float is = amax != 0.f ? -127.f / m : 0.f, db = amax != 0.f ? 1.f / is : 0.f;
#if defined(__AVX512F__)
        const __m512 vis = _mm512_set1_ps(is);
        for (int g = 0; g < 16; ++g) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), vis),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i*)(q + 256 * b + 16 * g), _mm512_cvtsepi32_epi8(v));
            s16[16 * b + g] = (int16_t)_mm512_reduce_add_epi32(v);
        }
#else
        for (int i = 0; i < 256; ++i) q[256 * b + i] = (int8_t)std::min(127, (int)std::nearbyint(is * xb[i]));
        for (int g = 0; g < 16; ++g) {
            int sum = 0;
            for (int i = 0; i < 16; ++i) sum += q[256 * b + 16 * g + i];
            s16[16 * b + g] = (int16_t)sum;
        }
#endif
        for (int j = 0; j < 8; ++j) {
            d[8 * b + j] = db;
            xs[8 * b + j] = db * float(s16[16 * b + 2 * j] + s16[16 * b + 2 * j + 1]);
        }
    }
}

struct Q8x { const int8_t* q; const float* d; const int16_t* s16; const float* xs; };   // xs: what a min multiplies

// One rounding of x, each row on its own (so a row's bits do not depend on the rows beside it).
struct Q8Plane {
    std::vector<int8_t> q;
    std::vector<float> d, xs;
    std::vector<int16_t> s16;
};

// M rows of x [M, K] rounded as the kinds in `kinds` (bit k: Q8Kind k) need; Q8_K only where K % 256 == 0.
struct Q8Rows {
    int K;
    Q8Plane p32, pk;
    std::vector<float> xs1;                  // Q8_1's s, beside Q8_0's plane (the same q and d)
    Q8Rows(const float* x, int M, int K_, int kinds) : K(K_) {
        if (kinds & 3) {
            p32.q.resize((size_t)M * K), p32.d.resize((size_t)M * K / 32), p32.xs.resize((size_t)M * K / 32);
            p32.s16.resize((size_t)M * K / 16), xs1.resize((size_t)M * K / 32);
            for (int m = 0; m < M; ++m)
                quantize_q8_32(x + (size_t)m * K, K, &p32.q[(size_t)m * K], &p32.d[(size_t)m * K / 32],
                               &p32.s16[(size_t)m * K / 16], &p32.xs[(size_t)m * K / 32], &xs1[(size_t)m * K / 32]);
        }
        if ((kinds & 4) && K % 256 == 0) {
            pk.q.resize((size_t)M * K), pk.d.resize((size_t)M * K / 32), pk.xs.resize((size_t)M * K / 32);
            pk.s16.resize((size_t)M * K / 16);
            for (int m = 0; m < M; ++m)
                quantize_q8_k(x + (size_t)m * K, K, &pk.q[(size_t)m * K], &pk.d[(size_t)m * K / 32],
                              &pk.s16[(size_t)m * K / 16], &pk.xs[(size_t)m * K / 32]);
        }
    }
    // row m as the weight type t's kernels read it
    Q8x row(int m, int t) const {
        const int kind = q8_kind(t);
        const Q8Plane& p = kind == Q8_K ? pk : p32;
        const float* xs = kind == Q8_1 ? &xs1[(size_t)m * K / 32] : &p.xs[(size_t)m * K / 32];
        return {&p.q[(size_t)m * K], &p.d[(size_t)m * K / 32], &p.s16[(size_t)m * K / 16], xs};
    }
};

inline int q8_kinds_of(const int* types, int n) {
    int kinds = 0;
    for (int i = 0; i < n; ++i) kinds |= 1 << q8_kind(types[i]);
    return kinds;
}

// Any quantized type, any CPU: a block unpacked (unpack_block: w = sc·q - mn per sub-block), Σ q·qx per sub-block in
// int32, scaled in fp32; a 32-weight sub-block's min times x's xs (Q8_1's s), a 16-weight one's times d·Σq.
inline float q8_row_generic(int t, const uint8_t* row, const Q8x& x, int K) {
    const GgmlType gt = ggml_type(t);
    Unpacked u;
    float acc = 0.f, mins = 0.f;
    for (int bi = 0; bi < K / gt.block; ++bi) {
        unpack_block(t, row + (size_t)bi * gt.size, u);
        for (int s = 0; s * u.sub < gt.block; ++s) {
            const int k = bi * gt.block + s * u.sub;
            int dot = 0;
            for (int i = 0; i < u.sub; ++i) dot += int(u.q[s * u.sub + i]) * int(x.q[k + i]);
            const float dx = x.d[k / 32];
            acc += u.sc[s] * dx * float(dot);
            if (u.mn[s] != 0.f) mins += u.mn[s] * (u.sub == 32 ? x.xs[k / 32] : dx * float(x.s16[k / 16]));
        }
    }
    return acc - mins;
}

#ifdef KILN_GEMV512
// Σ over each 4 bytes of w·x, both signed (|w| <= 128): |w| · sign(x, w), u8 × s8 (llama.cpp's trick), by VNNI where
// the CPU has it, else pmaddubsw (pairs <= 2·128·127: no saturation) and pmaddwd: the same integers either way.
inline __m256i dot_u8s8x32(__m256i w, __m256i x) {           // w unsigned (0..128), x signed
#if defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}
inline __m256i dot_s8x32(__m256i w, __m256i x) { return dot_u8s8x32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

// row512's accumulator for the 32-weight blocks (Q8_0 / Q8_1 of x), for R rows of x̂ at once (a prefill's; R = 1:
// AccQ8, a decode step's): a block's integer dot times (its scale · x's), the weights' side of it (|w| for signed
// codes) made once for all R rows, each row's operations those of R = 1 (the same bits). result() returns row 0's
// value and, given out, writes every row's to out[m·stride].
template <int R>
struct AccQ8R {
    Q8x x[R];
    __m256 a[R];                        // one accumulator a row: a dynamic index into several keeps them in memory
    float corr[R];                      // the codes' offsets times x̂'s sums, subtracted at the end
    float mins[R];                      // the blocks' mins, as Acc4's
    float* out;
    size_t stride;
    explicit AccQ8R(const Q8x* x_, float* out_ = nullptr, size_t stride_ = 0) : out(out_), stride(stride_) {
        for (int m = 0; m < R; ++m) x[m] = x_[m], a[m] = _mm256_setzero_ps(), corr[m] = 0.f, mins[m] = 0.f;
    }
    inline void fma(int m, __m256 scale, __m256i p) { a[m] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), a[m]); }
    inline __m256i qx(int m, int k0) const { return _mm256_loadu_si256((const __m256i*)(x[m].q + k0)); }
    inline void add32(__m256i w, int k0, float scale) {          // signed codes: |w| · sign(x, w), as dot_s8x32
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int m = 0; m < R; ++m)
            fma(m, _mm256_set1_ps(scale * x[m].d[k0 / 32]), dot_u8s8x32(aw, _mm256_sign_epi8(qx(m, k0), w)));
    }
    inline void add32u(__m256i w, int k0, float scale) {         // codes 0..127
        for (int m = 0; m < R; ++m) fma(m, _mm256_set1_ps(scale * x[m].d[k0 / 32]), dot_u8s8x32(w, qx(m, k0)));
    }
    inline void add32_off(__m256i w, int k0, float scale, int off) {
        add32u(w, k0, scale);
        for (int m = 0; m < R; ++m) corr[m] += scale * float(off) * x[m].xs[k0 / 32];
    }
    // signed codes, two sub-blocks of 16 (inputs k0..k0+15 with scale s0, the next 16 with s1)
    inline void add16x2(__m256i w, int k0, float s0, float s1) {
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int m = 0; m < R; ++m) {
            const float dx = x[m].d[k0 / 32];
            fma(m, _mm256_setr_m128(_mm_set1_ps(s0 * dx), _mm_set1_ps(s1 * dx)),
                dot_u8s8x32(aw, _mm256_sign_epi8(qx(m, k0), w)));
        }
    }
    inline void add16x2_off(__m256i w, int k0, float s0, float s1, int off) {      // codes 0..127 less off
        for (int m = 0; m < R; ++m) {
            const float dx = x[m].d[k0 / 32];
            const __m256i q = qx(m, k0);
            const __m256i p = _mm256_sub_epi32(dot_u8s8x32(w, q), dot_u8s8x32(_mm256_set1_epi8((char)off), q));
            fma(m, _mm256_setr_m128(_mm_set1_ps(s0 * dx), _mm_set1_ps(s1 * dx)), p);
        }
    }
    inline void min32(int b, float coef) {
        for (int m = 0; m < R; ++m) mins[m] += coef * x[m].xs[b];
    }
    inline void min16x2(int g, float d, float m0, float m1) {
        for (int m = 0; m < R; ++m)
            mins[m] += d * (m0 * (x[m].d[g / 2] * float(x[m].s16[g])) + m1 * (x[m].d[g / 2] * float(x[m].s16[g + 1])));
    }
    inline float result(int sign) {
        float v0 = 0.f;
        for (int m = 0; m < R; ++m) {
            const float s = hsum(a[m]) - corr[m], v = sign > 0 ? s + mins[m] : sign < 0 ? s - mins[m] : s;
            if (out) out[m * stride] = v;
            if (m == 0) v0 = v;
        }
        return v0;
    }
};
using AccQ8 = AccQ8R<1>;

// The K-quants against Q8_K, ggml's vec_dot_qN_K_q8_K: per 256 weights the integer Σ_s sc_s·(q·q8) (and the mins'
// Σ_s m_s·Σq8, or q6_k's offset 32·Σ_s sc_s·Σq8), then one fp32 multiply-add by d8·d. 64 codes a step in a zmm:
// pmaddubsw (codes 0..63 × int8: pairs within int16) then pmaddwd by the sub-blocks' scales as int16.
inline __m512i idx_pairs16(int a, int width) {    // int16 lanes: `width` lanes of a, then of a+1, ... (32 lanes)
    alignas(64) int16_t v[32];
    for (int i = 0; i < 32; ++i) v[i] = int16_t(a + i / width);
    return _mm512_load_si512((const void*)v);
}

// Each kernel takes R rows of x̂ at once (a prefill's; R = 1: a decode step's), the weights' side made once for all of
// them and each row's operations those of R = 1 (the same bits); out[m·stride] gets row m's Σ w·x̂.
template <int t, int R>                            // 12 q4_k, 13 q5_k: 8 sub-blocks of 32, 6-bit (scale, min)
inline __attribute__((always_inline)) void qk45_q8k_rows(const uint8_t* row, const Q8x* x, int K, float* out, size_t stride) {
    constexpr bool five = t == 13;
    constexpr int size = five ? 176 : 144;
    const __m512i low = _mm512_set1_epi8(15), halves = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i pick[4] = {idx_pairs16(0, 16), idx_pairs16(2, 16), idx_pairs16(4, 16), idx_pairs16(6, 16)};
    __m256 acc[R], accm[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps(), accm[m] = _mm256_setzero_ps();
    for (int bi = 0; bi < K / 256; ++bi) {
        const uint8_t* b = row + (size_t)bi * size;
        const ScalesMinsK4 sm(b + 4);
        const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)sm.sc)));
        const __m128i mn8 = _mm_loadl_epi64((const __m128i*)sm.mn);
        const uint8_t* qs = b + (five ? 48 : 16);
        __m512i hbits;
        if (five)                                 // bit j of qh byte r: sub-block j's weight r; lanes 0-3: j even
            hbits = _mm512_srlv_epi64(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16))),
                                      _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1));
        __m512i sumi[R];
        for (int m = 0; m < R; ++m) sumi[m] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {             // sub-blocks 2c (low nibbles) and 2c+1 (high) of qs[32c..]
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * c)));
            __m512i w = _mm512_and_si512(_mm512_srlv_epi64(v, halves), low);
            if (five) {
                w = _mm512_or_si512(w, _mm512_and_si512(_mm512_slli_epi16(hbits, 4), _mm512_set1_epi8(16)));
                hbits = _mm512_srli_epi64(hbits, 2);
            }
            const __m512i scv = _mm512_permutexvar_epi16(pick[c], sc);
            for (int m = 0; m < R; ++m) {
                const __m512i p = _mm512_maddubs_epi16(w, _mm512_loadu_si512((const void*)(x[m].q + 256 * bi + 64 * c)));
                sumi[m] = _mm512_add_epi32(sumi[m], _mm512_madd_epi16(p, scv));
            }
        }
        // the mins: Σ_j m_j · (Σq8 of its two 16s), as 8 int32
        const __m256i mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
        const float d = f16_at(b), dmin = f16_at(b + 2);
        for (int m = 0; m < R; ++m) {
            const __m256i pm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x[m].s16 + 16 * bi)), mdup);
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[m]), _mm512_extracti64x4_epi64(sumi[m], 1));
            const float d8 = x[m].d[8 * bi];
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d8 * d), _mm256_cvtepi32_ps(s8), acc[m]);
            accm[m] = _mm256_fmadd_ps(_mm256_set1_ps(d8 * dmin), _mm256_cvtepi32_ps(pm), accm[m]);
        }
    }
    for (int m = 0; m < R; ++m) out[m * stride] = hsum(acc[m]) - hsum(accm[m]);
}

// q6_k: 16 sub-blocks of 16, int8 scales, codes 0..63 less 32 (the 32 taken off in integers: 32·Σ_s sc_s·Σq8).
template <int R>
inline __attribute__((always_inline)) void q6k_q8k_rows(const uint8_t* row, const Q8x* x, int K, float* out, size_t stride) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    const __m512i sh0 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i pick[4] = {idx_pairs16(0, 8), idx_pairs16(4, 8), idx_pairs16(8, 8), idx_pairs16(12, 8)};
    __m256 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
    for (int bi = 0; bi < K / 256; ++bi) {
        const uint8_t* b = row + (size_t)bi * 210;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
        const __m512i sc = _mm512_castsi256_si512(sc16);
        __m512i sumi[R];
        for (int m = 0; m < R; ++m) sumi[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {             // weights 128h..: [ql low | ql' low], then [ql high | ql' high]
            const __m512i ql = _mm512_loadu_si512((const void*)(b + 64 * h));
            const __m512i t0 = _mm512_srlv_epi64(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h))), sh0);
            const __m512i t1 = _mm512_srli_epi64(t0, 4);
            const __m512i w0 = _mm512_ternarylogic_epi64(_mm512_and_si512(_mm512_slli_epi16(t0, 4), two), ql, low, 0xF8);
            const __m512i w1 = _mm512_ternarylogic_epi64(_mm512_and_si512(_mm512_slli_epi16(t1, 4), two),
                                                         _mm512_srli_epi16(ql, 4), low, 0xF8);
            const __m512i sc0 = _mm512_permutexvar_epi16(pick[2 * h], sc), sc1 = _mm512_permutexvar_epi16(pick[2 * h + 1], sc);
            for (int m = 0; m < R; ++m) {
                const int8_t* q8 = x[m].q + 256 * bi;
                const __m512i p0 = _mm512_maddubs_epi16(w0, _mm512_loadu_si512((const void*)(q8 + 128 * h)));
                const __m512i p1 = _mm512_maddubs_epi16(w1, _mm512_loadu_si512((const void*)(q8 + 128 * h + 64)));
                sumi[m] = _mm512_add_epi32(sumi[m], _mm512_madd_epi16(p0, sc0));
                sumi[m] = _mm512_add_epi32(sumi[m], _mm512_madd_epi16(p1, sc1));
            }
        }
        const float d = f16_at(b + 208);
        for (int m = 0; m < R; ++m) {
            const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(x[m].s16 + 16 * bi)), sc16);
            __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[m]), _mm512_extracti64x4_epi64(sumi[m], 1));
            s8 = _mm256_sub_epi32(s8, _mm256_slli_epi32(off, 5));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m].d[8 * bi] * d), _mm256_cvtepi32_ps(s8), acc[m]);
        }
    }
    for (int m = 0; m < R; ++m) out[m * stride] = hsum(acc[m]);
}

// q2_k (16 sub-blocks of 16, 4-bit scale and min, codes 0..3) and q3_k (16 of 16, 6-bit scales less 32, codes 0..7
// less 4: the 4 taken off in integers, 4·Σ_s sc_s·Σq8): ggml's integer sums per 256, 64 codes a step as above.
template <int t, int R>
inline __attribute__((always_inline)) void qk23_q8k_rows(const uint8_t* row, const Q8x* x, int K, float* out, size_t stride) {
    constexpr bool three = t == 11;
    constexpr int size = three ? 110 : 84;
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    const __m512i sh01 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2), sh23 = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i pick[4] = {idx_pairs16(0, 8), idx_pairs16(4, 8), idx_pairs16(8, 8), idx_pairs16(12, 8)};
    __m256 acc[R], accm[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps(), accm[m] = _mm256_setzero_ps();
    for (int bi = 0; bi < K / 256; ++bi) {
        const uint8_t* b = row + (size_t)bi * size;
        __m256i sc16, mn16;
        if (three) {
            alignas(16) int8_t sc[16];
            scales_k3(b + 96, sc);
            sc16 = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i*)sc));
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i*)b);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(15)));
            mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15)));
        }
        const __m512i sc = _mm512_castsi256_si512(sc16);
        const __m512i hm = three ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)b)) : _mm512_setzero_si512();
        __m512i sumi[R];
        for (int m = 0; m < R; ++m) sumi[m] = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {             // weights 128h + 32j + l: bits 2j of qs[32h + l] (hmask bit 4h + j)
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + (three ? 32 : 16) + 32 * h)));
            for (int part = 0; part < 2; ++part) {   // j = 2·part and 2·part + 1: 64 codes
                __m512i w = _mm512_and_si512(_mm512_srlv_epi64(q, part ? sh23 : sh01), m3);
                if (three) {                      // the high bit: 4 where hmask has it (codes 0..7)
                    const __m512i hs = _mm512_add_epi64(_mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1),
                                                        _mm512_set1_epi64(4 * h + 2 * part));
                    w = _mm512_or_si512(w, _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi64(hm, hs), 2), m4));
                }
                const __m512i scv = _mm512_permutexvar_epi16(pick[2 * h + part], sc);
                for (int m = 0; m < R; ++m) {
                    const __m512i p = _mm512_maddubs_epi16(w, _mm512_loadu_si512((const void*)(x[m].q + 256 * bi + 128 * h + 64 * part)));
                    sumi[m] = _mm512_add_epi32(sumi[m], _mm512_madd_epi16(p, scv));
                }
            }
        }
        const float d = f16_at(b + (three ? 108 : 80)), dmin = three ? 0.f : f16_at(b + 82);
        for (int m = 0; m < R; ++m) {
            const __m256i bs = _mm256_loadu_si256((const __m256i*)(x[m].s16 + 16 * bi));
            __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[m]), _mm512_extracti64x4_epi64(sumi[m], 1));
            const float d8 = x[m].d[8 * bi];
            if (three) {
                s8 = _mm256_sub_epi32(s8, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 2));
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d8 * d), _mm256_cvtepi32_ps(s8), acc[m]);
            } else {
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d8 * d), _mm256_cvtepi32_ps(s8), acc[m]);
                accm[m] = _mm256_fmadd_ps(_mm256_set1_ps(d8 * dmin), _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mn16)), accm[m]);
            }
        }
    }
    for (int m = 0; m < R; ++m) out[m * stride] = hsum(acc[m]) - hsum(accm[m]);
}

// iq4_xs: 8 sub-blocks of 32, 6-bit scales less 32, codes the IQ4_NL values (signed: |w|·sign(x, w), as dot_s8x32).
template <int R>
inline __attribute__((always_inline)) void iq4xs_q8k_rows(const uint8_t* row, const Q8x* x, int K, float* out, size_t stride) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)IQ4_NL_VALUES));
    const __m512i low = _mm512_set1_epi8(15), nib = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    const __m512i pick[4] = {idx_pairs16(0, 16), idx_pairs16(2, 16), idx_pairs16(4, 16), idx_pairs16(6, 16)};
    __m256 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
    for (int bi = 0; bi < K / 256; ++bi) {
        const uint8_t* b = row + (size_t)bi * 136;
        uint16_t sh;
        std::memcpy(&sh, b + 2, 2);
        alignas(16) int16_t sc[8];
        for (int j = 0; j < 8; ++j) sc[j] = int16_t((((b[4 + j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32);
        const __m512i scs = _mm512_castsi128_si512(_mm_load_si128((const __m128i*)sc));
        __m512i sumi[R];
        for (int m = 0; m < R; ++m) sumi[m] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {             // sub-blocks 2c, 2c+1: 16 bytes each, low nibbles then high
            const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b + 8 + 32 * c)));
            const __m512i idx = _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(v, v, 0x50), nib), low);
            const __m512i w = _mm512_shuffle_epi8(lut, idx), aw = _mm512_abs_epi8(w);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            const __m512i scv = _mm512_permutexvar_epi16(pick[c], scs);
            for (int m = 0; m < R; ++m) {
                const __m512i xq = _mm512_loadu_si512((const void*)(x[m].q + 256 * bi + 64 * c));
                const __m512i sx = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
                sumi[m] = _mm512_add_epi32(sumi[m], _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), scv));
            }
        }
        const float d = f16_at(b);
        for (int m = 0; m < R; ++m) {
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[m]), _mm512_extracti64x4_epi64(sumi[m], 1));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(x[m].d[8 * bi] * d), _mm256_cvtepi32_ps(s8), acc[m]);
        }
    }
    for (int m = 0; m < R; ++m) out[m * stride] = hsum(acc[m]);
}

// The integer super-block kernels for R rows: → false where t has none (row512 computes it).
template <int R>
inline __attribute__((always_inline)) bool q8k_rows(int t, const uint8_t* row, const Q8x* x, int K, float* out, size_t stride) {
    switch (t) {
        case 10: qk23_q8k_rows<10, R>(row, x, K, out, stride); return true;
        case 11: qk23_q8k_rows<11, R>(row, x, K, out, stride); return true;
        case 12: qk45_q8k_rows<12, R>(row, x, K, out, stride); return true;
        case 13: qk45_q8k_rows<13, R>(row, x, K, out, stride); return true;
        case 14: q6k_q8k_rows<R>(row, x, K, out, stride); return true;
        case 23: iq4xs_q8k_rows<R>(row, x, K, out, stride); return true;
    }
    return false;
}
#endif

// Σ w·x̂ over one row of K weights of quantized type t, x rounded as t's kind (Q8Rows::row(m, t)).
inline __attribute__((always_inline)) float q8_row(int t, const uint8_t* row, const Q8x& x, int K) {
#ifdef KILN_GEMV512
    float y;                                      // ggml's integer sums per 256 where there is one, else row512's
    if (q8k_rows<1>(t, row, &x, K, &y, 0)) return y;
    if (gemv512_type(t)) {
        AccQ8 acc(&x);
        return row512(t, row, acc, K);
    }
#endif
    return q8_row_generic(t, row, x, K);
}

// x [K]'s sums per 16 inputs (K a multiple of 16), in input order: the blocks' mins read them (and per 32 as pairs).
inline void sums16(const float* x, int K, float* out) {
    for (int g = 0; g < K / 16; ++g) {
        float s = 0.f;
        for (int i = 0; i < 16; ++i) s += x[16 * g + i];
        out[g] = s;
    }
}

// One row of x [K] as ggml_mm computes it with M = 1, for callers that split rows their own way (the CPU lane):
// x, its sums per 16 and per 32 inputs as ggml_mm makes them, and (int8 mode) x rounded to 8 bits.
struct GgmlRowInput {
    std::vector<float> x, xs16, xs32;
    Q8Rows q8;
    bool int8;
    GgmlRowInput(const float* x_, int K, int kinds)      // kinds: the Q8 kinds its rows' types need (q8_kinds_of)
        : x(x_, x_ + K), xs16(K / 16), xs32(K / 32), q8(x_, g_int8_activations ? 1 : 0, K, kinds),
          int8(g_int8_activations) {
        sums16(x_, K, xs16.data());
        for (int g = 0; g < K / 32; ++g) xs32[g] = xs16[2 * g] + xs16[2 * g + 1];
    }
};

inline float ggml_row1(int t, const uint8_t* row, const GgmlRowInput& in, int K) {
    if (is_float_type(t)) return dot_float(t, row, in.x.data(), K);
    if (in.int8) return q8_row(t, row, in.q8.row(0, t), K);
#ifdef KILN_GEMV512
    if (gemv512_type(t)) return gemv512_row(t, row, in.x.data(), in.xs16.data(), in.xs32.data(), K);
#endif
    const GgmlType gt = ggml_type(t);
    Unpacked u;
    Acc acc = acc_zero();
    float mins = 0.f;
    for (int bi = 0; bi < K / gt.block; ++bi) {
        unpack_block(t, row + (size_t)bi * gt.size, u);
        const int k0 = bi * gt.block;
        dot_unpacked(u, in.x.data() + k0, in.xs16.data() + k0 / 16, gt.block, acc, mins);
    }
    return acc_sum(acc) - mins;
}

// y [M, N] = x [M, K] · Wᵀ, W [N, K] in GGML type t (rows of K/block·size bytes, K a multiple of the block).
void ggml_mm(int t, const float* x, int M, int K, const uint8_t* w, int N, float* y, int threads) {
    const GgmlType gt = ggml_type(t);
    const size_t row_bytes = (size_t)K / gt.block * gt.size;
    if (is_float_type(t)) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int n = 0; n < N; ++n)
            for (int m = 0; m < M; ++m) y[(size_t)m * N + n] = dot_float(t, w + (size_t)n * row_bytes, x + (size_t)m * K, K);
        return;
    }
    if (g_int8_activations) {                    // every row of x rounded on its own, each by the one-row kernel
        const Q8Rows xq(x, M, K, 1 << q8_kind(t));
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int n = 0; n < N; ++n) {
            const uint8_t* row = w + (size_t)n * row_bytes;
            _mm_prefetch((const char*)row + PREFETCH, _MM_HINT_T0);
            int m = 0;
#ifdef KILN_GEMV512
            for (; m + 4 <= M; m += 4) {         // 4 rows of x̂ a pass, each row q8_row's bits
                const Q8x r4[4] = {xq.row(m, t), xq.row(m + 1, t), xq.row(m + 2, t), xq.row(m + 3, t)};
                if (q8k_rows<4>(t, row, r4, K, y + (size_t)m * N + n, N)) continue;
                AccQ8R<4> acc(r4, y + (size_t)m * N + n, N);
                row512(t, row, acc, K);
            }
#endif
            for (; m < M; ++m) y[(size_t)m * N + n] = q8_row(t, row, xq.row(m, t), K);
        }
        return;
    }
    // x's sums per 16 inputs, for the blocks' mins (K is whole blocks, so a multiple of 32)
    float* xs16 = new float[(size_t)M * (K / 16)];
    for (int m = 0; m < M; ++m) sums16(x + (size_t)m * K, K, xs16 + (size_t)m * (K / 16));
    const int blocks = K / gt.block;
#ifdef KILN_GEMV512
    // The register kernels: 4 rows of x a pass over a weight row, the rest (a decode step's one) alone, each row's
    // bits gemv512_row's (a prefill row keeps a decode step's bits).
    if (gemv512_type(t)) {
        std::vector<float> xs32((size_t)M * (K / 32));
        for (size_t g = 0; g < xs32.size(); ++g) xs32[g] = xs16[2 * g] + xs16[2 * g + 1];
        // x in blocks of MB rows that stay in L1 (~32 KB) while each thread's weight rows pass over them: reading x
        // from L2 for every weight row bounded the loop at L2's rate. Each thread takes the same rows n for every
        // block (static), so the blocks need no barrier between them.
        const int MB = std::max(4, (int)((32 << 10) / ((size_t)K * 4)) / 4 * 4);
#pragma omp parallel num_threads(threads)
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int m1 = std::min(M, m0 + MB);
#pragma omp for schedule(static) nowait
            for (int n = 0; n < N; ++n) {
                const uint8_t* row = w + (size_t)n * row_bytes;
                _mm_prefetch((const char*)row + PREFETCH, _MM_HINT_T0);
                int m = m0;
                for (; m + 4 <= m1; m += 4) {
                    AccRows<4> acc(x + (size_t)m * K, xs16 + (size_t)m * (K / 16), xs32.data() + (size_t)m * (K / 32),
                                   K, y + (size_t)m * N + n, N);
                    row512(t, row, acc, K);
                }
                for (; m < m1; ++m)
                    y[(size_t)m * N + n] = gemv512_row(t, row, x + (size_t)m * K, xs16 + (size_t)m * (K / 16),
                                                       xs32.data() + (size_t)m * (K / 32), K);
            }
        }
        delete[] xs16;
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; ++n) {
        const uint8_t* row = w + (size_t)n * row_bytes;
        _mm_prefetch((const char*)row + PREFETCH, _MM_HINT_T0);
        Unpacked u;
        for (int m0 = 0; m0 < M; m0 += GGML_ROWS) {
            const int mc = M - m0 < GGML_ROWS ? M - m0 : GGML_ROWS;
            Acc acc[GGML_ROWS];
            float mins[GGML_ROWS];
            for (int m = 0; m < mc; ++m) {
                acc[m] = acc_zero();
                mins[m] = 0.f;
            }
            for (int bi = 0; bi < blocks; ++bi) {
                unpack_block(t, row + (size_t)bi * gt.size, u);
                const int k0 = bi * gt.block;
                for (int m = 0; m < mc; ++m)
                    dot_unpacked(u, x + (size_t)(m0 + m) * K + k0, xs16 + (size_t)(m0 + m) * (K / 16) + k0 / 16,
                                 gt.block, acc[m], mins[m]);
            }
            for (int m = 0; m < mc; ++m) y[(size_t)(m0 + m) * N + n] = acc_sum(acc[m]) - mins[m];
        }
    }
    delete[] xs16;
}

// ggml_mm of one row of x [K] through up to 3 matrices of one input (parts[i] [rows[i], K] of GGML types types[i]),
// their outputs concatenated in y: q|k|v, an expert's gate|up. Where every type is a gemv512 one, all their rows are
// one OpenMP region (one barrier, not one a matrix) over x's sums made once; each row is gemv512_row's on the sums
// ggml_mm makes, so y holds ggml_mm's bits either way.
// The rows of up to 3 stacked matrices of K inputs (parts[i]: rows[i] rows of GGML type types[i]) in one OpenMP
// region, y[n] = row_fn(type, row) in the stacked order.
template <class RowFn>
void stacked_rows(int K, int nparts, const uint8_t* const* parts, const int* types, const int* rows, float* y,
                  int threads, const RowFn& row_fn) {
    int total = 0;
    size_t row_bytes[3];
    for (int i = 0; i < nparts; ++i) {
        const GgmlType gt = ggml_type(types[i]);
        row_bytes[i] = (size_t)K / gt.block * gt.size;
        total += rows[i];
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < total; ++n) {
        int i = 0, r = n;
        while (r >= rows[i]) r -= rows[i++];
        const uint8_t* row = parts[i] + (size_t)r * row_bytes[i];
        _mm_prefetch((const char*)row + PREFETCH, _MM_HINT_T0);
        y[n] = row_fn(types[i], row);
    }
}

void ggml_gemv_parts(const float* x, int K, int nparts, const uint8_t* const* parts, const int* types,
                     const int* rows, float* y, int threads) {
    bool quantized = g_int8_activations && nparts > 1;
    for (int i = 0; i < nparts; ++i) quantized = quantized && !is_float_type(types[i]);
    if (quantized) {                             // x rounded once; every row q8_row's, as ggml_mm's
        const Q8Rows xq(x, 1, K, q8_kinds_of(types, nparts));
        stacked_rows(K, nparts, parts, types, rows, y, threads,
                     [&](int t, const uint8_t* row) { return q8_row(t, row, xq.row(0, t), K); });
        return;
    }
#ifdef KILN_GEMV512
    bool fused = nparts > 1;
    for (int i = 0; i < nparts; ++i) fused = fused && gemv512_type(types[i]);
    if (fused) {
        std::vector<float> xs16(K / 16), xs32(K / 32);       // as ggml_mm: sums per 16, and per 32 from them
        sums16(x, K, xs16.data());
        for (int g = 0; g < K / 32; ++g) xs32[g] = xs16[2 * g] + xs16[2 * g + 1];
        stacked_rows(K, nparts, parts, types, rows, y, threads,
                     [&](int t, const uint8_t* row) { return gemv512_row(t, row, x, xs16.data(), xs32.data(), K); });
        return;
    }
#endif
    for (int i = 0; i < nparts; ++i) {
        ggml_mm(types[i], x, 1, K, parts[i], rows[i], y, threads);
        y += rows[i];
    }
}

// h [I] = silu(g)·u, with a limit (glm5_next's swiglu_limit: finite and > 0) g clamped from above and u both ways
// first, as engine.experts.reference.swiglu; any other limit (0, +inf) is none and takes the plain loop.
void swiglu(const float* g, const float* u, int I, float limit, float* h) {
    if (limit > 0.0f && std::isfinite(limit)) {
        for (int i = 0; i < I; ++i) {
            const float a = std::min(g[i], limit), b = std::min(std::max(u[i], -limit), limit);
            h[i] = (a / (1.0f + std::exp(-a))) * b;
        }
        return;
    }
    for (int i = 0; i < I; ++i) h[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}

}  // namespace

extern "C" {

// y [N] = x [K] · Wᵀ, W the int4pack operand (packed [N/64][K][32] bytes, sz bf16 [K/g][N][2]); N % 64 == 0,
// K % g == 0, K <= 8192 (native.MAX_K: the callers check). x and y fp32; x is read as bf16 and y rounded to bf16, as torch's kernel does.
void int4pack_gemv(const float* x, int K, const uint8_t* packed, const uint16_t* sz, int N, int g, float* y,
                   int threads) {
    int4_gemv(x, K, packed, sz, N, g, y, threads);
}

// One expert on one token: y [H] = down(silu(gate x) * up x), gate|up one int4pack operand [2I, H] and down
// [H, I]; gu, h: scratch of 2I and I floats. 2I, I <= 8192. limit: swiglu's (0: none).
void int4_ffn(const float* x, int H, int I, const uint8_t* gu_packed, const uint16_t* gu_sz,
              const uint8_t* d_packed, const uint16_t* d_sz, int g, float* gu, float* h, float* y, int threads,
              float limit) {
    int4_gemv(x, H, gu_packed, gu_sz, 2 * I, g, gu, threads);
    swiglu(gu, gu + I, I, limit, h);
    int4_gemv(h, I, d_packed, d_sz, H, g, y, threads);
}

// x += r (r may be null), then h = x · rsqrt(mean(x²) + eps) · w.
void add_rms_norm(float* x, const float* r, const float* w, float eps, int H, float* h);

}  // extern "C"

namespace {

// The sum of a one-token MoE half after routing, shared by moe_tail (int4 records) and ggml_moe_tail (a GGUF's
// ggml: records): the k picks computed in ascending expert order, as engine.experts.moe_forward computes one token
// — ffn(j, y) puts pick j's expert output in y [H] — out = y·w (+ y'·w' ...), then add_rms_norm(x, out, next_w)
// into h_out. y, out: H floats each.
template <class Ffn>
void moe_picks_norm(int k, const int64_t* ids, const float* w, int H, const Ffn& ffn, float* y, float* out,
                    float* x, const float* next_w, float eps, float* h_out) {
    bool done[64] = {};
    for (int n = 0; n < k; ++n) {
        int j = -1;                                   // the lowest expert id not yet computed
        for (int t = 0; t < k; ++t)
            if (!done[t] && (j < 0 || ids[t] < ids[j])) j = t;
        done[j] = true;
        ffn(j, y);
        const float wj = w[j];
        if (n == 0)
            for (int i = 0; i < H; ++i) out[i] = y[i] * wj;
        else
            for (int i = 0; i < H; ++i) out[i] = out[i] + y[i] * wj;
    }
    add_rms_norm(x, out, next_w, eps, H, h_out);
}

}  // namespace

extern "C" {

// A one-token MoE half after routing: the k picked experts (records recs[j], router weight w[j], expert ids[j])
// computed as engine.experts.moe_forward computes one token — each int4_ffn, in ascending expert order,
// out = y·w (+ y'·w' ...) — then add_rms_norm(x, out, next_w) into h_out (moe_picks_norm). Record offsets: gate|up
// codes, its scales, down codes, its scales. scratch: 2I + I + H + H floats.
void moe_tail(const float* h, int k, const int64_t* ids, const uint64_t* recs, const float* w, int H, int I,
              int64_t gu_off, int64_t gu_sz_off, int64_t d_off, int64_t d_sz_off, int g, float* scratch, float* x,
              const float* next_w, float eps, float* h_out, int threads, float limit) {
    float *gu = scratch, *hid = scratch + 2 * I, *y = hid + I, *out = y + H;
    moe_picks_norm(k, ids, w, H, [&](int j, float* yj) {
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[j]);
        int4_ffn(h, H, I, rec + gu_off, reinterpret_cast<const uint16_t*>(rec + gu_sz_off), rec + d_off,
                 reinterpret_cast<const uint16_t*>(rec + d_sz_off), g, gu, hid, yj, threads, limit);
    }, y, out, x, next_w, eps, h_out);
}

void add_rms_norm(float* x, const float* r, const float* w, float eps, int H, float* h) {
    if (r)
        for (int i = 0; i < H; ++i) x[i] += r[i];
    double ss = 0.0;
    for (int i = 0; i < H; ++i) ss += (double)x[i] * x[i];
    const float inv = 1.0f / std::sqrt((float)(ss / H) + eps);
    for (int i = 0; i < H; ++i) h[i] = (x[i] * inv) * w[i];
}

}  // extern "C"

namespace {

// attn_decode's two parts, shared with attn_rows (exact prefill): a token's rotary and KV write, and one query
// head's attention over its cache rows. noinline: every caller runs the same machine code (the dot product's simd
// reduction is one summation order, whoever calls it).

// Rotary on the q and k heads of one token's q|k|v (the leading `rot` channels of each, rotate-half form; cos/sin
// [rot] of its position p), then k and v written at row p of kc/vc ([max_len, nkv, hd]).
__attribute__((noinline)) void rope_kv_write(float* qkv, const float* cos, const float* sin, float* kc, float* vc,
                                             int p, int nh, int nkv, int hd, int rot) {
    const int half = rot / 2;
    for (int hh = 0; hh < nh + nkv; ++hh) {
        float* v = qkv + (size_t)hh * hd;
        float t[512];
        for (int i = 0; i < half; ++i) {
            t[i] = v[i] * cos[i] + (-v[i + half]) * sin[i];
            t[i + half] = v[i + half] * cos[i + half] + v[i] * sin[i + half];
        }
        std::memcpy(v, t, sizeof(float) * rot);
    }
    const size_t row = (size_t)nkv * hd;
    std::memcpy(kc + (size_t)p * row, qkv + (size_t)nh * hd, sizeof(float) * row);
    std::memcpy(vc + (size_t)p * row, qkv + (size_t)(nh + nkv) * hd, sizeof(float) * row);
}

// One query head q [hd] over cache rows lo..lo+n-1 of its kv head (k, v: that head's row lo, rows `row` floats
// apart) → out [hd]; s: scratch of n floats.
__attribute__((noinline)) void attend_head(const float* q, const float* k0, const float* v0, size_t row, int n,
                                           int hd, float scale, float* s, float* out) {
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
        const float* k = k0 + (size_t)j * row;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int i = 0; i < hd; ++i) d += q[i] * k[i];
        s[j] = d * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
    }
    float acc[512] = {0};
    for (int j = 0; j < n; ++j) {
        const float* vv = v0 + (size_t)j * row;
        const float w = s[j];
#pragma omp simd
        for (int i = 0; i < hd; ++i) acc[i] += w * vv[i];
    }
    for (int i = 0; i < hd; ++i) out[i] = acc[i] / sum;
}

}  // namespace

extern "C" {

// One token of one sequence through attention over its KV cache rows: q|k|v [nh·hd | nkv·hd | nkv·hd] get
// rotary (the leading `rot` channels of each q and k head, rotate-half form; cos/sin [rot] of position p),
// k and v are written at row p of kc/vc ([max_len, nkv, hd] each), and each query head attends over rows
// lo..p (lo = p - window + 1 with a sliding window, else 0) of its kv head (GQA: nh / nkv heads share one)
// → o [nh·hd]. scores: scratch of nh·(p+1) floats.
void attn_decode(float* qkv, const float* cos, const float* sin, float* kc, float* vc, int p, int window, int nh,
                 int nkv, int hd, int rot, float scale, float* scores, float* o, int threads) {
    rope_kv_write(qkv, cos, sin, kc, vc, p, nh, nkv, hd, rot);
    const size_t row = (size_t)nkv * hd;
    const int lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
    const int n = p + 1 - lo, group = nh / nkv;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * nh >= 4096)
    for (int hh = 0; hh < nh; ++hh) {
        const size_t kv = (size_t)(hh / group) * hd;
        attend_head(qkv + (size_t)hh * hd, kc + lo * row + kv, vc + lo * row + kv, row, n, hd, scale,
                    scores + (size_t)hh * n, o + (size_t)hh * hd);
    }
}

void attn_decode_direct(float* qkv, const float* cos, const float* sin, float* kc, float* vc, int p, int window,
                        int nh, int nkv, int hd, int rot, float scale, float* scores, float* o, int threads);

// A decode layer's attention half on one token: h [H] → q|k|v (int4pack [nqkv, H]) → attn_decode(_direct) → o (int4pack
// [H, nh·hd]) → x += o, h_out = rms_norm(x)·post_w. qkv, o_buf, r: scratch of nqkv, nh·hd and H floats.
void attn_block(float* x, const float* h, int H, const uint8_t* qkv_p, const uint16_t* qkv_sz, int nqkv,
                const uint8_t* o_p, const uint16_t* o_sz, int g, const float* cos, const float* sin, float* kc,
                float* vc, int p, int window, int nh, int nkv, int hd, int rot, float scale, float* scores,
                const float* post_w, float eps, float* qkv, float* o_buf, float* r, float* h_out, int threads) {
    int4_gemv(h, H, qkv_p, qkv_sz, nqkv, g, qkv, threads);
    attn_decode_direct(qkv, cos, sin, kc, vc, p, window, nh, nkv, hd, rot, scale, scores, o_buf, threads);
    int4_gemv(o_buf, nh * hd, o_p, o_sz, H, g, r, threads);
    add_rms_norm(x, r, post_w, eps, H, h_out);
}

// ================================================================ exact prefill rows (issue 32)
// Many tokens of one sequence, each row computed by the very code a one-token decode step runs on it (the same
// tile kernels, rotary, attention and norm, in the same operation order), so a position's keys, values and logits
// have the same bits whether it came from a whole prefill, a chunk of another length, or a decode step: a prefix
// the prefix cache reuses is what a fresh prefill would compute. Only the loops around the rows are new: a weight
// tile is read once for all rows, and the attention's (row, head) pairs share the threads.

void router_topk(const float* x, int H, const float* gate, int E, int k, int renorm, int64_t* ids, float* w);

}  // extern "C"

namespace {

#if defined(__AVX512F__)
// attend_head on many queries at once, for attn_rows: every (query, key) through the same IEEE operations in the
// same order as attend_head's machine code, so the same bits, but with the keys in vector lanes instead of one key's
// channels, so no per-key horizontal sum and no per-key call (attend_head: ~3.9 ms a row at 600 keys on the demo's
// 30 layers x 9 heads, most of a chat turn's prefill). What attend_head's code does, per query (g++ -O3, -ffp-contract=off):
//   score: its `omp simd reduction` is 16 lanes, lane l = (((0 + q[l]·k[l]) + q[16+l]·k[16+l]) + ...) with products
//     and sums rounded apart, then 0 + lane 0 + lane 1 + ... + lane 15 in order; times scale;
//   exp: glibc's expf of (s - max), whose x86-64 FMA build (e_expf.c) is done here on 16 scores at once, lanes in
//     its special range (|x| >= 88, NaN) through std::exp itself; the sum of the exps in key order;
//   values: acc[i] = acc[i] + w·v[i] in key order from 0, then acc / sum.
// The first two are how this compiler and libm lower attend_head, not what the source promises, so exact_attend_ok()
// compares this with attend_head itself on random rows before attn_rows uses it (per head size; else attend_head).

const uint64_t EXPF_TAB[32] = {    // glibc's __exp2f_data.tab: the bits of 2^(i/32), less i << 47
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

// expf on 8 floats (widened): e_expf.c's main path with its FMAs, in double.
inline __m256 expf8_main(__m256 x) {
    const __m512d inv = _mm512_set1_pd(0x1.71547652b82fep+5), shift = _mm512_set1_pd(0x1.8p52);
    const __m512i t0 = _mm512_loadu_si512(EXPF_TAB), t1 = _mm512_loadu_si512(EXPF_TAB + 8);
    const __m512i t2 = _mm512_loadu_si512(EXPF_TAB + 16), t3 = _mm512_loadu_si512(EXPF_TAB + 24);
    const __m512d xd = _mm512_cvtps_pd(x);
    __m512d kd = _mm512_fmadd_pd(inv, xd, shift);                       // k = round(x·32/ln2), in kd's low bits
    const __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, shift);
    const __m512d r = _mm512_fmsub_pd(inv, xd, kd);
    const __m512i idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
    __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(16)),
                                        _mm512_permutex2var_epi64(t0, idx, t1), _mm512_permutex2var_epi64(t2, idx, t3));
    t = _mm512_add_epi64(t, _mm512_slli_epi64(ki, 47));                 // 2^(k/32)
    const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(0x1.c6af84b912394p-20), r, _mm512_set1_pd(0x1.ebfce50fac4f3p-13));
    const __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.62e42ff0c52d6p-6), _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(z, r2, y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, _mm512_castsi512_pd(t)));
}

// std::exp (glibc's expf) of 16 floats, each with expf's bits (exact_attend_ok checks that on this host).
inline __m512 expf16(__m512 x) {
    const __m256 lo = expf8_main(_mm512_castps512_ps256(x));
    const __m256 hi = expf8_main(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m512 y = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
    const __mmask16 special = _mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(0x42b));     // |x| >= 88 or NaN
    if (special) {
        alignas(64) float xs[16], ys[16];
        _mm512_store_ps(xs, x);
        _mm512_store_ps(ys, y);
        for (int l = 0; l < 16; ++l)
            if (special >> l & 1) ys[l] = std::exp(xs[l]);
        y = _mm512_load_ps(ys);
    }
    return y;
}

// r[16] rows of 16 floats → its transpose in place.
inline void transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {     // r[4i + m], 128-bit lane k: rows 4i..4i+3 of column 4k + m
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int m = 0; m < 4; ++m) {     // then the 4x4 transpose of 128-bit lanes
        t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
        t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
        t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
        t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
    }
    for (int m = 0; m < 4; ++m) {
        r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
        r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd);
    }
}

// Keys j0..j0+15 of one kv head (k0: its row 0, rows `row` floats apart; keys at or past `end` read as 0) → kt
// [HC·16 channels][ldk], column j0 - base.
template <int HC>
void keys_transposed(const float* k0, size_t row, int j0, int end, int base, float* kt, size_t ldk) {
    const int valid = std::min(16, end - j0);
    for (int c = 0; c < HC; ++c) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
            r[i] = i < valid ? _mm512_loadu_ps(k0 + (size_t)(j0 + i) * row + 16 * c) : _mm512_setzero_ps();
        transpose16(r);
        for (int d = 0; d < 16; ++d) _mm512_storeu_ps(kt + (size_t)(16 * c + d) * ldk + (j0 - base), r[d]);
    }
}

// attend_head's softmax and value sum for nq (<= 4) queries whose scores s[i·sn + j] (keys lo..lo+n-1) are made,
// mx[i] their running maxima by lane: exps (expf16) in place, their sum and acc = acc + w·v in key order → out[i].
template <int HC>
void softmax_values(int nq, float* s, size_t sn, const __m512* mx, const float* v0, size_t row, int lo, int n,
                    float* const* out) {
    const int blocks = (n + 15) / 16;
    for (int i = 0; i < nq; ++i) {
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[i]));
        for (int b = 0; b < blocks; ++b)
            _mm512_storeu_ps(s + i * sn + 16 * b, expf16(_mm512_sub_ps(_mm512_loadu_ps(s + i * sn + 16 * b), m)));
    }
    __m512 acc[4][HC];
    float sum[4];
    for (int i = 0; i < nq; ++i) {
        sum[i] = 0.f;
        for (int c = 0; c < HC; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    for (int j = 0; j < n; ++j) {
        const float* vv = v0 + (size_t)(lo + j) * row;
        __m512 v[HC];
        for (int c = 0; c < HC; ++c) v[c] = _mm512_loadu_ps(vv + 16 * c);
        for (int i = 0; i < nq; ++i) {
            const float w = s[i * sn + j];
            sum[i] += w;
            const __m512 wv = _mm512_set1_ps(w);
            for (int c = 0; c < HC; ++c) acc[i][c] = _mm512_add_ps(acc[i][c], _mm512_mul_ps(wv, v[c]));
        }
    }
    for (int i = 0; i < nq; ++i)
        for (int c = 0; c < HC; ++c) _mm512_storeu_ps(out[i] + 16 * c, _mm512_div_ps(acc[i][c], _mm512_set1_ps(sum[i])));
}

// nq (<= 4) query heads q[i] (HC·16 floats) over keys lo..p of their kv head, each as attend_head computes it → out[i].
// kt: the keys transposed (keys_transposed, column j - base; zero past the last key, so a block may read beyond p);
// v0: the values' row 0, rows `row` floats apart; s: scratch of 4·(p + 1 - lo + 16) floats.
template <int HC>
void attend_keys_in_lanes(const float* const* q, int nq, const float* kt, size_t ldk, int base, const float* v0,
                          size_t row, int lo, int p, float scale, float* s, float* const* out) {
    const int n = p + 1 - lo, blocks = (n + 15) / 16;
    const size_t sn = (size_t)blocks * 16;
    __m512 mx[4];
    for (int i = 0; i < nq; ++i) mx[i] = _mm512_set1_ps(-INFINITY);
    for (int b = 0; b < blocks; ++b) {
        const float* kb = kt + (lo - base) + 16 * b;
        __m512 dot[4];
        for (int i = 0; i < nq; ++i) dot[i] = _mm512_setzero_ps();
        for (int l = 0; l < 16; ++l) {
            __m512 a[4];
            for (int i = 0; i < nq; ++i) a[i] = _mm512_setzero_ps();
            for (int c = 0; c < HC; ++c) {
                const __m512 k = _mm512_loadu_ps(kb + (size_t)(16 * c + l) * ldk);
                for (int i = 0; i < nq; ++i) a[i] = _mm512_add_ps(a[i], _mm512_mul_ps(_mm512_set1_ps(q[i][16 * c + l]), k));
            }
            for (int i = 0; i < nq; ++i) dot[i] = _mm512_add_ps(dot[i], a[i]);
        }
        const __mmask16 valid = (__mmask16)(n - 16 * b >= 16 ? 0xffff : (1u << (n - 16 * b)) - 1);
        for (int i = 0; i < nq; ++i) {
            const __m512 sv = _mm512_mul_ps(dot[i], _mm512_set1_ps(scale));
            _mm512_storeu_ps(s + i * sn + 16 * b, sv);
            mx[i] = _mm512_mask_max_ps(mx[i], valid, sv, mx[i]);     // a NaN score is passed over, as in attend_head
        }
    }
    softmax_values<HC>(nq, s, sn, mx, v0, row, lo, n, out);
}

// One query q over keys lo..p as attend_head computes it, for a decode step (one row: no keys transposed): each key's
// 16 lane sums made on its own channels, 16 keys' sums transposed so lane l of every key is one vector, then
// 0 + lane 0 + ... + lane 15 in order, as attend_keys_in_lanes. k0, v0: the kv head's row 0, rows `row` floats
// apart; s: scratch of p + 1 - lo + 16 floats.
template <int HC>
void attend_one_direct(const float* q, const float* k0, const float* v0, size_t row, int lo, int p, float scale,
                       float* s, float* out) {
    const int n = p + 1 - lo, blocks = (n + 15) / 16;
    __m512 qv[HC];
    for (int c = 0; c < HC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int b = 0; b < blocks; ++b) {
        const int valid_n = std::min(16, n - 16 * b);
        __m512 a[16];
        for (int r = 0; r < 16; ++r) {
            a[r] = _mm512_setzero_ps();
            if (r < valid_n) {
                const float* k = k0 + (size_t)(lo + 16 * b + r) * row;
                for (int c = 0; c < HC; ++c) a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(qv[c], _mm512_loadu_ps(k + 16 * c)));
            }
        }
        transpose16(a);
        __m512 dot = _mm512_setzero_ps();
        for (int l = 0; l < 16; ++l) dot = _mm512_add_ps(dot, a[l]);
        const __m512 sv = _mm512_mul_ps(dot, _mm512_set1_ps(scale));
        _mm512_storeu_ps(s + 16 * b, sv);
        mx = _mm512_mask_max_ps(mx, (__mmask16)(valid_n == 16 ? 0xffff : (1u << valid_n) - 1), sv, mx);
    }
    float* outs[1] = {out};
    softmax_values<HC>(1, s, (size_t)blocks * 16, &mx, v0, row, lo, n, outs);
}

// attn_rows' attention on the fast path: the kv heads' keys transposed once (as many heads a pass as fit 64 MB), then
// each (kv head, row) item attends with that row's query heads of the kv head together (they share the keys' loads).
// Two barriers a pass: on a loaded host a thread waiting at one waits for the slowest.
template <int HC>
void attend_rows_fast(const float* qkv, const float* kc, const float* vc, int start, int T, int window, int nh,
                      int nkv, float scale, float* o, int threads) {
    constexpr int hd = 16 * HC;
    const size_t nqkv = (size_t)(nh + 2 * nkv) * hd, row = (size_t)nkv * hd;
    const int end = start + T, group = nh / nkv;
    const int base = window > 0 && start + 1 > window ? start + 1 - window : 0;      // the first row's lo
    const int blocks = (end - base + 15) / 16;
    const size_t ldk = (size_t)blocks * 16 + 16, head_floats = (size_t)hd * ldk;
    const int per_pass = (int)std::max<size_t>(1, std::min<size_t>(nkv, ((size_t)64 << 20) / (4 * head_floats)));
    float* kt = new float[head_floats * per_pass];
#pragma omp parallel num_threads(threads)
    {
        float* s = new float[4 * ((size_t)(end - base) + 16)];
        for (int g0 = 0; g0 < nkv; g0 += per_pass) {
            const int heads = std::min(per_pass, nkv - g0);
#pragma omp for schedule(static)
            for (int i = 0; i < heads * blocks; ++i) {
                const int g = i / blocks, j0 = base + 16 * (i % blocks);
                float* ktg = kt + (size_t)g * head_floats;
                keys_transposed<HC>(kc + (size_t)(g0 + g) * hd, row, j0, end, base, ktg, ldk);
                if (j0 + 16 >= end)      // the padding a last block may read past
                    for (int d = 0; d < hd; ++d) std::memset(ktg + (size_t)d * ldk + blocks * 16, 0, 16 * sizeof(float));
            }
#pragma omp for schedule(dynamic, 1)          // later rows attend over more keys
            for (int i = 0; i < heads * T; ++i) {
                const int g = g0 + i / T, t = i % T;
                const int p = start + t, lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
                for (int h0 = 0; h0 < group; h0 += 4) {
                    const int nq = std::min(4, group - h0);
                    const float* q[4];
                    float* out[4];
                    for (int k = 0; k < nq; ++k) {
                        const int hh = g * group + h0 + k;
                        q[k] = qkv + t * nqkv + (size_t)hh * hd;
                        out[k] = o + (size_t)t * nh * hd + (size_t)hh * hd;
                    }
                    attend_keys_in_lanes<HC>(q, nq, kt + (size_t)(g - g0) * head_floats, ldk, base,
                                             vc + (size_t)g * hd, row, lo, p, scale, s, out);
                }
            }
        }
        delete[] s;
    }
    delete[] kt;
}

// The random rows the attention kernels' bit-equality self-checks run on: n keys and values of nkv heads of hd,
// nq queries (×4, so scores spread), and key `far` 9× the first query, so the other keys' exps fall below -88
// (expf's special range).
struct AttendProbe {
    size_t row;
    std::vector<float> kc, vc, q;
    AttendProbe(int hd, int n, int nkv, int nq, int far, uint32_t seed)
        : row((size_t)nkv * hd), kc(n * row), vc(n * row), q((size_t)nq * hd) {
        uint32_t st = seed;
        auto rnd = [&st] { st = st * 1664525u + 1013904223u; return (float)(st >> 8) / 16777216.0f * 2.f - 1.f; };
        for (size_t i = 0; i < kc.size(); ++i) kc[i] = rnd(), vc[i] = rnd();
        for (float& x : q) x = rnd() * 4.f;
        for (int d = 0; d < hd; ++d) kc[far * row + d] = q[d] * 9.f;
    }
};

// 1 where attend_keys_in_lanes gives attend_head's bits for head size 16·HC on random queries, keys and values
// (scores spread past expf's special range, windows, 1-4 heads); checked once per head size.
template <int HC>
bool attend_fast_checked() {
    static const bool ok = [] {
        constexpr int hd = 16 * HC, nkv = 2, n = 83;
        AttendProbe pr(hd, n, nkv, 4, 5, 12345u);
        const size_t row = pr.row;
        const float *kc = pr.kc.data(), *vc = pr.vc.data(), *q = pr.q.data();
        float* kt = new float[(size_t)hd * (n + 32)];
        float* s = new float[4 * (n + 16)];
        float got[4][hd], want[hd];
        float* sh = new float[n];
        bool same = true;
        for (int lo : {0, 3, 50}) {
            const size_t ldk = (size_t)((n - lo + 15) / 16) * 16 + 16;
            std::memset(kt, 0, sizeof(float) * hd * ldk);
            for (int j0 = lo; j0 < n; j0 += 16) keys_transposed<HC>(kc, row, j0, n, lo, kt, ldk);
            for (int p : {lo, lo + 16, n - 1}) {
                const float* qs[4] = {q, q + hd, q + 2 * hd, q + 3 * hd};
                float* outs[4] = {got[0], got[1], got[2], got[3]};
                attend_keys_in_lanes<HC>(qs, 4, kt, ldk, lo, vc, row, lo, p, 0.125f, s, outs);
                for (int i = 0; i < 4; ++i) {
                    attend_head(qs[i], kc + lo * row, vc + lo * row, row, p + 1 - lo, hd, 0.125f, sh, want);
                    same = same && std::memcmp(got[i], want, sizeof want) == 0;
                }
            }
        }
        delete[] kt;
        delete[] s;
        delete[] sh;
        return same;
    }();
    return ok;
}
// 1 where attend_one_direct gives attend_head's bits for head size 16·HC (random rows, as attend_fast_checked).
template <int HC>
bool attend_direct_checked() {
    static const bool ok = [] {
        constexpr int hd = 16 * HC, nkv = 2, n = 83;
        AttendProbe pr(hd, n, nkv, 1, 7, 777u);
        const size_t row = pr.row;
        const float *kc = pr.kc.data(), *vc = pr.vc.data(), *q = pr.q.data();
        float got[hd], want[hd];
        float* s = new float[n + 16];
        float* sh = new float[n];
        bool same = true;
        for (int lo : {0, 5, 60})
            for (int p : {lo, lo + 15, lo + 16, n - 1}) {
                if (p >= n) continue;
                attend_one_direct<HC>(q, kc, vc, row, lo, p, 0.125f, s, got);
                attend_head(q, kc + lo * row, vc + lo * row, row, p + 1 - lo, hd, 0.125f, sh, want);
                same = same && std::memcmp(got, want, sizeof want) == 0;
            }
        delete[] s;
        delete[] sh;
        return same;
    }();
    return ok;
}
#endif

}  // namespace

extern "C" {

// attn_decode with its heads through attend_one_direct where attn_decode_direct_ok(hd) (the same bits, checked
// against attend_head at first use), else attend_head: the decode step's attention (attn_block, ggml_attn_block).
int attn_decode_direct_ok(int hd) {
#if defined(__AVX512F__)
    if (hd == 32) return attend_direct_checked<2>();
    if (hd == 64) return attend_direct_checked<4>();
    if (hd == 128) return attend_direct_checked<8>();
#endif
    (void)hd;
    return 0;
}

void attn_decode_direct(float* qkv, const float* cos, const float* sin, float* kc, float* vc, int p, int window,
                        int nh, int nkv, int hd, int rot, float scale, float* scores, float* o, int threads) {
#if defined(__AVX512F__)
    if (attn_decode_direct_ok(hd)) {
        rope_kv_write(qkv, cos, sin, kc, vc, p, nh, nkv, hd, rot);
        const size_t row = (size_t)nkv * hd;
        const int lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
        const int n = p + 1 - lo, group = nh / nkv;
        const size_t stride = (size_t)n + 16;
        float* s = new float[stride * nh];
#pragma omp parallel for num_threads(threads) schedule(static) if (n * nh >= 4096)
        for (int hh = 0; hh < nh; ++hh) {
            const size_t kv = (size_t)(hh / group) * hd;
            const float* q = qkv + (size_t)hh * hd;
            float* out = o + (size_t)hh * hd;
            if (hd == 32) attend_one_direct<2>(q, kc + kv, vc + kv, row, lo, p, scale, s + hh * stride, out);
            if (hd == 64) attend_one_direct<4>(q, kc + kv, vc + kv, row, lo, p, scale, s + hh * stride, out);
            if (hd == 128) attend_one_direct<8>(q, kc + kv, vc + kv, row, lo, p, scale, s + hh * stride, out);
        }
        delete[] s;
        return;
    }
#endif
    attn_decode(qkv, cos, sin, kc, vc, p, window, nh, nkv, hd, rot, scale, scores, o, threads);
}

// 1 where attn_rows' attention takes the keys-in-lanes path for head size hd (AVX-512, hd 32/64/128, and checked
// to give attend_head's bits here), else 0 (attend_head itself, row by row).
int exact_attend_fast(int hd) {
#if defined(__AVX512F__)
    if (hd == 32) return attend_fast_checked<2>();
    if (hd == 64) return attend_fast_checked<4>();
    if (hd == 128) return attend_fast_checked<8>();
#endif
    (void)hd;
    return 0;
}

// How many float bit patterns in [from, to) (stepping `step`) expf16 gives other bits for than std::exp (tests).
int64_t exact_expf_mismatches(uint32_t from, uint32_t to, uint32_t step) {
    int64_t bad = 0;
#if defined(__AVX512F__)
    alignas(64) uint32_t u[16];
    alignas(64) float y[16];
    for (uint64_t b = from; b < to; b += 16ull * step) {
        for (int l = 0; l < 16; ++l) u[l] = (uint32_t)std::min<uint64_t>(b + (uint64_t)l * step, to - 1);
        _mm512_store_ps(y, expf16(_mm512_castsi512_ps(_mm512_load_si512(u))));
        for (int l = 0; l < 16; ++l) {
            float x, e;
            std::memcpy(&x, &u[l], 4);
            e = std::exp(x);
            bad += std::memcmp(&e, &y[l], 4) != 0;
        }
    }
#else
    (void)from, (void)to, (void)step;
    bad = -1;
#endif
    return bad;
}

// T tokens at positions start..start+T-1 of one sequence (qkv [T, (nh + 2·nkv)·hd], cos/sin [T, rot]): each row's
// rotary and KV write as attn_decode's, in order, then every (row, head) attends over its rows lo..p as
// attn_decode's heads do → o [T, nh·hd] (the keys-in-lanes path where exact_attend_fast(hd), the same bits).
void attn_rows(float* qkv, const float* cos, const float* sin, float* kc, float* vc, int start, int T, int window,
               int nh, int nkv, int hd, int rot, float scale, float* o, int threads) {
    const size_t nqkv = (size_t)(nh + 2 * nkv) * hd, row = (size_t)nkv * hd;
    for (int t = 0; t < T; ++t)
        rope_kv_write(qkv + t * nqkv, cos + (size_t)t * rot, sin + (size_t)t * rot, kc, vc, start + t, nh, nkv, hd, rot);
#if defined(__AVX512F__)
    if (exact_attend_fast(hd)) {
        if (hd == 32) attend_rows_fast<2>(qkv, kc, vc, start, T, window, nh, nkv, scale, o, threads);
        if (hd == 64) attend_rows_fast<4>(qkv, kc, vc, start, T, window, nh, nkv, scale, o, threads);
        if (hd == 128) attend_rows_fast<8>(qkv, kc, vc, start, T, window, nh, nkv, scale, o, threads);
        return;
    }
#endif
    const int group = nh / nkv;
#pragma omp parallel num_threads(threads)
    {
        float* s = new float[(size_t)start + T];
#pragma omp for schedule(dynamic, 8)        // later rows attend over more keys
        for (int i = 0; i < T * nh; ++i) {
            const int t = i / nh, hh = i % nh, p = start + t;
            const int lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
            const size_t kv = (size_t)(hh / group) * hd;
            attend_head(qkv + t * nqkv + (size_t)hh * hd, kc + lo * row + kv, vc + lo * row + kv, row, p + 1 - lo, hd,
                        scale, s, o + (size_t)t * nh * hd + (size_t)hh * hd);
        }
        delete[] s;
    }
}

// x [T, H] += r (r may be null), then h [T, H] = rms_norm(x)·w, each row by add_rms_norm.
void add_rms_norm_rows(float* x, const float* r, const float* w, float eps, int H, int T, float* h) {
    for (int t = 0; t < T; ++t)
        add_rms_norm(x + (size_t)t * H, r ? r + (size_t)t * H : nullptr, w, eps, H, h + (size_t)t * H);
}

// attn_block on T tokens at positions start..: each row as attn_block computes it → x [T, H] updated, h_out [T, H].
void attn_block_rows(float* x, const float* h, int T, int H, const uint8_t* qkv_p, const uint16_t* qkv_sz, int nqkv,
                     const uint8_t* o_p, const uint16_t* o_sz, int g, const float* cos, const float* sin, float* kc,
                     float* vc, int start, int window, int nh, int nkv, int hd, int rot, float scale,
                     const float* post_w, float eps, float* h_out, int threads) {
    float* qkv = new float[(size_t)T * nqkv];
    float* o = new float[(size_t)T * nh * hd];
    float* r = new float[(size_t)T * H];
    int4_gemv_rows(h, T, H, qkv_p, qkv_sz, nqkv, g, qkv, threads);
    attn_rows(qkv, cos, sin, kc, vc, start, T, window, nh, nkv, hd, rot, scale, o, threads);
    int4_gemv_rows(o, T, nh * hd, o_p, o_sz, H, g, r, threads);
    add_rms_norm_rows(x, r, post_w, eps, H, T, h_out);
    delete[] qkv;
    delete[] o;
    delete[] r;
}

// router_topk on each of T rows of x [T, H] → ids [T, k], w [T, k].
void router_topk_rows(const float* x, int T, int H, const float* gate, int E, int k, int renorm, int64_t* ids,
                      float* w) {
    for (int t = 0; t < T; ++t)
        router_topk(x + (size_t)t * H, H, gate, E, k, renorm, ids + (size_t)t * k, w + (size_t)t * k);
}

// int4_ffn on each of M rows of x [M, H] (one expert's tokens) → y [M, H], with int4_ffn's swiglu (and limit).
void int4_ffn_rows(const float* x, int M, int H, int I, const uint8_t* gu_packed, const uint16_t* gu_sz,
                   const uint8_t* d_packed, const uint16_t* d_sz, int g, float* y, int threads, float limit) {
    float* gu = new float[(size_t)M * 2 * I];
    float* h = new float[(size_t)M * I];
    int4_gemv_rows(x, M, H, gu_packed, gu_sz, 2 * I, g, gu, threads);
    for (int m = 0; m < M; ++m) {
        const float* gum = gu + (size_t)m * 2 * I;
        swiglu(gum, gum + I, I, limit, h + (size_t)m * I);
    }
    int4_gemv_rows(h, M, I, d_packed, d_sz, H, g, y, threads);
    delete[] gu;
    delete[] h;
}

// moe_tail's sum and norm on T rows: y [T, k, H] the picked experts' outputs (row t, pick j), ids/w [T, k] → per
// row, in ascending expert order, out = y·w (+ y'·w' ...), then add_rms_norm(x, out, next_w) into h_out [T, H].
void moe_sum_rows(const float* y, int T, int k, const int64_t* ids, const float* w, int H, float* x,
                  const float* next_w, float eps, float* h_out) {
    float* out = new float[H];
    for (int t = 0; t < T; ++t) {
        const int64_t* id = ids + (size_t)t * k;
        bool done[64] = {};
        for (int n = 0; n < k; ++n) {
            int j = -1;
            for (int u = 0; u < k; ++u)
                if (!done[u] && (j < 0 || id[u] < id[j])) j = u;
            done[j] = true;
            const float* yj = y + ((size_t)t * k + j) * H;
            const float wj = w[(size_t)t * k + j];
            if (n == 0)
                for (int i = 0; i < H; ++i) out[i] = yj[i] * wj;
            else
                for (int i = 0; i < H; ++i) out[i] = out[i] + yj[i] * wj;
        }
        add_rms_norm(x + (size_t)t * H, out, next_w, eps, H, h_out + (size_t)t * H);
    }
    delete[] out;
}

// MixtralBlock.native_rows' experts and sum in one call, where every picked expert's record is resident: T rows
// routed (ids, w [T, k]), rec[e] the host address of expert e's record; each expert's rows (ascending expert, its
// picks in row order) through int4_ffn_rows, then moe_sum_rows → x [T, H] updated, h_out [T, H]. The same calls
// the Python loop made, without its per-expert gathers and scatters.
void moe_rows(const float* h, int T, int k, const int64_t* ids, const float* w, const uint64_t* rec, int E, int H,
              int I, int64_t gu_off, int64_t gu_sz_off, int64_t d_off, int64_t d_sz_off, int g, float* x,
              const float* next_w, float eps, float* h_out, int threads, float limit) {
    const size_t n = (size_t)T * k;
    float* y = new float[n * H];
    float* xr = new float[n * H];
    float* yr = new float[n * H];
    int* picks = new int[n];
    for (int e = 0; e < E; ++e) {
        int m = 0;
        for (size_t i = 0; i < n; ++i)
            if (ids[i] == e) picks[m++] = (int)i;
        if (!m) continue;
        for (int r = 0; r < m; ++r) std::memcpy(xr + (size_t)r * H, h + (size_t)(picks[r] / k) * H, sizeof(float) * H);
        const uint8_t* b = (const uint8_t*)rec[e];
        int4_ffn_rows(xr, m, H, I, b + gu_off, (const uint16_t*)(b + gu_sz_off), b + d_off, (const uint16_t*)(b + d_sz_off),
                      g, yr, threads, limit);
        for (int r = 0; r < m; ++r) std::memcpy(y + (size_t)picks[r] * H, yr + (size_t)r * H, sizeof(float) * H);
    }
    moe_sum_rows(y, T, k, ids, w, H, x, next_w, eps, h_out);
    delete[] y;
    delete[] xr;
    delete[] yr;
    delete[] picks;
}

// ================================================================ end of exact prefill rows

// Softmax routing of one token: logits = gate [E, H] · x, softmax in fp32, the k most probable experts (ties:
// the lower index), their probabilities renormalised to sum 1 when `renorm` → ids [k] (int64), w [k].
void router_topk(const float* x, int H, const float* gate, int E, int k, int renorm, int64_t* ids, float* w) {
    float pr[1024];
    float mx = -INFINITY;
    for (int e = 0; e < E; ++e) {
        const float* row = gate + (size_t)e * H;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int i = 0; i < H; ++i) d += row[i] * x[i];
        pr[e] = d;
        mx = d > mx ? d : mx;
    }
    float sum = 0.f;
    for (int e = 0; e < E; ++e) {
        pr[e] = std::exp(pr[e] - mx);
        sum += pr[e];
    }
    for (int e = 0; e < E; ++e) pr[e] /= sum;
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < E; ++e) {
            bool taken = false;
            for (int t = 0; t < j; ++t) taken |= ids[t] == e;
            if (!taken && (best < 0 || pr[e] > pr[best])) best = e;
        }
        ids[j] = best;
        w[j] = pr[best];
        picked += pr[best];
    }
    if (renorm)
        for (int j = 0; j < k; ++j) w[j] = w[j] / picked;
}

// ================================================================ a whole decode step's layers (issue 32)
// decode_layers: a one-token decode step's layers in one call (engine.kernels.native.DecodeLayers): per layer
// attn_block, router_topk and moe_tail, the very calls the per-layer path makes from Python, in its order (so its
// bits); what it saves is a step's ~100 Python calls and their argument marshalling. The picked experts' records
// come from `records` [L][E] (host addresses, 0: not resident): where a pick is not there, the layer's routing is
// left in ids/w and its index returned, and the caller makes the records resident and calls again from there.
// A GGUF served alone (issue 29) takes the same walk on the file's own blocks: a layer whose StepLayer names a
// StepGgmlAttn runs ggml_attn_block (q|k|v and o each in its own GGML type) for attn_block, and a step whose
// shape says ggml_tail runs ggml_moe_tail (a record's matrices each in its own type) for moe_tail.

struct StepShape {            // what every layer shares (native.DecodeLayers' _Shape mirrors it)
    int32_t L, H, nqkv, g, window, nh, nkv, hd, rot, max_len, E, k, renorm, I, fg;
    float scale, eps, limit;
    int64_t gu_off, gu_sz_off, d_off, d_sz_off;
    int32_t ggml_tail;        // 1: the records are ggml: ones (ggml_moe_tail at gate_off, up_off, down_off)
    int64_t gate_off, up_off, down_off;
};

struct StepGgmlAttn {         // ggml_attn_block's weights (native.DecodeLayers' _GgmlAttn mirrors it)
    uint64_t ptrs[3];         // q|k|v as 1..3 consecutive matrices [rows[i], H] of GGML types types[i]
    int32_t types[3], rows[3], nparts, o_type;
    const uint8_t* o_w;       // o [H, nh·hd] of GGML type o_type
};

struct StepLayer {            // one layer's weights and caches (native.DecodeLayers' _Layer mirrors it)
    const uint8_t* qkv_p;
    const uint16_t* qkv_sz;
    const uint8_t* o_p;
    const uint16_t* o_sz;
    float* k_cache;           // this layer's [slots, max_len, nkv, hd]
    float* v_cache;
    const float* post_w;
    const float* gate;        // router [E, H]
    const float* next_w;      // the next layer's input norm, or the final norm
    const StepGgmlAttn* ggml; // non-null: the attention's q|k|v and o are these GGUF blocks, not the int4 ones above
};

void ggml_attn_block(float* x, const float* h, int H, const uint64_t* ptrs, const int* types, const int* rows,
                     int nparts, const uint8_t* o_w, int o_type, const float* cos, const float* sin, float* kc,
                     float* vc, int p, int window, int nh, int nkv, int hd, int rot, float scale, float* scores,
                     const float* post_w, float eps, float* qkv, float* o_buf, float* r, float* h_out, int threads);
void ggml_moe_tail(const float* h, int k, const int64_t* ids, const uint64_t* recs, const float* w, int H, int I,
                   int64_t gate_off, int64_t up_off, int64_t down_off, float* scratch, float* x, const float* next_w,
                   float eps, float* h_out, int threads, float limit);

// x [H] the residual stream (updated in place); h [H]: on entry the input norm of layer `from` (routed 0) or, where
// the call resumes a layer whose records were missing (routed 1), that layer's post-attention norm, its routing in
// ids/w; on return (L) the final norm's output. ids [L][k], w [L][k]: each layer's picks. scratch: nqkv + nh·hd + H
// + 3I + 2H floats; scores: nh·(p + 1). → L when done, else the layer whose picks are not all in `records`.
int decode_layers(const StepShape* s, const StepLayer* layers, const uint64_t* records, int from, int routed,
                  float* x, float* h, int slot, int p, const float* cos, const float* sin, float* scores,
                  float* scratch, int64_t* ids, float* w, int threads) {
    float* qkv = scratch;
    float* o_buf = qkv + s->nqkv;
    float* r = o_buf + (size_t)s->nh * s->hd;
    float* moe = r + s->H;
    const size_t slot_rows = (size_t)slot * s->max_len * s->nkv * s->hd;
    uint64_t recs[64];
    for (int l = from; l < s->L; ++l) {
        const StepLayer& ly = layers[l];
        int64_t* lid = ids + (size_t)l * s->k;
        float* lw = w + (size_t)l * s->k;
        if (!(l == from && routed)) {
            // attn_block reads h into its GEMV's own copy before it writes h_out: h may be both (ggml_attn_block
            // reads h in its q|k|v GEMVs, before it writes h_out)
            if (const StepGgmlAttn* a = ly.ggml)
                ggml_attn_block(x, h, s->H, a->ptrs, a->types, a->rows, a->nparts, a->o_w, a->o_type, cos, sin,
                                ly.k_cache + slot_rows, ly.v_cache + slot_rows, p, s->window, s->nh, s->nkv, s->hd,
                                s->rot, s->scale, scores, ly.post_w, s->eps, qkv, o_buf, r, h, threads);
            else
                attn_block(x, h, s->H, ly.qkv_p, ly.qkv_sz, s->nqkv, ly.o_p, ly.o_sz, s->g, cos, sin,
                           ly.k_cache + slot_rows, ly.v_cache + slot_rows, p, s->window, s->nh, s->nkv, s->hd, s->rot,
                           s->scale, scores, ly.post_w, s->eps, qkv, o_buf, r, h, threads);
            router_topk(h, s->H, ly.gate, s->E, s->k, s->renorm, lid, lw);
        }
        for (int j = 0; j < s->k; ++j) {
            recs[j] = records[(size_t)l * s->E + lid[j]];
            if (!recs[j]) return l;
        }
        // moe_tail (ggml_moe_tail) reads h in every expert's FFN and writes h_out only at its end: h may be both
        if (s->ggml_tail)
            ggml_moe_tail(h, s->k, lid, recs, lw, s->H, s->I, s->gate_off, s->up_off, s->down_off, moe, x, ly.next_w,
                          s->eps, h, threads, s->limit);
        else
            moe_tail(h, s->k, lid, recs, lw, s->H, s->I, s->gu_off, s->gu_sz_off, s->d_off, s->d_sz_off, s->fg, moe,
                     x, ly.next_w, s->eps, h, threads, s->limit);
    }
    return s->L;
}

// y [N] = Σ_b d[n, b] · Σ_{i<32} q[n, 32b + i] · x[32b + i]; q int8 [N, K], d fp32 [N, K/32], K % 32 == 0.
void q8_gemv_rows(const float* x, int M, int K, const int8_t* q, const float* d, int N, float* y, int threads);

void q8_gemv(const float* x, int K, const int8_t* q, const float* d, int N, float* y, int threads) {
    q8_gemv_rows(x, 1, K, q, d, N, y, threads);
}

// y [M, N] = x [M, K] · Wᵀ row by row, W = q int8 [N, K] · d fp32 [N, K/32] per 32 inputs: each row of x computed
// exactly as a one-row q8_gemv computes it (the rows loop inside a chunk of weight rows, so the chunk is read once).
void q8_gemv_rows(const float* x, int M, int K, const int8_t* q, const float* d, int N, float* y, int threads) {
    const int blocks = K / 32;
    const int chunk = 16;      // rows per scheduling unit
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int c = 0; c < (N + chunk - 1) / chunk; ++c) {
        const int end = N < (c + 1) * chunk ? N : (c + 1) * chunk;
        for (int m = 0; m < M; ++m) {       // the rows of x, each as a one-row call computes it
        const float* xm = x + (size_t)m * K;
        float* ym = y + (size_t)m * N;
        int n = c * chunk;
#if defined(__AVX512F__)
        for (; n + 4 <= end; n += 4) {        // four rows at once: four independent accumulations
            const int8_t* row = q + (size_t)n * K;
            for (int l = 0; l < 4 * K; l += 64) _mm_prefetch((const char*)row + PREFETCH + l, _MM_HINT_T0);
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int b = 0; b < blocks; ++b) {
                const __m512 x0 = _mm512_loadu_ps(xm + 32 * b), x1 = _mm512_loadu_ps(xm + 32 * b + 16);
                for (int r = 0; r < 4; ++r) {
                    const int8_t* qb = row + (size_t)r * K + 32 * b;
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qb))), x0);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qb + 16)))), x1, t);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[(size_t)(n + r) * blocks + b]), t, acc[r]);
                }
            }
            for (int r = 0; r < 4; ++r) ym[n + r] = _mm512_reduce_add_ps(acc[r]);
        }
#endif
        for (; n < end; ++n) {
            const int8_t* row = q + (size_t)n * K;
            const float* dr = d + (size_t)n * blocks;
#if defined(__AVX512F__)
            __m512 acc = _mm512_setzero_ps();
            for (int b = 0; b < blocks; ++b) {
                __m128i q0 = _mm_loadu_si128((const __m128i*)(row + 32 * b));
                __m128i q1 = _mm_loadu_si128((const __m128i*)(row + 32 * b + 16));
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_loadu_ps(xm + 32 * b));
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_loadu_ps(xm + 32 * b + 16), t);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(dr[b]), t, acc);
            }
            ym[n] = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
            if (!(n & 3)) for (int l = 0; l < 4 * K; l += 64) _mm_prefetch((const char*)row + PREFETCH + l, _MM_HINT_T0);
            __m256 acc = _mm256_setzero_ps();
            for (int b = 0; b < blocks; ++b) {
                __m256 t = _mm256_setzero_ps();
                for (int j = 0; j < 4; ++j) {
                    __m128i qj = _mm_loadl_epi64((const __m128i*)(row + 32 * b + 8 * j));
                    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qj)), _mm256_loadu_ps(xm + 32 * b + 8 * j), t);
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dr[b]), t, acc);
            }
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_movehdup_ps(s));
            ym[n] = _mm_cvtss_f32(s);
#else
            float acc = 0.f;
            for (int b = 0; b < blocks; ++b) {
                float t = 0.f;
                for (int i = 0; i < 32; ++i) t += float(row[32 * b + i]) * xm[32 * b + i];
                acc += dr[b] * t;
            }
            ym[n] = acc;
#endif
        }
        }
    }
}

// GGML types (engine.quant.ggml): 1 where type t has a kernel here, else 0.
int ggml_supported(int t) { return ggml_type(t).block != 0; }

// Whether the GGUF GEMVs round x to 8 bits (the int8 activations region); set around a model's passes.
void set_int8_activations(int on) { g_int8_activations = on ? 1 : 0; }
int int8_activations() { return g_int8_activations; }

// x [K] rounded to 8 bits as the int8 GEMVs round it for a matrix of GGML type t (its Q8 kind): codes q [K], scales
// d [K/32] (Q8_K's once per 32), and xs [K/32], what a block's min multiplies (Q8_1's s). K % 256 == 0 for Q8_K.
void q8_quantize(const float* x, int K, int t, int8_t* q, float* d, float* xs) {
    const Q8Rows r(x, 1, K, 1 << q8_kind(t));
    const Q8x v = r.row(0, t);
    std::memcpy(q, v.q, (size_t)K);
    std::memcpy(d, v.d, sizeof(float) * (K / 32));
    std::memcpy(xs, v.xs, sizeof(float) * (K / 32));
}

// y [M, N] = x [M, K] · Wᵀ, W [N, K] a GGUF matrix of GGML type t, as the file holds its blocks (K whole blocks).
void ggml_matmul(int t, const float* x, int M, int K, const uint8_t* w, int N, float* y, int threads) {
    ggml_mm(t, x, M, K, w, N, y, threads);
}

// y = x [K] · [W_0; W_1; ...]ᵀ: up to 3 GGUF matrices of one input (ptrs[i] [rows[i], K] of GGML types types[i])
// as one GEMV (ggml_gemv_parts: the q|k|v and gate|up a decode step runs), each output ggml_matmul's bits.
void ggml_gemv_stack(const float* x, int K, int nparts, const uint64_t* ptrs, const int* types, const int* rows,
                     float* y, int threads) {
    const uint8_t* parts[3];
    for (int i = 0; i < nparts; ++i) parts[i] = reinterpret_cast<const uint8_t*>(ptrs[i]);
    ggml_gemv_parts(x, K, nparts, parts, types, rows, y, threads);
}

// One expert on one token from three GGUF matrices, each in its own type: gate, up [I, H], down [H, I];
// y [H] = down(silu(gate x) * up x). scratch: 3I floats. limit: swiglu's (0: none).
void ggml_ffn(const float* x, int H, int I, const uint8_t* gate, int gt, const uint8_t* up, int ut,
              const uint8_t* down, int dt, float* scratch, float* y, int threads, float limit) {
    float *g = scratch, *u = scratch + I, *h = scratch + 2 * I;
    const uint8_t* parts[2] = {gate, up};
    const int types[2] = {gt, ut}, rows[2] = {I, I};
    ggml_gemv_parts(x, H, 2, parts, types, rows, g, threads);         // g|u
    swiglu(g, u, I, limit, h);
    ggml_mm(dt, h, 1, I, down, H, y, threads);
}

// attn_block for a GGUF's own blocks: q|k|v as up to 3 consecutive matrices (ptrs[i] of GGML type types[i], rows[i]
// output rows each, [rows, H]) → qkv, attn_decode, o [H, nh·hd] of type o_type → x += o, h_out = rms_norm(x)·post_w.
// qkv, o_buf, r: scratch of Σrows, nh·hd and H floats.
void ggml_attn_block(float* x, const float* h, int H, const uint64_t* ptrs, const int* types, const int* rows,
                     int nparts, const uint8_t* o_w, int o_type, const float* cos, const float* sin, float* kc,
                     float* vc, int p, int window, int nh, int nkv, int hd, int rot, float scale, float* scores,
                     const float* post_w, float eps, float* qkv, float* o_buf, float* r, float* h_out, int threads) {
    const uint8_t* parts[3];
    for (int i = 0; i < nparts; ++i) parts[i] = reinterpret_cast<const uint8_t*>(ptrs[i]);
    ggml_gemv_parts(h, H, nparts, parts, types, rows, qkv, threads);
    attn_decode_direct(qkv, cos, sin, kc, vc, p, window, nh, nkv, hd, rot, scale, scores, o_buf, threads);
    ggml_mm(o_type, o_buf, 1, nh * hd, o_w, H, r, threads);
    add_rms_norm(x, r, post_w, eps, H, h_out);
}

// moe_tail for a layer's ggml: records (each matrix in its own GGML type, named by the record's header: bytes 4..6
// its gate, up and down type codes; offs: each matrix's byte offset in the record): the k picked experts' ggml_ffn
// in ascending expert order, out = y·w (+ y'·w' ...) as moe_tail sums them, then add_rms_norm(x, out, next_w) into
// h_out. scratch: 3I + 2H floats.
void ggml_moe_tail(const float* h, int k, const int64_t* ids, const uint64_t* recs, const float* w, int H, int I,
                   int64_t gate_off, int64_t up_off, int64_t down_off, float* scratch, float* x, const float* next_w,
                   float eps, float* h_out, int threads, float limit) {
    float *y = scratch + 3 * I, *out = y + H;
    moe_picks_norm(k, ids, w, H, [&](int j, float* yj) {
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[j]);
        ggml_ffn(h, H, I, rec + gate_off, rec[4], rec + up_off, rec[5], rec + down_off, rec[6], scratch, yj, threads,
                 limit);
    }, y, out, x, next_w, eps, h_out);
}

}  // extern "C"

// ============================================================================================ CPU EXPERT LANE BEGIN
// The CPU expert lane's kernels (engine.kernels.lane): one call computes all of a MoE layer's CPU-lane picks for
// the step's tokens on a team of `threads` OpenMP threads, each pinned to one of the lane's CPUs, and the
// caller (ctypes.CDLL) releases the GIL for it.
//
// lane_int4_moe: out [T, H] = Σ over picks p (in the order given) of w[p]·FFN(record p, x[tok[p]]); a token no
//   pick names gets zeros. FFN is the int4 kernel's function (int4_ffn's): x rounded to bf16, fp32 accumulation per
//   group s·Σq·x + (z - 8s)·Σx, the GEMV outputs rounded to bf16, h = silu(gate)·up as int4_ffn forms it.
//   order 1 (cols: gate|up and down as torch's int4pack operands, QuantLayout.cpu_int4): the tiles int4_gemv
//     computes (int4_tile / int4_tile_bf16), so every pick is bitwise int4_ffn's.
//   order 0 (rows: the GPU kernels' int4 form, codes [out][in/2] byte j = q[2j] | q[2j+1] << 4, (s, z) bf16
//     [out][in/32][2]; what a CUDA machine's RAM tier holds): the same function, each row's Σq·x over 16 lanes
//     (lane j: inputs 2j and 2j+1 of each group) summed in a fixed tree, so AVX-512F, AVX2 and the scalar form
//     give the same bits; with AVX512_BF16 (lane_rows_bf16) two groups a step as bf16 pairs of (128 + q)·x, another
//     summation (within a bf16 rounding of the others: tests/engine/test_lane_kernel.py).
//   The sum over picks is out = y·w, then out + y'·w' ... per token (moe_forward's one-token sum, moe_tail's),
//   computed after every pick is done: which thread computed which part never changes a bit.
//   Work: (pick, row chunk) items of gate|up over the team, then each pick's silu, then (pick, chunk) items of
//   down, then the sum over H-column chunks; a layer's experts and each expert's rows are split alike, so one
//   pick or 32 keep every thread busy.
//   Refuses (returns 1) what it was not written for: groups other than 32, cols rows not a multiple of 64. Its
//   silu(gate)·up is int4_ffn's: swiglu() with the same `limit` (glm5_next's swiglu_limit; 0: none).
// lane_read: the host's DRAM read rate the lane is set beside: `threads` pinned threads stream disjoint parts of a
//   buffer (64-byte loads summed into a checksum, so the reads stay).
// lane_isa: the kernels built here: 3 AVX-512 + BF16 dot products, 2 AVX-512F, 1 AVX2 + FMA, 0 scalar.
#include <omp.h>
#include <pthread.h>
#include <sched.h>

namespace {

constexpr int LANE_ROWS = 64;        // output rows of one cols work item (an int4pack tile)
// Output rows of one rows-order (and ggml) work item: about 8 items a thread over the call's rows, 16..128. A
// 16-row item is a few microseconds, spent largely in the shared counter and on the cache lines its neighbours
// write (2 threads ran slower than 1); 16 still spreads one pick's rows over 16 threads.
inline int lane_item_rows(int n, int I, int H, int threads) {
    return std::min(128, std::max(16, (int)((long)n * (2 * I + H) / (8L * threads)) / 16 * 16));
}

// Pin the calling OpenMP thread to cpus[tid % n] once (a team thread stays pinned across calls).
inline void lane_pin(const int* cpus, int ncpus) {
    if (ncpus <= 0) return;
    static thread_local int pinned = -1;
    const int cpu = cpus[omp_get_thread_num() % ncpus];
    if (pinned == cpu) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) pinned = cpu;
}

// Before a row of an item is computed, the lines LANE_AHEAD bytes past it (within the item) are asked for: an item
// is a short stream (16-128 rows) that the hardware prefetcher meets cold.
constexpr size_t LANE_AHEAD = 8192;
inline void lane_prefetch_ahead(const uint8_t* row, size_t row_bytes, const uint8_t* end) {
    for (const uint8_t* p = row + LANE_AHEAD; p < row + LANE_AHEAD + row_bytes && p < end; p += 64)
        _mm_prefetch((const char*)p, _MM_HINT_T0);
}

inline void lane_prefetch_start(const uint8_t* start, const uint8_t* end) {     // an item's first LANE_AHEAD bytes
    for (const uint8_t* p = start; p < start + LANE_AHEAD && p < end; p += 64) _mm_prefetch((const char*)p, _MM_HINT_T0);
}

inline float lane_tree16(float* a) {            // a fixed summation tree over 16 lanes
    for (int h = 8; h >= 1; h /= 2)
        for (int j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
    return a[0];
}

// Σ_g (z_g - eight·s_g)·xs_g of one row (eight: 8; 136 where the sums hold 128 + q), lane l summing the groups g ≡ l (mod 16) in order, then lane_tree16.
inline float lane_zero_term(const uint16_t* p, const float* xs, int groups, float eight = 8.0f) {
    alignas(64) float c[16];
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    for (int g0 = 0; g0 < groups; g0 += 16) {
        const __mmask16 m = groups - g0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g0)) - 1);
        const __m512i v = _mm512_maskz_loadu_epi32(m, (const void*)(p + 2 * g0));
        const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
        acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(eight), sv, zv), _mm512_maskz_loadu_ps(m, xs + g0), acc);
    }
    _mm512_store_ps(c, acc);
#else
    for (int l = 0; l < 16; ++l) c[l] = 0.f;
    for (int g = 0; g < groups; ++g) {
        const float s = bf16_to_float(p[2 * g]), z = bf16_to_float(p[2 * g + 1]);
        c[g % 16] = std::fma(std::fma(-eight, s, z), xs[g], c[g % 16]);
    }
#endif
    return lane_tree16(c);
}

#if defined(__AVX512BF16__)
// lane_rows with bf16 dot products: 32 code bytes (two groups) a step, each weight the bf16 of 128 + q (exact), two
// weights a 32-bit lane (bytes 2j, 2j+1 of a group: lo nibbles q[4j], q[4j+2]; hi nibbles q[4j+1], q[4j+3]) against
// the input pairs xlo, xhi (8 a group each); Σ(128 + q)·x·s less 128·s·Σx goes into the zero term (z - 136s).
void lane_rows_bf16(const uint32_t* xlo, const uint32_t* xhi, const float* xs, int K, const uint8_t* codes,
                    const uint16_t* sz, int r0, int r1, float* y) {
    const int groups = K / 32;
    const __m512i nib = _mm512_set1_epi32(0x000f000f), bias = _mm512_set1_epi32(0x43004300);
    const __m512i sidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int r = r0; r < r1; ++r) {
        const uint8_t* q = codes + (size_t)r * (K / 2);
        const uint16_t* p = sz + (size_t)r * groups * 2;
        __m512 acc = _mm512_setzero_ps();
        for (int gi = 0; gi < groups; gi += 2) {
            const bool two = gi + 1 < groups;
            const __mmask16 m = two ? (__mmask16)0xffff : (__mmask16)0x00ff;
            if (!(gi & 3)) _mm_prefetch((const char*)(q + 16 * gi) + PREFETCH, _MM_HINT_T0);
            const __m256i raw = two ? _mm256_loadu_si256((const __m256i*)(q + 16 * gi))
                                    : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(q + 16 * gi)));
            const __m512i v = _mm512_cvtepu8_epi16(raw);
            const __m512i lo = _mm512_ternarylogic_epi32(v, nib, bias, 0xea);                       // (A & B) | C
            const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nib, bias, 0xea);
            __m512 ga = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo,
                                         (__m512bh)_mm512_maskz_loadu_epi32(m, (const void*)(xlo + 8 * gi)));
            ga = _mm512_dpbf16_ps(ga, (__m512bh)hi, (__m512bh)_mm512_maskz_loadu_epi32(m, (const void*)(xhi + 8 * gi)));
            const __m512i pairs = _mm512_castsi128_si512(two ? _mm_loadl_epi64((const __m128i*)(p + 2 * gi))
                                                             : _mm_cvtsi32_si128(*(const int*)(p + 2 * gi)));
            const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_permutexvar_epi32(sidx, pairs), 16));
            acc = _mm512_fmadd_ps(ga, sv, acc);
        }
        alignas(64) float a[16];
        _mm512_store_ps(a, acc);
        y[r] = bf16_round(lane_tree16(a) + lane_zero_term(p, xs, groups, 136.0f));
    }
}
#endif

// Rows r0..r1 of a rows-form int4 matrix [N, K] (group 32) on one prepared input: xd per group the 16 even then the
// 16 odd inputs (bf16-rounded), xs per group Σx in input order → y[r] = bf16(Σ_lanes Σ_g s_g·t_g + the zero term),
// t_g lane j = q[2j]·x[2j] + q[2j+1]·x[2j+1] of group g (a multiply, then an FMA), each lane a chain of FMAs.
[[maybe_unused]] void lane_rows(const float* xd, const float* xs, int K, const uint8_t* codes, const uint16_t* sz, int r0, int r1,
               float* y) {
    const int groups = K / 32;
    for (int r = r0; r < r1; ++r) {
        const uint8_t* q = codes + (size_t)r * (K / 2);
        const uint16_t* p = sz + (size_t)r * groups * 2;
        alignas(64) float a[16];
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        const __m512i low = _mm512_set1_epi32(15);
        for (int gi = 0; gi < groups; ++gi) {
            if (!(gi & 3)) _mm_prefetch((const char*)(q + 16 * gi) + PREFETCH, _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * gi)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
            __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xd + 32 * gi));
            t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xd + 32 * gi + 16), t);
            uint32_t pair;                                  // (s, z): s the low bf16
            std::memcpy(&pair, p + 2 * gi, 4);
            const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32((int)pair), 16));
            acc = _mm512_fmadd_ps(t, sv, acc);
        }
        _mm512_store_ps(a, acc);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        const __m256i low = _mm256_set1_epi32(15);
        for (int gi = 0; gi < groups; ++gi) {
            if (!(gi & 3)) _mm_prefetch((const char*)(q + 16 * gi) + PREFETCH, _MM_HINT_T0);
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * gi)));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 16 * gi + 8)));
            const float* xe = xd + 32 * gi;
            __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), _mm256_loadu_ps(xe));
            __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), _mm256_loadu_ps(xe + 8));
            t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_loadu_ps(xe + 16), t0);
            t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), _mm256_loadu_ps(xe + 24), t1);
            const __m256 sv = _mm256_set1_ps(bf16_to_float(p[2 * gi]));
            acc0 = _mm256_fmadd_ps(t0, sv, acc0);
            acc1 = _mm256_fmadd_ps(t1, sv, acc1);
        }
        _mm256_store_ps(a, acc0);
        _mm256_store_ps(a + 8, acc1);
#else
        for (int j = 0; j < 16; ++j) a[j] = 0.f;
        for (int gi = 0; gi < groups; ++gi) {
            const float s = bf16_to_float(p[2 * gi]);
            for (int j = 0; j < 16; ++j) {
                const uint8_t b = q[16 * gi + j];
                float t = float(b & 15) * xd[32 * gi + j];
                t = std::fma(float(b >> 4), xd[32 * gi + 16 + j], t);
                a[j] = std::fma(t, s, a[j]);
            }
        }
#endif
        y[r] = bf16_round(lane_tree16(a) + lane_zero_term(p, xs, groups));
    }
}

// One input prepared for the GEMVs of either order: bf16-rounded (xr), its group sums, and per order the form the
// tiles read (cols + BF16: bf16 pairs; rows: each group's even inputs then its odd ones).
struct LaneInput {
    std::vector<float> xr, xs, xd;
    std::vector<uint32_t> xp, xlo, xhi;
    void prepare(const float* x, int K, int g, int order) {
        xr.resize(K);
        xs.resize(K / g);
        for (int k = 0; k < K; ++k) xr[k] = bf16_round(x[k]);
        for (int gi = 0; gi < K / g; ++gi) {             // int4_gemv's sums, in input order
            float s = 0.f;
            for (int k = gi * g; k < (gi + 1) * g; ++k) s += xr[k];
            xs[gi] = s;
        }
#if defined(__AVX512BF16__)
        if (order == 0) {                                // lane_rows_bf16's pairs
            xlo.resize(K / 4);
            xhi.resize(K / 4);
            auto bits = [&](int k) { uint32_t u; std::memcpy(&u, &xr[k], 4); return u >> 16; };
            for (int gi = 0; gi < K / 32; ++gi)
                for (int j = 0; j < 8; ++j) {
                    const int k = 32 * gi + 4 * j;
                    xlo[8 * gi + j] = bits(k) | bits(k + 2) << 16;
                    xhi[8 * gi + j] = bits(k + 1) | bits(k + 3) << 16;
                }
            return;
        }
#endif
        if (order == 0) {
            xd.resize(K);
            for (int gi = 0; gi < K / 32; ++gi)
                for (int j = 0; j < 16; ++j) {
                    xd[32 * gi + j] = xr[32 * gi + 2 * j];
                    xd[32 * gi + 16 + j] = xr[32 * gi + 2 * j + 1];
                }
        }
#if defined(__AVX512BF16__)
        if (order == 1 && g == 32) {
            xp.resize(K / 2);
            for (int gi = 0; gi < K / 32; ++gi)
                for (int j = 0; j < 16; ++j) {
                    uint32_t a, b;
                    std::memcpy(&a, &xr[32 * gi + j], 4);
                    std::memcpy(&b, &xr[32 * gi + 16 + j], 4);
                    xp[16 * gi + j] = (a >> 16) | (b & 0xffff0000u);
                }
        }
#endif
    }
};

// Output rows [r·c, r·c + r) ∩ [0, N) (r: 64 cols, `rows` rows) of one matrix (its codes and scales at `codes`, `sz`)
// on a prepared input.
void lane_chunk(const LaneInput& in, int K, int N, int g, int order, const uint8_t* codes, const uint16_t* sz,
                int c, int rows, float* y) {
    if (order == 0) {
        const int r0 = c * rows, r1 = r0 + rows < N ? r0 + rows : N;
#if defined(__AVX512BF16__)
        lane_rows_bf16(in.xlo.data(), in.xhi.data(), in.xs.data(), K, codes, sz, r0, r1, y);
#else
        lane_rows(in.xd.data(), in.xs.data(), K, codes, sz, r0, r1, y);
#endif
        return;
    }
    const int r0 = c * LANE_ROWS, r1 = r0 + LANE_ROWS < N ? r0 + LANE_ROWS : N;
#if defined(__AVX512BF16__)
    if (g == 32) {
        int4_tile_bf16(in.xp.data(), in.xs.data(), K, codes + (size_t)c * K * 32, sz, N, r0, y + r0);
        for (int r = r0; r < r1; ++r) y[r] = bf16_round(y[r]);
        return;
    }
#endif
    int4_tile(in.xr.data(), in.xs.data(), K, g, codes + (size_t)c * K * 32, sz, N, r0, y + r0);
    for (int r = r0; r < r1; ++r) y[r] = bf16_round(y[r]);
}

// Inside a lane team's parallel region: out [T, H] = per token, the picks naming it in the order given, y·w then
// + y'·w' ... (moe_forward's one-token sum), 256 columns a work item; a token no pick names gets zeros.
void lane_sum_picks(int T, int H, int n, const int32_t* tok, const float* w, const float* ys, float* out) {
    const int col_chunks = (H + 255) / 256;
#pragma omp for schedule(static)
    for (long it = 0; it < (long)T * col_chunks; ++it) {
        const int t = it / col_chunks, c0 = (it % col_chunks) * 256, c1 = c0 + 256 < H ? c0 + 256 : H;
        float* o = out + (size_t)t * H;
        bool first = true;
        for (int p = 0; p < n; ++p) {
            if (tok[p] != t) continue;
            const float* y = ys + (size_t)p * H;
            const float wp = w[p];
            if (first)
                for (int i = c0; i < c1; ++i) o[i] = y[i] * wp;
            else
                for (int i = c0; i < c1; ++i) o[i] = o[i] + y[i] * wp;
            first = false;
        }
        if (first)
            for (int i = c0; i < c1; ++i) o[i] = 0.f;
    }
}

}  // namespace

extern "C" {

int lane_isa() {
#if defined(__AVX512BF16__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

// x fp32 [T, H]; n picks: token tok[p], record address recs[p], weight w[p]; off: rows (order 0) gate codes, gate
// (s, z), up codes, up (s, z), down codes, down (s, z) byte offsets in a record; cols (order 1) gate|up codes, their
// (s, z), down codes, their (s, z). out fp32 [T, H]. cpus[0..ncpus): the CPUs team thread i is pinned to (cpus[i %
// ncpus]); ncpus 0: unpinned. → 0, or 1 where the shapes are not ones this kernel computes (nothing written).
int lane_int4_moe(const float* x, int T, int H, int I, int g, int order, const int64_t* off, int n,
                  const int32_t* tok, const uint64_t* recs, const float* w, float* out, int threads,
                  const int* cpus, int ncpus, float limit) {
    if (g != 32 || H % 32 || I % 32 || n < 0 || T < 1 || (order == 1 && (H % 64 || (2 * I) % 64)) ||
        (order != 0 && order != 1))
        return 1;
    for (int p = 0; p < n; ++p)
        if (tok[p] < 0 || tok[p] >= T) return 1;
    if (threads < 1) threads = 1;
    const int rows = order == 1 ? LANE_ROWS : lane_item_rows(n, I, H, threads);
    const int half = (I + rows - 1) / rows;                // rows: gate chunks, then up chunks
    const int gu_chunks = order == 1 ? 2 * I / LANE_ROWS : 2 * half;
    const int d_chunks = (H + rows - 1) / rows;
    std::vector<LaneInput> xin(T), hin(n);
    std::vector<float> gu((size_t)n * 2 * I), ys((size_t)n * H);
#pragma omp parallel num_threads(threads)
    {
        lane_pin(cpus, ncpus);
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < T; ++t) xin[t].prepare(x + (size_t)t * H, H, g, order);
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < (long)n * gu_chunks; ++it) {
            const int p = it / gu_chunks, c = it % gu_chunks;
            const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[p]);
            float* y = gu.data() + (size_t)p * 2 * I;
            if (order == 1)
                lane_chunk(xin[tok[p]], H, 2 * I, g, 1, rec + off[0], reinterpret_cast<const uint16_t*>(rec + off[1]),
                           c, rows, y);
            else if (c < half)
                lane_chunk(xin[tok[p]], H, I, g, 0, rec + off[0], reinterpret_cast<const uint16_t*>(rec + off[1]), c,
                           rows, y);
            else
                lane_chunk(xin[tok[p]], H, I, g, 0, rec + off[2], reinterpret_cast<const uint16_t*>(rec + off[3]),
                           c - half, rows, y + I);
        }
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < n; ++p) {                      // int4_ffn's silu(gate)·up, then down's input
            const float* a = gu.data() + (size_t)p * 2 * I;
            std::vector<float> h(I);
            swiglu(a, a + I, I, limit, h.data());
            hin[p].prepare(h.data(), I, g, order);
        }
        const int64_t d_codes = order == 1 ? off[2] : off[4], d_sz = order == 1 ? off[3] : off[5];
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < (long)n * d_chunks; ++it) {
            const int p = it / d_chunks, c = it % d_chunks;
            const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[p]);
            lane_chunk(hin[p], I, H, g, order, rec + d_codes, reinterpret_cast<const uint16_t*>(rec + d_sz), c, rows,
                       ys.data() + (size_t)p * H);
        }
        lane_sum_picks(T, H, n, tok, w, ys.data(), out);
    }
    return 0;
}

// lane_int4_moe for ggml: records (a GGUF's experts, each matrix in its own GGML type, which the record's header
// names: bytes 4..6 its gate, up and down type codes; off: the three matrices' byte offsets): gate [I, H], up [I, H],
// down [H, I]. Each output row is ggml_row1's, so each pick is bitwise what ggml_ffn computes for it (float x, or
// x rounded to 8 bits in the int8 mode), and the sum over picks is lane_int4_moe's. → 0, or 1 where a type or a
// shape is not one this kernel computes (nothing written).
int lane_ggml_moe(const float* x, int T, int H, int I, const int64_t* off, int n, const int32_t* tok,
                  const uint64_t* recs, const float* w, float* out, int threads, const int* cpus, int ncpus,
                  float limit) {
    if (n < 0 || T < 1 || H % 32 || I % 32) return 1;
    for (int p = 0; p < n; ++p) {
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[p]);
        if (tok[p] < 0 || tok[p] >= T) return 1;
        for (int m = 0; m < 3; ++m) {
            const GgmlType gt = ggml_type(rec[4 + m]);
            if (gt.block == 0 || (m < 2 ? H : I) % gt.block) return 1;
        }
    }
    if (threads < 1) threads = 1;
    int kinds_x = 0, kinds_h = 0;                          // the roundings of x and h the picks' types read
    for (int p = 0; p < n; ++p) {
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[p]);
        const int gu[2] = {rec[4], rec[5]};
        kinds_x |= q8_kinds_of(gu, 2);
        kinds_h |= 1 << q8_kind(rec[6]);
    }
    const int R = lane_item_rows(n, I, H, threads);
    const int half = (I + R - 1) / R, gu_chunks = 2 * half, d_chunks = (H + R - 1) / R;
    std::vector<std::unique_ptr<GgmlRowInput>> xin(T), hin(n);
    std::vector<float> gu((size_t)n * 2 * I), ys((size_t)n * H);
#pragma omp parallel num_threads(threads)
    {
        lane_pin(cpus, ncpus);
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < T; ++t) xin[t] = std::make_unique<GgmlRowInput>(x + (size_t)t * H, H, kinds_x);
#pragma omp for schedule(static)
        for (long it = 0; it < (long)n * gu_chunks; ++it) {
            const int p = it / gu_chunks, c = it % gu_chunks, m = c < half ? 0 : 1;
            const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[p]);
            const int t = rec[4 + m];
            const GgmlType gt = ggml_type(t);
            const size_t row_bytes = (size_t)H / gt.block * gt.size;
            const int r0 = (c - m * half) * R, r1 = r0 + R < I ? r0 + R : I;
            float* y = gu.data() + (size_t)p * 2 * I + (size_t)m * I;
            lane_prefetch_start(rec + off[m] + r0 * row_bytes, rec + off[m] + r1 * row_bytes);
            for (int r = r0; r < r1; ++r) {
                lane_prefetch_ahead(rec + off[m] + r * row_bytes, row_bytes, rec + off[m] + r1 * row_bytes);
                y[r] = ggml_row1(t, rec + off[m] + r * row_bytes, *xin[tok[p]], H);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int p = 0; p < n; ++p) {                      // ggml_ffn's silu(gate)·up, then down's input
            const float* a = gu.data() + (size_t)p * 2 * I;
            std::vector<float> h(I);
            swiglu(a, a + I, I, limit, h.data());
            hin[p] = std::make_unique<GgmlRowInput>(h.data(), I, kinds_h);
        }
#pragma omp for schedule(static)
        for (long it = 0; it < (long)n * d_chunks; ++it) {
            const int p = it / d_chunks, c = it % d_chunks;
            const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[p]);
            const int t = rec[6];
            const GgmlType gt = ggml_type(t);
            const size_t row_bytes = (size_t)I / gt.block * gt.size;
            const int r0 = c * R, r1 = r0 + R < H ? r0 + R : H;
            float* y = ys.data() + (size_t)p * H;
            lane_prefetch_start(rec + off[2] + r0 * row_bytes, rec + off[2] + r1 * row_bytes);
            for (int r = r0; r < r1; ++r) {
                lane_prefetch_ahead(rec + off[2] + r * row_bytes, row_bytes, rec + off[2] + r1 * row_bytes);
                y[r] = ggml_row1(t, rec + off[2] + r * row_bytes, *hin[p], I);
            }
        }
        lane_sum_picks(T, H, n, tok, w, ys.data(), out);
    }
    return 0;
}

// Stream-read bytes [0, n) of buf on `threads` pinned threads (as lane_int4_moe pins them), each a contiguous part,
// 64-byte loads summed → the sum (so the reads are not optimised away).
uint64_t lane_read(const uint8_t* buf, int64_t n, int threads, const int* cpus, int ncpus) {
    uint64_t total = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        lane_pin(cpus, ncpus);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lines = n / 64, a = lines * t / nt * 64, b = lines * (t + 1) / nt * 64;
#if defined(__AVX512F__)
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        int64_t i = a;
        for (; i + 128 <= b; i += 128) {
            s0 = _mm512_add_epi64(s0, _mm512_loadu_si512((const void*)(buf + i)));
            s1 = _mm512_add_epi64(s1, _mm512_loadu_si512((const void*)(buf + i + 64)));
        }
        for (; i < b; i += 64) s0 = _mm512_add_epi64(s0, _mm512_loadu_si512((const void*)(buf + i)));
        total += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1));
#elif defined(__AVX2__)
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int64_t i = a; i < b; i += 64) {
            s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i*)(buf + i)));
            s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i*)(buf + i + 32)));
        }
        alignas(32) uint64_t v[4];
        _mm256_store_si256((__m256i*)v, _mm256_add_epi64(s0, s1));
        total += v[0] + v[1] + v[2] + v[3];
#else
        for (int64_t i = a; i < b; i += 8) {
            uint64_t v;
            std::memcpy(&v, buf + i, 8);
            total += v;
        }
#endif
    }
    return total;
}

}  // extern "C"
// ============================================================================================== CPU EXPERT LANE END
