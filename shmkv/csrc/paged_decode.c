/* Decode attention straight over a paged pool: one query token per sequence.
 *
 * Reads each sequence's K/V where it lies (its pages, through its block table), once,
 * with no gathered copy: the scores of a page's tokens, an online softmax across
 * pages, the weighted sum of V. Built and loaded by shmkv/native.py; nothing here
 * knows Python or torch.
 *
 * Layout. A page is one layer's K (or V) of one block: [block_size, num_kv_heads,
 * head_dim] contiguous. Page p starts at k_base + p * page_stride (and v_base + ...).
 * Query and output rows are [num_heads, head_dim] contiguous; query head h reads K/V
 * head h / (num_heads / num_kv_heads). Three element types, one per entry point:
 * float32, bfloat16 and float16 (the 16-bit ones widened to float32 as loaded; scores,
 * softmax and sums in float32; the output rounded to nearest even).
 *
 * Returns 0, or SHMKV_BAD_PAGE when a table entry names a page outside
 * [0, num_pages) (nothing after it is written), or SHMKV_NO_MEMORY.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* SHMKV_SOFT_F16: convert float16 in plain vector code even where the CPU could (the
 * tests build it so, to check that code on any machine). */
#if defined(__AVX512F__) && !defined(SHMKV_SOFT_F16)
#define HW_F16 16   /* 16 lanes at once */
#include <immintrin.h>
#elif defined(__F16C__) && !defined(SHMKV_SOFT_F16)
#define HW_F16 8    /* 8 lanes at once (AVX2 machines) */
#include <immintrin.h>
#endif

#define SHMKV_BAD_PAGE 1
#define SHMKV_NO_MEMORY 2

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* Element types, one per entry point: `kind` is a constant in every instance. */
#define F32 0
#define BF16 1   /* the top half of a float32's bits */
#define F16 2    /* IEEE binary16 */

/* float16 bits (in 32-bit lanes) to float32 bits: normal numbers move their exponent,
 * infinities and NaNs keep theirs at the top, subnormals and zeros are renormalized
 * with one float subtraction. Whole vectors: no branch. */
static inline v16u f16_bits_to_f32(v16u w) {
    const v16u shifted_exp = (v16u){0} + (0x7c00u << 13);
    v16u o = (w & 0x7fffu) << 13;
    const v16u exp = o & shifted_exp;
    o += (uint32_t)(127 - 15) << 23;
    const v16u inf_nan = (v16u)(exp == shifted_exp);
    const v16u tiny = (v16u)(exp == 0);
    o += inf_nan & ((uint32_t)(128 - 16) << 23);
    v16u renorm = o + (1u << 23);
    v16 f;
    memcpy(&f, &renorm, sizeof f);
    f -= (v16){0} + 6.103515625e-05f;   /* 2^-14, the smallest normal float16 */
    memcpy(&renorm, &f, sizeof renorm);
    o = (tiny & renorm) | (~tiny & o);
    return o | ((w & 0x8000u) << 16);
}

static inline float f16_to_f32(uint16_t h) {
    const v16u o = f16_bits_to_f32((v16u){0} + h);
    float f;
    memcpy(&f, &o, sizeof f);
    return f;
}

/* float32 to float16, rounded to nearest even; overflow to infinity, NaN stays NaN. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    uint16_t o;
    if (x >= 0x47800000u) {             /* 2^16 and above: infinity, or NaN */
        o = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (x < 0x38800000u) {       /* below 2^-14: a subnormal or zero */
        float g;                        /* 0.5 aligns the bits; its add rounds them */
        memcpy(&g, &x, sizeof g);
        g += 0.5f;
        uint32_t r;
        memcpy(&r, &g, sizeof r);
        o = (uint16_t)(r - 0x3f000000u);
    } else {
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu + ((x >> 13) & 1u);
        o = (uint16_t)(x >> 13);
    }
    return o | sign;
}

/* Loads of element i of an array of `kind`, widened to float32. */
static inline v16 load16(const void *base, int64_t i, const int kind) {
    v16 v;
    if (kind == F32) {
        memcpy(&v, (const float *)base + i, sizeof v);
    } else {
        v16h h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
#if HW_F16 == 16
        if (kind == F16) {   /* the CPU converts: one vcvtph2ps */
            __m256i hv;
            memcpy(&hv, &h, sizeof hv);
            const __m512 f = _mm512_cvtph_ps(hv);
            memcpy(&v, &f, sizeof v);
            return v;
        }
#elif HW_F16 == 8
        if (kind == F16) {   /* two vcvtph2ps */
            __m128i lo, hi;
            memcpy(&lo, &h, sizeof lo);
            memcpy(&hi, (const char *)&h + sizeof lo, sizeof hi);
            const __m256 f[2] = {_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi)};
            memcpy(&v, f, sizeof v);
            return v;
        }
#endif
        const v16u w = __builtin_convertvector(h, v16u);
        const v16u bits = kind == BF16 ? w << 16 : f16_bits_to_f32(w);
        memcpy(&v, &bits, sizeof v);
    }
    return v;
}

static inline float load1(const void *base, int64_t i, const int kind) {
    if (kind == F32) return ((const float *)base)[i];
    const uint16_t h = ((const uint16_t *)base)[i];
    if (kind == F16) return f16_to_f32(h);
    const uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline void store1(void *base, int64_t i, float f, const int kind) {
    if (kind == F32) {
        ((float *)base)[i] = f;
    } else if (kind == F16) {
        ((uint16_t *)base)[i] = f32_to_f16(f);
    } else {       /* rounded to nearest, ties to even */
        uint32_t w;
        memcpy(&w, &f, sizeof w);
        w += 0x7fffu + ((w >> 16) & 1u);
        ((uint16_t *)base)[i] = (uint16_t)(w >> 16);
    }
}

/* The sum of x's lanes (the compiler reduces them with shuffles; plain C for any). */
static inline float hsum16(v16 x) {
    float r = 0.f;
    for (int i = 0; i < 16; i++) r += x[i];
    return r;
}

/* Pages are fetched into L2 this many bytes (K and V) ahead of the one being read: a
 * page of another block lies a whole block (every layer's K and V) away, where the
 * hardware's own prefetch does not follow. Measured on x86 with 8 KiB pages in a
 * model's decode step: 96 KiB ahead beat 8, 24, 48, 192 and 384 KiB. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 98304
#endif

static inline void fetch(const char *p, int64_t nbytes) {
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* Softmax bookkeeping of one page, shared by both kernels: the page's scores s[i][t]
 * become weights, each head's running max m, sum l and output acc rescaled. The first
 * page of a row starts them (whatever m, l and acc held). */
static inline void page_softmax(float *s, float *m, float *l, float *acc, int64_t heads,
                                int64_t bs, int64_t n, int64_t dim, int first) {
    for (int64_t i = 0; i < heads; i++) {
        float *si = s + i * bs;
        float top = first ? si[0] : m[i];
        for (int64_t t = 0; t < n; t++) top = si[t] > top ? si[t] : top;
        const float corr = first ? 0.f : expf(m[i] - top);
        m[i] = top;
        float sum = 0.f;
        for (int64_t t = 0; t < n; t++) { si[t] = expf(si[t] - top); sum += si[t]; }
        l[i] = l[i] * corr + sum;
        if (corr != 1.f) {
            float *ai = acc + i * dim;
            for (int64_t d = 0; d < dim; d++) ai[d] *= corr;
        }
    }
}

#define ARGS const void *q, const void *k_base, const void *v_base, int64_t page_stride, \
    int64_t num_pages, const int32_t *table, int64_t table_row, const int64_t *lens, \
    int64_t rows, int64_t heads, int64_t kv_heads, int64_t bs, float scale, void *out, \
    float *work
#define PASS q, k_base, v_base, page_stride, num_pages, table, table_row, lens, rows, heads, \
    kv_heads, bs, scale, out, work

/* Scratch of a call, in floats: acc, the query as float32, scores, max, sum. */
#define WORK_FLOATS(heads, dim, bs) (2 * (heads) * (dim) + (heads) * (bs) + 2 * (heads))

/* head_dim a multiple of 16 (nc chunks of 16), known at compile time per instance. */
static inline __attribute__((always_inline)) int decode_vec(const int nc, const int kind,
                                                            ARGS) {
    const int64_t dim = (int64_t)nc * 16, group = heads / kv_heads, tok = kv_heads * dim;
    const int64_t esize = kind == F32 ? 4 : 2;
    int64_t ahead = AHEAD_BYTES / (2 * bs * tok * esize);
    ahead = ahead < 1 ? 1 : ahead > 64 ? 64 : ahead;
    v16 *acc = (v16 *)work;                                  /* heads * nc */
    float *qf = work + heads * dim;                          /* heads * dim */
    float *s = qf + heads * dim;                             /* heads * bs */
    float *m = s + heads * bs, *l = m + heads;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t len = lens[b];
        const int32_t *row = table + b * table_row;
        for (int64_t i = 0; i < heads * dim; i++) qf[i] = load1(q, b * heads * dim + i, kind);
        for (int64_t i = 0; i < heads; i++) { m[i] = 0.f; l[i] = 0.f; }
        for (int64_t i = 0; i < heads * nc; i++) acc[i] = (v16){0};
        const int64_t pages = (len + bs - 1) / bs;
        for (int64_t j = 0; j < pages; j++) {
            const int64_t page = row[j];
            if (page < 0 || page >= num_pages) return SHMKV_BAD_PAGE;
            for (int64_t a = j == 0 ? 1 : ahead; a <= ahead && j + a < pages; a++) {
                const int64_t next = row[j + a];
                if (next >= 0 && next < num_pages) {
                    fetch((const char *)k_base + next * page_stride * esize, bs * tok * esize);
                    fetch((const char *)v_base + next * page_stride * esize, bs * tok * esize);
                }
            }
            const int64_t n = len - j * bs < bs ? len - j * bs : bs;
            const int64_t base = page * page_stride;
            for (int64_t h = 0; h < kv_heads; h++) {
                for (int64_t g = 0; g < group; g++) {
                    const int64_t i = h * group + g;
                    v16 qv[16];
                    for (int c = 0; c < nc; c++) qv[c] = load16(qf, i * dim + c * 16, F32) * scale;
                    float *si = s + i * bs;
                    for (int64_t t = 0; t < n; t++) {
                        const int64_t at = base + t * tok + h * dim;
                        v16 x = qv[0] * load16(k_base, at, kind);
                        for (int c = 1; c < nc; c++) x += qv[c] * load16(k_base, at + c * 16, kind);
                        si[t] = hsum16(x);
                    }
                }
            }
            page_softmax(s, m, l, (float *)acc, heads, bs, n, dim, j == 0);
            for (int64_t h = 0; h < kv_heads; h++) {
                for (int64_t g = 0; g < group; g++) {
                    const int64_t i = h * group + g;
                    v16 a[16];
                    for (int c = 0; c < nc; c++) a[c] = acc[i * nc + c];
                    const float *si = s + i * bs;
                    for (int64_t t = 0; t < n; t++) {
                        const int64_t at = base + t * tok + h * dim;
                        const float w = si[t];
                        for (int c = 0; c < nc; c++) a[c] += w * load16(v_base, at + c * 16, kind);
                    }
                    for (int c = 0; c < nc; c++) acc[i * nc + c] = a[c];
                }
            }
        }
        for (int64_t i = 0; i < heads; i++) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            for (int c = 0; c < nc; c++) {
                const v16 r = acc[i * nc + c] * inv;
                for (int e = 0; e < 16; e++)
                    store1(out, b * heads * dim + i * dim + c * 16 + e, r[e], kind);
            }
        }
    }
    return 0;
}

/* Any head_dim: the same steps, plain loops. */
static inline __attribute__((always_inline)) int decode_any(int64_t dim, const int kind,
                                                            ARGS) {
    const int64_t group = heads / kv_heads, tok = kv_heads * dim;
    float *acc = work, *qf = work + heads * dim, *s = qf + heads * dim;
    float *m = s + heads * bs, *l = m + heads;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t len = lens[b];
        const int32_t *row = table + b * table_row;
        for (int64_t i = 0; i < heads * dim; i++) qf[i] = load1(q, b * heads * dim + i, kind);
        for (int64_t i = 0; i < heads; i++) { m[i] = 0.f; l[i] = 0.f; }
        for (int64_t i = 0; i < heads * dim; i++) acc[i] = 0.f;
        const int64_t pages = (len + bs - 1) / bs;
        for (int64_t j = 0; j < pages; j++) {
            const int64_t page = row[j];
            if (page < 0 || page >= num_pages) return SHMKV_BAD_PAGE;
            const int64_t n = len - j * bs < bs ? len - j * bs : bs;
            const int64_t base = page * page_stride;
            for (int64_t t = 0; t < n; t++)
                for (int64_t i = 0; i < heads; i++) {
                    const float *qi = qf + i * dim;
                    const int64_t at = base + t * tok + (i / group) * dim;
                    float dot = 0.f;
                    for (int64_t d = 0; d < dim; d++) dot += qi[d] * load1(k_base, at + d, kind);
                    s[i * bs + t] = dot * scale;
                }
            page_softmax(s, m, l, acc, heads, bs, n, dim, j == 0);
            for (int64_t t = 0; t < n; t++)
                for (int64_t i = 0; i < heads; i++) {
                    const int64_t at = base + t * tok + (i / group) * dim;
                    const float w = s[i * bs + t];
                    float *ai = acc + i * dim;
                    for (int64_t d = 0; d < dim; d++) ai[d] += w * load1(v_base, at + d, kind);
                }
        }
        for (int64_t i = 0; i < heads; i++) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
            for (int64_t d = 0; d < dim; d++)
                store1(out, b * heads * dim + i * dim + d, acc[i * dim + d] * inv, kind);
        }
    }
    return 0;
}

static inline __attribute__((always_inline)) int decode(int64_t dim, const int kind, ARGS) {
    switch (dim) {
    case 16: return decode_vec(1, kind, PASS);
    case 32: return decode_vec(2, kind, PASS);
    case 64: return decode_vec(4, kind, PASS);
    case 128: return decode_vec(8, kind, PASS);
    case 256: return decode_vec(16, kind, PASS);
    default: return decode_any(dim, kind, PASS);
    }
}

/* The entry points: q, pages and out of one element type; page_stride in elements. */
#define ENTRY(name, kind)                                                                  \
    int name(const void *q, const void *k_base, const void *v_base, int64_t page_stride,  \
             int64_t num_pages, const int32_t *table, int64_t table_row,                  \
             const int64_t *lens, int64_t rows, int64_t heads, int64_t kv_heads,          \
             int64_t dim, int64_t bs, float scale, void *out) {                           \
        const size_t bytes = (size_t)WORK_FLOATS(heads, dim, bs) * sizeof(float);         \
        float *work = aligned_alloc(64, (bytes + 63) / 64 * 64);                          \
        if (work == NULL) return SHMKV_NO_MEMORY;                                         \
        const int rc = decode(dim, kind, PASS);                                           \
        free(work);                                                                       \
        return rc;                                                                        \
    }

ENTRY(shmkv_paged_decode_f32, F32)
ENTRY(shmkv_paged_decode_bf16, BF16)
ENTRY(shmkv_paged_decode_f16, F16)
