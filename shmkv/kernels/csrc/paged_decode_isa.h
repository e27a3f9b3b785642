/* One instruction set's instance of the decode kernel, included by paged_decode.c once
 * per instruction set with these defined:
 *   ISA     the suffix of every name here (portable, avx2, avx512);
 *   TARGET  the attribute that lets the compiler use that set in these functions (empty
 *           for the baseline);
 *   HW_F16  float16 lanes the CPU widens in one instruction (16: AVX-512's vcvtph2ps,
 *           8: F16C's), or 0 for plain vector code.
 * Everything the functions here call is always inlined into them (paged_decode.c's
 * helpers included), so all of it is compiled for TARGET. */

#define IN_ISA(name) NAMED(name, ISA)

#define KERNEL static inline __attribute__((always_inline)) TARGET

/* Loads of element i of an array of `kind`, widened to float32. */
KERNEL v16 IN_ISA(load16)(const void *base, int64_t i, const int kind) {
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

/* head_dim a multiple of 16 (nc chunks of 16), known at compile time per instance. */
KERNEL int IN_ISA(decode_vec)(const int nc, const int kind, ARGS) {
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
                    for (int c = 0; c < nc; c++)
                        qv[c] = IN_ISA(load16)(qf, i * dim + c * 16, F32) * scale;
                    float *si = s + i * bs;
                    for (int64_t t = 0; t < n; t++) {
                        const int64_t at = base + t * tok + h * dim;
                        v16 x = qv[0] * IN_ISA(load16)(k_base, at, kind);
                        for (int c = 1; c < nc; c++)
                            x += qv[c] * IN_ISA(load16)(k_base, at + c * 16, kind);
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
                        for (int c = 0; c < nc; c++)
                            a[c] += w * IN_ISA(load16)(v_base, at + c * 16, kind);
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
KERNEL int IN_ISA(decode_any)(int64_t dim, const int kind, ARGS) {
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

KERNEL int IN_ISA(decode)(int64_t dim, const int kind, ARGS) {
    switch (dim) {
    case 16: return IN_ISA(decode_vec)(1, kind, PASS);
    case 32: return IN_ISA(decode_vec)(2, kind, PASS);
    case 64: return IN_ISA(decode_vec)(4, kind, PASS);
    case 128: return IN_ISA(decode_vec)(8, kind, PASS);
    case 256: return IN_ISA(decode_vec)(16, kind, PASS);
    default: return IN_ISA(decode_any)(dim, kind, PASS);
    }
}

/* The instance's entry points (shmkv_paged_decode_f32_avx2, ...). */
#define ENTRY(name, kind)                                                                  \
    TARGET int NAMED(name, ISA)(ENTRY_PARAMS) {                                            \
        const size_t bytes = (size_t)WORK_FLOATS(heads, dim, bs) * sizeof(float);         \
        float *work = aligned_alloc(64, (bytes + 63) / 64 * 64);                          \
        if (work == NULL) return SHMKV_NO_MEMORY;                                         \
        const int rc = IN_ISA(decode)(dim, kind, PASS);                                   \
        free(work);                                                                       \
        return rc;                                                                        \
    }

ENTRY(shmkv_paged_decode_f32, F32)
ENTRY(shmkv_paged_decode_bf16, BF16)
ENTRY(shmkv_paged_decode_f16, F16)

#undef ENTRY
#undef KERNEL
#undef IN_ISA
