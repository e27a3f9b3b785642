/* Rows of bytes copied with stores that go past the caches: the tiers' block copies.
 *
 * A block moved between the pool and a tier is megabytes that nobody reads again soon.
 * An ordinary copy (memcpy, numpy's copyto) first reads every destination line into the
 * cache to write it (read for ownership), then evicts what the loop and the clients had
 * there. Non-temporal stores skip both: more bytes per second than numpy's copy (the
 * tier benchmark measures both), and the caches keep their contents.
 *
 * Built with the package (setup.py) for the compiler's baseline, never for the building
 * machine's CPU. On x86-64 a row is streamed 16 bytes a store (SSE2, which every x86-64
 * has), or 32 with AVX (a target attribute) where the CPU and the OS support it: chosen
 * at run time. Elsewhere (aarch64, ...), or where a row is too short to gain, the row is
 * copied with memcpy. Each way is also exported under its own name (shmkv_copy_rows_sse2,
 * ...) so that the tests can check every one this CPU runs.
 *
 * Pure: no allocation, no I/O, no state. The caller (shmkv.memory.block_io.RowCopy) checks the
 * shapes: this trusts its arguments.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Rows shorter than this are copied with memcpy: the streamed part would be small. */
#define MIN_STREAMED 512

/* Copy ``rows`` rows of ``width`` bytes: row r from ``src + r * src_stride`` to
 * ``dst + r * dst_stride``. The rows must not overlap. Returns 1 when the copy streamed
 * past the caches, 0 when it used memcpy alone. */
#define PARAMS char *dst, int64_t dst_stride, const char *src, int64_t src_stride, \
    int64_t rows, int64_t width
#define PASS dst, dst_stride, src, src_stride, rows, width

int shmkv_copy_rows_portable(PARAMS) {
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)width);
    return 0;
}

#if defined(__x86_64__)
/* One row: memcpy up to the first `align`-byte boundary of the destination, then 128
 * bytes a step in streamed stores of `align` bytes, then memcpy of the rest. */
static void stream_sse2(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 128; d += 128, s += 128, n -= 128) {
        for (int i = 0; i < 128; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            _mm_stream_si128((__m128i *)(d + i), a);
        }
    }
    memcpy(d, s, n);
}

__attribute__((target("avx"))) static void stream_avx(char *d, const char *s, size_t n) {
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 128; d += 128, s += 128, n -= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
    }
    memcpy(d, s, n);
}

static int copy_streamed(void (*stream)(char *, const char *, size_t), PARAMS) {
    if (width < MIN_STREAMED) return shmkv_copy_rows_portable(PASS);
    for (int64_t r = 0; r < rows; r++)
        stream(dst + r * dst_stride, src + r * src_stride, (size_t)width);
    /* Streaming stores are weakly ordered: all of them land before this returns, so a
     * reader told the copy is done (by a socket, a lock) sees every byte. */
    _mm_sfence();
    return 1;
}

int shmkv_copy_rows_sse2(PARAMS) {
    return copy_streamed(stream_sse2, PASS);
}

int shmkv_copy_rows_avx(PARAMS) {
    return copy_streamed(stream_avx, PASS);
}

/* The copy shmkv/native.py binds: the widest this CPU runs. (__builtin_cpu_supports
 * reads what libgcc's start-up code found: no cpuid per call.) */
int shmkv_copy_rows(PARAMS) {
    return __builtin_cpu_supports("avx") ? shmkv_copy_rows_avx(PASS)
                                         : shmkv_copy_rows_sse2(PASS);
}

/* The way shmkv_copy_rows copies wide rows: "avx", "sse2" or "portable" (memcpy). */
const char *shmkv_copy_rows_isa(void) {
    return __builtin_cpu_supports("avx") ? "avx" : "sse2";
}
#else
int shmkv_copy_rows(PARAMS) {
    return shmkv_copy_rows_portable(PASS);
}

const char *shmkv_copy_rows_isa(void) {
    return "portable";
}
#endif
