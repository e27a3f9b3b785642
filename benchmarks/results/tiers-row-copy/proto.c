#include <immintrin.h>
#include <string.h>
#include <stdint.h>
/* copy rows: src contiguous rows*row bytes; dst rows with stride */
void copy_rows_nt(char *dst, long dst_stride, const char *src, long rows, long row) {
    for (long r = 0; r < rows; r++) {
        char *d = dst + r * dst_stride; const char *s = src + r * row;
        long i = 0;
        for (; i + 128 <= row; i += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
            _mm256_stream_si256((__m256i *)(d + i), a);
            _mm256_stream_si256((__m256i *)(d + i + 32), b);
            _mm256_stream_si256((__m256i *)(d + i + 64), c);
            _mm256_stream_si256((__m256i *)(d + i + 96), e);
        }
        memcpy(d + i, s + i, row - i);
    }
    _mm_sfence();
}
void copy_rows(char *dst, long dst_stride, const char *src, long rows, long row) {
    for (long r = 0; r < rows; r++) memcpy(dst + r * dst_stride, src + r * row, row);
}
