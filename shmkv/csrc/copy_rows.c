/* Rows of bytes copied with stores that go past the caches: the tiers' block copies.
 *
 * A block moved between the pool and a tier is megabytes that nobody reads again soon.
 * An ordinary copy (memcpy, numpy's copyto) first reads every destination line into the
 * cache to write it (read for ownership), then evicts what the loop and the clients had
 * there. Non-temporal stores skip both: more bytes per second than numpy's copy (the
 * tier benchmark measures both), and the caches keep their contents.
 *
 * Where the CPU has no such stores in the compiler's baseline (not x86), or a row is too
 * short to gain, the row is copied with memcpy. Pure: no allocation, no I/O, no state.
 * The caller (shmkv.tier_io.RowCopy) checks the shapes: this trusts its arguments.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <immintrin.h>
#define STREAMS 1
#else
#define STREAMS 0
#endif

/* Rows shorter than this are copied with memcpy: the streamed part would be small. */
#define MIN_STREAMED 512

#if STREAMS
static void copy_streamed(char *d, const char *s, size_t n)
{
#if defined(__AVX__)
    const size_t align = 32;
#else
    const size_t align = 16;
#endif
    size_t head = (align - ((uintptr_t)d & (align - 1))) & (align - 1);
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 128; d += 128, s += 128, n -= 128) {
#if defined(__AVX__)
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
#else
        for (int i = 0; i < 128; i += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            _mm_stream_si128((__m128i *)(d + i), a);
        }
#endif
    }
    memcpy(d, s, n);
}
#endif

/* Copy ``rows`` rows of ``width`` bytes: row r from ``src + r * src_stride`` to
 * ``dst + r * dst_stride``. The rows must not overlap. Returns 1 when the copy streamed
 * past the caches, 0 when it used memcpy alone. */
int shmkv_copy_rows(char *dst, int64_t dst_stride, const char *src, int64_t src_stride,
                    int64_t rows, int64_t width)
{
#if STREAMS
    if (width >= MIN_STREAMED) {
        for (int64_t r = 0; r < rows; r++)
            copy_streamed(dst + r * dst_stride, src + r * src_stride, (size_t)width);
        /* Streaming stores are weakly ordered: all of them land before this returns,
         * so a reader told the copy is done (by a socket, a lock) sees every byte. */
        _mm_sfence();
        return 1;
    }
#endif
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)width);
    return 0;
}
