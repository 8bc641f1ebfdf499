// One-token CPU GEMVs for the engine's decode step (engine.kernels.native builds and loads this file).
//
// int4pack_gemv: torch's CPU int4 operand (engine.quant.records: per 64 output rows, for each input k, 32
//   bytes whose low nibbles are rows 0..31 and high nibbles rows 32..63; (s, z) bf16 pairs [in/g, out, 2];
//   w = (q - 8)·s + z), computed as torch.ops.aten._weight_int4pack_mm_for_cpu computes it: x rounded to
//   bf16, fp32 accumulation, y rounded to bf16. Summed per group as s·Σq·x + (z - 8s)·Σx.
// q8_gemv: int8 codes [out, in] with an fp32 scale per 32 inputs (a GGUF Q8_0 matrix, its fp16 scales
//   widened): y = Σ_b d_b · Σ q·x, in fp32.
// int4_ffn: one quantized expert (gate|up and down int4pack operands) on one token, as quant_ffn computes it.
// add_rms_norm, attn_decode: the rest of a one-token decode layer (residual add + RMSNorm; rotary, KV write
//   and attention over the cache), in the torch forms' operation order where it is elementwise (built with
//   -ffp-contract=off, so a*b + c*d is not fused into an FMA unless written so).
// The GEMVs and the attention split their work over `threads` OpenMP threads (torch's own libgomp once torch
// is loaded).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

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
// int4_tile with bf16 dot products (groups of 32 only): each weight becomes the bf16 of 128 + q (0x4300 | q, exact),
// two inputs k and k + 16 of a group are one bf16 pair, so one vdpbf16ps does 16 rows × 2 inputs; Σ(128 + q)·x
// - 128·Σx = Σq·x. The pairs hold even and odd rows (E, O): rows are interleaved back at the end. xp: per group
// 16 pairs (bf16 x[32g + j] | bf16 x[32g + 16 + j] << 16).
void int4_tile_bf16(const uint32_t* xp, const float* xs, int K, const uint8_t* tile, const uint16_t* sz, int N,
                    int row0, float* y) {
    const __m512i lo16 = _mm512_set1_epi32(0x0000ffff), hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i nib = _mm512_set1_epi32(0x000f000f), bias = _mm512_set1_epi32(0x43004300);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
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
            __m512i w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + 32 * j)));
            __m512i w2 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + 32 * (j + 16))));
            __m512i e = _mm512_ternarylogic_epi32(w1, _mm512_slli_epi32(w2, 16), lo16, 0xec);   // (A & C) | B
            __m512i o = _mm512_ternarylogic_epi32(_mm512_srli_epi32(w1, 16), w2, hi16, 0xf8);   // A | (B & C)
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[gi * 16 + j]);
            ga[0] = _mm512_dpbf16_ps(ga[0], (__m512bh)_mm512_ternarylogic_epi32(e, nib, bias, 0xea), xb);
            ga[1] = _mm512_dpbf16_ps(ga[1], (__m512bh)_mm512_ternarylogic_epi32(o, nib, bias, 0xea), xb);
            ga[2] = _mm512_dpbf16_ps(ga[2], (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(e, 4), nib, bias, 0xea), xb);
            ga[3] = _mm512_dpbf16_ps(ga[3], (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(o, 4), nib, bias, 0xea), xb);
        }
        const uint16_t* p = sz + ((size_t)gi * N + row0) * 2;      // (s, z) of a row: one 32-bit lane
        const __m512i v0 = _mm512_loadu_si512((const void*)p), v1 = _mm512_loadu_si512((const void*)(p + 32));
        const __m512i v2 = _mm512_loadu_si512((const void*)(p + 64)), v3 = _mm512_loadu_si512((const void*)(p + 96));
        const __m512i v[4] = {_mm512_permutex2var_epi32(v0, even, v1), _mm512_permutex2var_epi32(v0, odd, v1),
                              _mm512_permutex2var_epi32(v2, even, v3), _mm512_permutex2var_epi32(v2, odd, v3)};
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

void int4_gemv(const float* x_in, int K, const uint8_t* packed, const uint16_t* sz, int N, int g, float* y,
               int threads) {
    float x[8192];
    float xs[8192 / 32 + 1];
    for (int k = 0; k < K; ++k) x[k] = bf16_round(x_in[k]);
    for (int gi = 0; gi < K / g; ++gi) {
        float s = 0.f;
        for (int k = gi * g; k < (gi + 1) * g; ++k) s += x[k];
        xs[gi] = s;
    }
    const int tiles = N / 64;
#if defined(__AVX512BF16__)
    if (g == 32) {
        uint32_t xp[8192 / 2];
        for (int gi = 0; gi < K / 32; ++gi)
            for (int j = 0; j < 16; ++j) {
                uint32_t a, b;
                std::memcpy(&a, &x[32 * gi + j], 4);
                std::memcpy(&b, &x[32 * gi + 16 + j], 4);
                xp[16 * gi + j] = (a >> 16) | (b & 0xffff0000u);
            }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int nb = 0; nb < tiles; ++nb) {
            int4_tile_bf16(xp, xs, K, packed + (size_t)nb * K * 32, sz, N, nb * 64, y + nb * 64);
            for (int r = nb * 64; r < nb * 64 + 64; ++r) y[r] = bf16_round(y[r]);
        }
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int nb = 0; nb < tiles; ++nb) {
        int4_tile(x, xs, K, g, packed + (size_t)nb * K * 32, sz, N, nb * 64, y + nb * 64);
        for (int r = nb * 64; r < nb * 64 + 64; ++r) y[r] = bf16_round(y[r]);
    }
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
// [H, I]; gu, h: scratch of 2I and I floats. 2I, I <= 8192.
void int4_ffn(const float* x, int H, int I, const uint8_t* gu_packed, const uint16_t* gu_sz,
              const uint8_t* d_packed, const uint16_t* d_sz, int g, float* gu, float* h, float* y, int threads) {
    int4_gemv(x, H, gu_packed, gu_sz, 2 * I, g, gu, threads);
    for (int i = 0; i < I; ++i) {
        float a = gu[i];
        h[i] = (a / (1.0f + std::exp(-a))) * gu[I + i];
    }
    int4_gemv(h, I, d_packed, d_sz, H, g, y, threads);
}

// x += r (r may be null), then h = x · rsqrt(mean(x²) + eps) · w.
void add_rms_norm(float* x, const float* r, const float* w, float eps, int H, float* h);

// A one-token MoE half after routing: the k picked experts (records recs[j], router weight w[j], expert ids[j])
// computed as engine.experts.moe_forward computes one token — each int4_ffn, in ascending expert order,
// out = y·w (+ y'·w' ...) — then add_rms_norm(x, out, next_w) into h_out. Record offsets: gate|up codes, its
// scales, down codes, its scales. scratch: 2I + I + H + H floats.
void moe_tail(const float* h, int k, const int64_t* ids, const uint64_t* recs, const float* w, int H, int I,
              int64_t gu_off, int64_t gu_sz_off, int64_t d_off, int64_t d_sz_off, int g, float* scratch, float* x,
              const float* next_w, float eps, float* h_out, int threads) {
    float *gu = scratch, *hid = scratch + 2 * I, *y = hid + I, *out = y + H;
    bool done[64] = {};
    for (int n = 0; n < k; ++n) {
        int j = -1;                                   // the lowest expert id not yet computed
        for (int t = 0; t < k; ++t)
            if (!done[t] && (j < 0 || ids[t] < ids[j])) j = t;
        done[j] = true;
        const uint8_t* rec = reinterpret_cast<const uint8_t*>(recs[j]);
        int4_ffn(h, H, I, rec + gu_off, reinterpret_cast<const uint16_t*>(rec + gu_sz_off), rec + d_off,
                 reinterpret_cast<const uint16_t*>(rec + d_sz_off), g, gu, hid, y, threads);
        const float wj = w[j];
        if (n == 0)
            for (int i = 0; i < H; ++i) out[i] = y[i] * wj;
        else
            for (int i = 0; i < H; ++i) out[i] = out[i] + y[i] * wj;
    }
    add_rms_norm(x, out, next_w, eps, H, h_out);
}

void add_rms_norm(float* x, const float* r, const float* w, float eps, int H, float* h) {
    if (r)
        for (int i = 0; i < H; ++i) x[i] += r[i];
    double ss = 0.0;
    for (int i = 0; i < H; ++i) ss += (double)x[i] * x[i];
    const float inv = 1.0f / std::sqrt((float)(ss / H) + eps);
    for (int i = 0; i < H; ++i) h[i] = (x[i] * inv) * w[i];
}

// One token of one sequence through attention over its KV cache rows: q|k|v [nh·hd | nkv·hd | nkv·hd] get
// rotary (the leading `rot` channels of each q and k head, rotate-half form; cos/sin [rot] of position p),
// k and v are written at row p of kc/vc ([max_len, nkv, hd] each), and each query head attends over rows
// lo..p (lo = p - window + 1 with a sliding window, else 0) of its kv head (GQA: nh / nkv heads share one)
// → o [nh·hd]. scores: scratch of nh·(p+1) floats.
void attn_decode(float* qkv, const float* cos, const float* sin, float* kc, float* vc, int p, int window, int nh,
                 int nkv, int hd, int rot, float scale, float* scores, float* o, int threads) {
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
    const int lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
    const int n = p + 1 - lo, group = nh / nkv;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * nh >= 4096)
    for (int hh = 0; hh < nh; ++hh) {
        const float* q = qkv + (size_t)hh * hd;
        const int kv = hh / group;
        float* s = scores + (size_t)hh * n;
        float mx = -INFINITY;
        for (int j = 0; j < n; ++j) {
            const float* k = kc + (size_t)(lo + j) * row + (size_t)kv * hd;
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
            const float* vv = vc + (size_t)(lo + j) * row + (size_t)kv * hd;
            const float w = s[j];
#pragma omp simd
            for (int i = 0; i < hd; ++i) acc[i] += w * vv[i];
        }
        float* out = o + (size_t)hh * hd;
        for (int i = 0; i < hd; ++i) out[i] = acc[i] / sum;
    }
}

// A decode layer's attention half on one token: h [H] → q|k|v (int4pack [nqkv, H]) → attn_decode → o (int4pack
// [H, nh·hd]) → x += o, h_out = rms_norm(x)·post_w. qkv, o_buf, r: scratch of nqkv, nh·hd and H floats.
void attn_block(float* x, const float* h, int H, const uint8_t* qkv_p, const uint16_t* qkv_sz, int nqkv,
                const uint8_t* o_p, const uint16_t* o_sz, int g, const float* cos, const float* sin, float* kc,
                float* vc, int p, int window, int nh, int nkv, int hd, int rot, float scale, float* scores,
                const float* post_w, float eps, float* qkv, float* o_buf, float* r, float* h_out, int threads) {
    int4_gemv(h, H, qkv_p, qkv_sz, nqkv, g, qkv, threads);
    attn_decode(qkv, cos, sin, kc, vc, p, window, nh, nkv, hd, rot, scale, scores, o_buf, threads);
    int4_gemv(o_buf, nh * hd, o_p, o_sz, H, g, r, threads);
    add_rms_norm(x, r, post_w, eps, H, h_out);
}

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

// y [N] = Σ_b d[n, b] · Σ_{i<32} q[n, 32b + i] · x[32b + i]; q int8 [N, K], d fp32 [N, K/32], K % 32 == 0.
void q8_gemv(const float* x, int K, const int8_t* q, const float* d, int N, float* y, int threads) {
    const int blocks = K / 32;
    const int chunk = 16;      // rows per scheduling unit
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int c = 0; c < (N + chunk - 1) / chunk; ++c) {
        int n = c * chunk;
        const int end = N < (c + 1) * chunk ? N : (c + 1) * chunk;
#if defined(__AVX512F__)
        for (; n + 4 <= end; n += 4) {        // four rows at once: four independent accumulations
            const int8_t* row = q + (size_t)n * K;
            for (int l = 0; l < 4 * K; l += 64) _mm_prefetch((const char*)row + PREFETCH + l, _MM_HINT_T0);
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int b = 0; b < blocks; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
                for (int r = 0; r < 4; ++r) {
                    const int8_t* qb = row + (size_t)r * K + 32 * b;
                    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qb))), x0);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qb + 16)))), x1, t);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[(size_t)(n + r) * blocks + b]), t, acc[r]);
                }
            }
            for (int r = 0; r < 4; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
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
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_loadu_ps(x + 32 * b));
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_loadu_ps(x + 32 * b + 16), t);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(dr[b]), t, acc);
            }
            y[n] = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
            if (!(n & 3)) for (int l = 0; l < 4 * K; l += 64) _mm_prefetch((const char*)row + PREFETCH + l, _MM_HINT_T0);
            __m256 acc = _mm256_setzero_ps();
            for (int b = 0; b < blocks; ++b) {
                __m256 t = _mm256_setzero_ps();
                for (int j = 0; j < 4; ++j) {
                    __m128i qj = _mm_loadl_epi64((const __m128i*)(row + 32 * b + 8 * j));
                    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qj)), _mm256_loadu_ps(x + 32 * b + 8 * j), t);
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dr[b]), t, acc);
            }
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_movehdup_ps(s));
            y[n] = _mm_cvtss_f32(s);
#else
            float acc = 0.f;
            for (int b = 0; b < blocks; ++b) {
                float t = 0.f;
                for (int i = 0; i < 32; ++i) t += float(row[32 * b + i]) * x[32 * b + i];
                acc += dr[b] * t;
            }
            y[n] = acc;
#endif
        }
    }
}

}  // extern "C"
