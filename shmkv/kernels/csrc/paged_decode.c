/* Decode attention straight over a paged pool: one query token per sequence.
 *
 * Reads each sequence's K/V where it lies (its pages, through its block table), once,
 * with no gathered copy: the scores of a page's tokens, an online softmax across
 * pages, the weighted sum of V. Loaded by shmkv/native.py; nothing here knows Python
 * or torch.
 *
 * Layout. A page is one layer's K (or V) of one block: [block_size, num_kv_heads,
 * head_dim] contiguous. Page p starts at k_base + p * page_stride (and v_base + ...).
 * Query and output rows are [num_heads, head_dim] contiguous; query head h reads K/V
 * head h / (num_heads / num_kv_heads). Three element types, one per entry point:
 * float32, bfloat16 and float16 (the 16-bit ones widened to float32 as loaded; scores,
 * softmax and sums in float32; the output rounded to nearest even).
 *
 * Instruction sets. Built with the package (setup.py) for the compiler's baseline, never
 * for the building machine's CPU, so that one build runs on any CPU of its architecture.
 * The kernel's loops (paged_decode_isa.h) are compiled once per instruction set: plain
 * C for the baseline (x86-64's SSE2, aarch64's NEON, ...), and on x86-64 also AVX2 (with
 * FMA and F16C) and AVX-512, through target attributes. Each entry point runs the widest
 * one the CPU (and the OS, which must save its registers) supports, chosen once when the
 * library is loaded. Each instance is also exported under its own name (..._avx2) so that
 * the tests can check every one this CPU runs.
 *
 * Returns 0, or SHMKV_BAD_PAGE when a table entry names a page outside
 * [0, num_pages) (nothing after it is written), or SHMKV_NO_MEMORY.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
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

/* The helpers below carry no instruction set of their own: always inlined, they are
 * compiled as part of each instance's functions, for that instance's instruction set. */
#define HELPER static inline __attribute__((always_inline))

/* float16 bits (in 32-bit lanes) to float32 bits: normal numbers move their exponent,
 * infinities and NaNs keep theirs at the top, subnormals and zeros are renormalized
 * with one float subtraction. Whole vectors: no branch. */
HELPER v16u f16_bits_to_f32(v16u w) {
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

HELPER float f16_to_f32(uint16_t h) {
    const v16u o = f16_bits_to_f32((v16u){0} + h);
    float f;
    memcpy(&f, &o, sizeof f);
    return f;
}

/* float32 to float16, rounded to nearest even; overflow to infinity, NaN stays NaN. */
HELPER uint16_t f32_to_f16(float f) {
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

HELPER float load1(const void *base, int64_t i, const int kind) {
    if (kind == F32) return ((const float *)base)[i];
    const uint16_t h = ((const uint16_t *)base)[i];
    if (kind == F16) return f16_to_f32(h);
    const uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

HELPER void store1(void *base, int64_t i, float f, const int kind) {
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
HELPER float hsum16(v16 x) {
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

HELPER void fetch(const char *p, int64_t nbytes) {
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* Softmax bookkeeping of one page, shared by both kernels: the page's scores s[i][t]
 * become weights, each head's running max m, sum l and output acc rescaled. The first
 * page of a row starts them (whatever m, l and acc held). */
HELPER void page_softmax(float *s, float *m, float *l, float *acc, int64_t heads, int64_t bs,
                         int64_t n, int64_t dim, int first) {
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

/* The entry points' parameters: q, pages and out of one element type; page_stride in
 * elements. */
#define ENTRY_PARAMS const void *q, const void *k_base, const void *v_base,              \
    int64_t page_stride, int64_t num_pages, const int32_t *table, int64_t table_row,     \
    const int64_t *lens, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,      \
    int64_t bs, float scale, void *out
#define ENTRY_PASS q, k_base, v_base, page_stride, num_pages, table, table_row, lens, rows, \
    heads, kv_heads, dim, bs, scale, out

#define CONCAT(a, b) a##_##b
#define NAMED(name, isa) CONCAT(name, isa)

/* The instances: ISA names them, TARGET lets the compiler use its instructions, HW_F16
 * is how many float16 lanes the CPU converts in one instruction (0: plain vector code). */
#define ISA portable
#define TARGET
#define HW_F16 0
#include "paged_decode_isa.h"
#undef ISA
#undef TARGET
#undef HW_F16

#if defined(__x86_64__)
#define ISA avx2
#define TARGET __attribute__((target("avx2,fma,f16c")))
#define HW_F16 8
#include "paged_decode_isa.h"
#undef ISA
#undef TARGET
#undef HW_F16

#define ISA avx512
#define TARGET __attribute__((target("avx512f,avx2,fma,f16c")))
#define HW_F16 16
#include "paged_decode_isa.h"
#undef ISA
#undef TARGET
#undef HW_F16

/* Which instance the entry points run: 0 portable, 1 avx2, 2 avx512. Set once, when the
 * library is loaded (before any entry point can be called). */
static int level;

__attribute__((constructor)) static void choose_level(void) {
    __builtin_cpu_init();
    unsigned int eax, ebx, ecx, edx;
    const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
    if (f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        level = __builtin_cpu_supports("avx512f") ? 2 : 1;
}

#define DISPATCH(name)                                                                     \
    int name(ENTRY_PARAMS) {                                                               \
        if (level == 2) return name##_avx512(ENTRY_PASS);                                  \
        if (level == 1) return name##_avx2(ENTRY_PASS);                                    \
        return name##_portable(ENTRY_PASS);                                                \
    }
static const char *const LEVELS[] = {"portable", "avx2", "avx512"};
#else
static const int level = 0;
#define DISPATCH(name)                                                                     \
    int name(ENTRY_PARAMS) { return name##_portable(ENTRY_PASS); }
static const char *const LEVELS[] = {"portable"};
#endif

/* The entry points shmkv/native.py binds: the widest instance this CPU runs. */
DISPATCH(shmkv_paged_decode_f32)
DISPATCH(shmkv_paged_decode_bf16)
DISPATCH(shmkv_paged_decode_f16)

/* The instance the entry points run: "portable", "avx2" or "avx512". */
const char *shmkv_paged_decode_isa(void) {
    return LEVELS[level];
}
