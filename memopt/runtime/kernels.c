/* Fused CPU kernels for the K-bit stash (memopt/runtime/native.py compiles and loads this file).
 *
 * Each kernel does in one pass over memory what the plain-PyTorch path (memopt/stash/grid.py,
 * memopt/runtime/bitpack.py) does in several full-size elementwise ops, with the same float32 arithmetic in the
 * same order (built with -ffp-contract=off, no fast-math; -fno-trapping-math only lets the compiler turn
 * selects into vector blends), so codes, grids and rebuilt values are bit-identical to that path
 * (tests/test_native.py); only the BN backward's per-channel sums are accumulated in another order (float
 * lanes over at most BLOCK elements, then double), so its gradients agree to about 1e-6 relative.
 *
 * Layout: a contiguous float32 / uint8 tensor of n elements, shape (N, C, S...) flattened, so element i
 * belongs to channel (i / S) % C. Codes are an LSB-first bit stream: element i occupies stream bits
 * [i*bits, (i+1)*bits) (memopt/runtime/bitpack.py). Work is split into blocks of BLOCK elements, a multiple of 8,
 * so that every block starts on a byte of every stream; masks may be 0/1 bytes or the saved 1-bit stream,
 * unpacked a block at a time.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BLOCK 16384
#define LANES 16 /* independent accumulators of a reduction: what the compiler vectorises */

static int64_t num_blocks(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

/* bfloat16 (autocast's CPU dtype) in and out of the BN backward, and as the input of the forward's encode, mask
 * and extremes (`x_bf16`): a bf16 value widens exactly, a block at a time, so a kernel reading bf16 computes what
 * it computes on the float32 copy (what the plain path's type promotion reads), with no full-size copy; a float
 * narrows rounding to nearest even as c10::BFloat16 does (NaN to 0x7FC0), so a bf16 result written here equals the
 * float result's .to(torch.bfloat16). TYPE_* flags say which of grad, g and out are bf16. */
#define TYPE_GRAD_BF16 1
#define TYPE_G_BF16 2
#define TYPE_OUT_BF16 4
static inline void bf16_widen_run(const uint16_t *restrict in, float *restrict out, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        uint32_t u = (uint32_t)in[i] << 16;
        memcpy(out + i, &u, sizeof u);
    }
}
/* the widening above for kernels_generic.c (built into the same library) */
void mo_bf16_widen(const uint16_t *in, float *out, int64_t count) { bf16_widen_run(in, out, count); }

static inline void bf16_narrow_run(const float *restrict in, uint16_t *restrict out, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        uint32_t u;
        memcpy(&u, in + i, sizeof u);
        uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        out[i] = in[i] != in[i] ? (uint16_t)0x7FC0 : rounded;
    }
}

/* codes [i0, i0 + count) of a stream (i0 a multiple of 8) into dst */
static void unpack_block(const uint8_t *packed, int64_t nbytes, int bits, int64_t i0, int64_t count,
                         uint8_t *dst) {
    const unsigned m = (1u << bits) - 1u;
    if (bits == 8) {
        memcpy(dst, packed + i0, (size_t)count);
    } else if (bits == 4) {
        const uint8_t *p = packed + i0 / 2;
        int64_t pairs = count / 2;
        for (int64_t k = 0; k < pairs; k++) {
            dst[2 * k] = p[k] & 15u;
            dst[2 * k + 1] = p[k] >> 4;
        }
        if (count & 1) dst[count - 1] = p[pairs] & 15u;
    } else if (bits == 1) {  /* whole bytes with a constant inner loop (vectorised), then the tail */
        const uint8_t *p = packed + i0 / 8;
        int64_t full = count / 8, k = 0;
#if defined(__AVX512BW__)
        /* 64 bits are a byte mask: one masked broadcast writes their 64 bytes (the loop below, which GCC 12
           vectorised poorly, made a 1-bit mask's unpacking most of the fused BN backward's first pass) */
        for (; k + 8 <= full; k += 8) {
            uint64_t w;
            memcpy(&w, p + k, 8);
            _mm512_storeu_si512((void *)(dst + 8 * k), _mm512_maskz_set1_epi8((__mmask64)w, 1));
        }
#endif
        for (; k < full; k++)
            for (int j = 0; j < 8; j++) dst[8 * k + j] = (p[k] >> j) & 1u;
        for (int64_t k = full * 8; k < count; k++) dst[k] = (p[k / 8] >> (k % 8)) & 1u;
    } else if (bits == 2) {
        const uint8_t *p = packed + i0 / 4;
        int64_t full = count / 4;
        for (int64_t k = 0; k < full; k++)
            for (int j = 0; j < 4; j++) dst[4 * k + j] = (p[k] >> (2 * j)) & 3u;
        for (int64_t k = full * 4; k < count; k++) dst[k] = (p[k / 4] >> (2 * (k % 4))) & 3u;
    } else {  /* eight codes fill `bits` bytes */
        int64_t g0 = i0 / 8;
        for (int64_t g = 0; g * 8 < count; g++) {
            uint64_t w = 0;
            for (int b = 0; b < bits; b++) {
                int64_t at = (g0 + g) * bits + b;
                if (at < nbytes) w |= (uint64_t)packed[at] << (8 * b);
            }
            for (int j = 0; j < 8 && g * 8 + j < count; j++) dst[g * 8 + j] = (w >> (bits * j)) & m;
        }
    }
}

/* codes[0, count) (element i0 + k at k; i0 a multiple of 8) into the stream; the last byte zero-padded */
static void pack_block(const uint8_t *codes, int64_t count, int bits, int64_t i0, uint8_t *out, int64_t nbytes) {
    if (bits == 8) {
        memcpy(out + i0, codes, (size_t)count);
    } else if (bits == 4) {
        uint8_t *p = out + i0 / 2;
        int64_t pairs = count / 2;
        for (int64_t k = 0; k < pairs; k++) p[k] = (uint8_t)(codes[2 * k] | (codes[2 * k + 1] << 4));
        if (count & 1) p[pairs] = codes[count - 1];
    } else if (8 % bits == 0) {
        const int per = 8 / bits;
        uint8_t *p = out + i0 / per;
        int64_t full = count / per, k = 0;
#if defined(__AVX512BW__)
        if (bits == 1)  /* 64 codes (0 / 1) into 8 bytes: one byte test gives their bits in order */
            for (; k + 8 <= full; k += 8) {
                const __m512i v = _mm512_loadu_si512((const void *)(codes + 8 * k));
                const uint64_t w = (uint64_t)_mm512_test_epi8_mask(v, _mm512_set1_epi8(1));
                memcpy(p + k, &w, 8);
            }
#endif
        for (; k < full; k++) {
            unsigned v = 0;
            for (int j = 0; j < per; j++) v |= (unsigned)codes[k * per + j] << (bits * j);
            p[k] = (uint8_t)v;
        }
        if (full * per < count) {
            unsigned v = 0;
            for (int j = 0; full * per + j < count; j++) v |= (unsigned)codes[full * per + j] << (bits * j);
            p[full] = (uint8_t)v;
        }
    } else {
        int64_t g0 = i0 / 8;
        for (int64_t g = 0; g * 8 < count; g++) {
            uint64_t w = 0;
            for (int j = 0; j < 8 && g * 8 + j < count; j++) w |= (uint64_t)codes[g * 8 + j] << (bits * j);
            for (int b = 0; b < bits; b++) {
                int64_t at = (g0 + g) * bits + b;
                if (at < nbytes) out[at] = (uint8_t)(w >> (8 * b));
            }
        }
    }
}

void mo_pack(const uint8_t *codes, int64_t n, int bits, uint8_t *out, int64_t nbytes, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < num_blocks(n); b++) {
        int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
        pack_block(codes + i0, count, bits, i0, out, nbytes);
    }
}

void mo_unpack(const uint8_t *packed, int64_t nbytes, int64_t n, int bits, uint8_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < num_blocks(n); b++) {
        int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
        unpack_block(packed, nbytes, bits, i0, count, out + i0);
    }
}

/* A block's mask as 0/1 bytes, element i at [i - i0]: `mask` itself, or with `bits1` its 1-bit stream
 * (stash's saved mask, never unpacked to full size) unpacked into buf; NULL without a mask. */
static void unpack_block(const uint8_t *packed, int64_t nbytes, int bits, int64_t i0, int64_t count, uint8_t *dst);

static inline const uint8_t *block_mask(const uint8_t *mask, int bits1, int64_t n, int64_t i0, int64_t count,
                                        uint8_t *buf) {
    if (!mask) return NULL;
    if (!bits1) return mask + i0;
    unpack_block(mask, (n + 7) / 8, 1, i0, count, buf);
    return buf;
}

/* The end of the run of elements from `start` that lie in one channel, at most `stop`. */
static inline int64_t segment_end(int64_t start, int64_t S, int64_t stop) {
    int64_t end = (start / S + 1) * S;
    return end < stop ? end : stop;
}

/* Bin k covers (lo + k w, lo + (k+1) w]; clipped to [0, top] (a NaN gives 0). */
static inline uint8_t code_of_r(float r, float top) {
    float q = ceilf(r) - 1.0f;
    q = q > 0.0f ? q : 0.0f;
    q = q < top ? q : top;
    return (uint8_t)(int32_t)q;
}

/* One channel's run of codes; `centre` and `split` are constants at every call, so each variant is its
 * own branch-free loop the compiler vectorises. With `r_out` each value's r = (v - lo) / w is kept there too
 * (for bin_sums_run). */
static inline void encode_run(const float *restrict x, const uint8_t *restrict mask, uint8_t *restrict dst,
                              int64_t count, int centre, int split, float m, float sc, float l0, float v0,
                              float l1, float v1, float top, float *restrict r_out) {
    for (int64_t i = 0; i < count; i++) {
        float v = centre ? (x[i] - m) * sc : x[i];
        int side = split ? mask[i] != 0 : 0;
        float r = (v - (side ? l1 : l0)) / (side ? v1 : v0);
        dst[i] = code_of_r(r, top);
        if (r_out) r_out[i] = r;
    }
}

/* Where a value lies inside its bin, for the bin means (stash_grid.add_bin_sums): t = r - k, in (0, 1] inside
 * the window (beyond it, how far out), as the fixed-point integer 2^20 t truncated toward zero (t clamped to
 * +-2^16 bins). Integers add exactly in any order, so the means are the same on every path and thread count.
 * Not finite (a NaN or inf channel, whose statistics are NaN anyway): not counted. */
#define OFFSET_ONE 1048576.0f

static inline int64_t offset_fixed(float r, uint8_t k, int *finite) {
    const float t = r - (float)k;
    *finite = isfinite(t);
    return *finite ? (int64_t)((t < -65536.0f ? -65536.0f : (t > 65536.0f ? 65536.0f : t)) * OFFSET_ONE) : 0;
}

/* The offsets of the run's elements whose index in the whole tensor is a multiple of `stride` (the run starts
 * at index `start`), added into sum / cnt at side 2^bits + k. */
static inline void bin_sums_run(const float *restrict r, const uint8_t *restrict mask, const uint8_t *restrict k,
                                int64_t count, int split, int bins, int64_t start, int stride,
                                int64_t *restrict sum, int64_t *restrict cnt) {
    int finite;
    for (int64_t i = (stride - start % stride) % stride; i < count; i += stride) {
        const int at = (split ? (mask[i] != 0) * bins : 0) + k[i];
        sum[at] += offset_fixed(r[i], k[i], &finite);
        cnt[at] += finite;
    }
}

/* Codes of v = (x - mean) * scale (mean NULL: v = x) on the grid (lo1 NULL: one grid, else side 1 where
 * the mask is set), as stash_grid._code_. With zero_code (a z code whose zero is the bin edge
 * j = zero_code[c]) positive values go to bins >= j and the rest below; positive means !(v <= 0) when
 * positive_not_le (ReLU / ReLU6: a NaN passes the gradient), else v > 0. Packed straight into out. With
 * bin_sums (2 x C x T int64, T = sides x 2^bits, zeroed by the caller): per channel, side and code the sum of
 * the fixed-point offsets (bin_sums_run) of every sum_stride-th element, then their counts. */
void mo_encode(const void *x, int x_bf16, int64_t n, int64_t C, int64_t S, const float *mean, const float *scale,
               const float *lo0, const float *w0, const float *lo1, const float *w1, const uint8_t *mask,
               const int32_t *zero_code, int positive_not_le, int bits, uint8_t *out, int64_t nbytes,
               int64_t *bin_sums, int sum_stride, int nthreads) {
    const float top = (float)((1 << bits) - 1);
    const int bins = 1 << bits;
    const int64_t T = (lo1 ? 2 : 1) * (int64_t)bins, per = 2 * C * T;
    const int threads = nthreads < 1 ? 1 : nthreads;
    /* each thread its own sums (a bin is hit by every block of its channel), added up after */
    int64_t *acc = bin_sums ? (int64_t *)calloc((size_t)threads * per, sizeof(int64_t)) : NULL;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *codes = (uint8_t *)malloc(BLOCK);
        float *rbuf = acc ? (float *)malloc(BLOCK * sizeof(float)) : NULL;
        float *xbuf = x_bf16 ? (float *)malloc(BLOCK * sizeof(float)) : NULL;  /* the block's x, widened */
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        int64_t *mine = acc ? acc + (size_t)t * per : NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            if (xbuf) bf16_widen_run((const uint16_t *)x + i0, xbuf, count);
            for (int64_t s = i0, e; s < i0 + count; s = e) {  /* runs of one channel c */
                const int64_t c = (s / S) % C;
                e = segment_end(s, S, i0 + count);
                const float *xs = xbuf ? xbuf + (s - i0) : (const float *)x + s;
                const float m = mean ? mean[c] : 0.0f, sc = scale ? scale[c] : 1.0f;
                const float l0 = lo0[c], v0 = w0[c];
                const float l1 = lo1 ? lo1[c] : l0, v1 = w1 ? w1[c] : v0;
                const uint8_t *mk = lo1 ? mask + s : NULL;
                uint8_t *dst = codes + (s - i0);
                float *r = rbuf ? rbuf + (s - i0) : NULL;
                if (mean && lo1) encode_run(xs, mk, dst, e - s, 1, 1, m, sc, l0, v0, l1, v1, top, r);
                else if (mean) encode_run(xs, mk, dst, e - s, 1, 0, m, sc, l0, v0, l1, v1, top, r);
                else if (lo1) encode_run(xs, mk, dst, e - s, 0, 1, m, sc, l0, v0, l1, v1, top, r);
                else encode_run(xs, mk, dst, e - s, 0, 0, m, sc, l0, v0, l1, v1, top, r);
                if (zero_code) {
                    const uint8_t j = (uint8_t)zero_code[c], below = (uint8_t)(j - 1);
                    const float *z = xs;
                    for (int64_t i = 0; i < e - s; i++) {
                        int positive = positive_not_le ? !(z[i] <= 0.0f) : z[i] > 0.0f;
                        uint8_t k = dst[i];
                        dst[i] = positive ? (k > j ? k : j) : (k < below ? k : below);
                    }
                }
                if (mine)
                    bin_sums_run(r, mk, dst, e - s, lo1 != NULL, bins, s, sum_stride, mine + c * T,
                                 mine + C * T + c * T);
            }
            pack_block(codes, count, bits, i0, out, nbytes);
        }
        free(codes);
        free(rbuf);
        free(xbuf);
    }
    if (acc) {
        for (int t = 0; t < threads; t++)
            for (int64_t i = 0; i < per; i++) bin_sums[i] += acc[(size_t)t * per + i];
        free(acc);
    }
}

/* Decoding reads per channel either a code book (stash_grid.code_book; is_book): T = 2^bits floats, or 2 x 2^bits
 * for a split code (side 1 where the mask is set), the value of code k on side s at [s 2^bits + k] (the bin's
 * midpoint or the mean of the values it coded); or the grid's rows (lo0, w0[, lo1, w1]) per channel, the value
 * the midpoint (k + 1/2) w + lo computed here (the same float32 arithmetic as code_book's midpoints). */
static inline int64_t book_stride(int is_book, int split, int bins) {
    return is_book ? (split ? 2 : 1) * (int64_t)bins : (split ? 4 : 2);
}

/* A run's values from its channel's book (or rows) into out. A compiler turns book[k] into gather instructions,
 * which made a rebuild 3x slower than the midpoint arithmetic; with AVX-512 a book of at most 32 entries sits in
 * two registers and one permute looks up 16 values (books exist only at K <= 4: stash_grid.MEAN_BITS). Either
 * way each value is the book's entry itself, so the results are the same. */
static inline void decode_run(const uint8_t *restrict k, const uint8_t *restrict mask, int64_t count, int split,
                              int bins, int is_book, const float *restrict book, float *restrict out) {
    int64_t i = 0;
    if (!is_book) {
        const float l0 = book[0], v0 = book[1], l1 = split ? book[2] : l0, v1 = split ? book[3] : v0;
        if (split)
            for (; i < count; i++) {
                const int side = mask[i] != 0;
                out[i] = ((float)k[i] + 0.5f) * (side ? v1 : v0) + (side ? l1 : l0);
            }
        else
            for (; i < count; i++) out[i] = ((float)k[i] + 0.5f) * v0 + l0;
        return;
    }
#ifdef __AVX512F__
    const int T = (split ? 2 : 1) * bins;
    if (T <= 32) {
        const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)((1u << (T < 16 ? T : 16)) - 1u), book);
        const __m512 hi = T > 16 ? _mm512_maskz_loadu_ps((__mmask16)((1u << (T - 16)) - 1u), book + 16)
                                 : _mm512_setzero_ps();
        const __m512i width = _mm512_set1_epi32(bins), one = _mm512_set1_epi32(1);
        for (; i + 16 <= count; i += 16) {
            __m512i at = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(k + i)));
            if (split) {
                __m512i side = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mask + i)));
                at = _mm512_add_epi32(at, _mm512_mullo_epi32(_mm512_min_epu32(side, one), width));
            }
            _mm512_storeu_ps(out + i, _mm512_permutex2var_ps(lo, at, hi));
        }
    }
#endif
    for (; i < count; i++) out[i] = book[(split ? (mask[i] != 0) * bins : 0) + k[i]];
}

enum { ACT_IDENTITY = 0, ACT_RELU = 1, ACT_RELU6 = 2, ACT_LEAKY_RELU = 3 };
enum { MASK_NONE = 0, MASK_BYTES = 1, MASK_FROM_CODE = 2 };

static inline float activation_at(float z, int on, int act, float slope) {
    if (act == ACT_RELU) return on ? (z < 0.0f ? 0.0f : z) : 0.0f;
    if (act == ACT_RELU6) return on ? (z < 0.0f ? 0.0f : (z > 6.0f ? 6.0f : z)) : (z > 3.0f ? 6.0f : 0.0f);
    if (act == ACT_LEAKY_RELU) return on ? (z < 0.0f ? 0.0f : z) : (z > 0.0f ? 0.0f : z) * slope;
    return z;
}

/* One channel's run of act(z): z from the book (split: the side is the mask), then the activation in place;
 * `act`, `source` and `split` are constants at every call. */
static inline void rebuild_run(const uint8_t *restrict k, const uint8_t *restrict mask, float *restrict out,
                               int64_t count, int act, int source, int split, uint8_t zc, int is_book,
                               const float *restrict book, int bins, float slope) {
    decode_run(k, mask, count, split, bins, is_book, book, out);
    for (int64_t i = 0; i < count; i++) {
        int on = source == MASK_BYTES ? mask[i] != 0 : (source == MASK_FROM_CODE ? k[i] >= zc : 1);
        out[i] = activation_at(out[i], on, act, slope);
    }
}

#define REBUILD_CASE(ACT)                                                                                    \
    if (source == MASK_BYTES && split) rebuild_run(k, mk, o, len, ACT, MASK_BYTES, 1, zc, is_book, bk, bins, slope); \
    else if (source == MASK_BYTES) rebuild_run(k, mk, o, len, ACT, MASK_BYTES, 0, zc, is_book, bk, bins, slope);    \
    else if (source == MASK_FROM_CODE) rebuild_run(k, mk, o, len, ACT, MASK_FROM_CODE, 0, zc, is_book, bk, bins, slope); \
    else rebuild_run(k, mk, o, len, ACT, MASK_NONE, 0, zc, is_book, bk, bins, slope);

/* act(z) from the code book, the exact mask deciding each element's side of the kink (stash._Stash.rebuild):
 * mask from `mask` (0/1 bytes), else from the code (k >= zero_code[c]), else none (identity). A split book
 * (split set: 2 sides per channel) needs the mask. With out_bf16 `out` is bfloat16: each block's float values are
 * narrowed as they are written (what .to(torch.bfloat16) of the float result gives), no full-size float copy. */
void mo_rebuild(const uint8_t *packed, int64_t nbytes, int bits, int64_t n, int64_t C, int64_t S,
                const float *book, int is_book, int split_book, const uint8_t *mask, int mask_bits,
                const int32_t *zero_code,
                int act, float slope, void *out, int out_bf16, int nthreads) {
    const int source = mask ? MASK_BYTES : (zero_code ? MASK_FROM_CODE : MASK_NONE);
    const int split = split_book && mask != NULL;
    const int bins = 1 << bits;
    const int64_t T = book_stride(is_book, split_book, bins);
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *codes = (uint8_t *)malloc(BLOCK), *mbuf = (uint8_t *)malloc(BLOCK);
        float *obuf = out_bf16 ? (float *)malloc(BLOCK * sizeof(float)) : NULL;  /* the block's values as float */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            unpack_block(packed, nbytes, bits, i0, count, codes);
            const uint8_t *mb = block_mask(mask, mask_bits, n, i0, count, mbuf);
            for (int64_t s = i0, e; s < i0 + count; s = e) {  /* runs of one channel c */
                const int64_t c = (s / S) % C;
                e = segment_end(s, S, i0 + count);
                const float *bk = book + c * T;
                const uint8_t zc = zero_code ? (uint8_t)zero_code[c] : 0;
                const uint8_t *k = codes + (s - i0), *mk = mb ? mb + (s - i0) : NULL;
                float *o = obuf ? obuf + (s - i0) : (float *)out + s;
                const int64_t len = e - s;
                if (act == ACT_RELU) { REBUILD_CASE(ACT_RELU) }
                else if (act == ACT_RELU6) { REBUILD_CASE(ACT_RELU6) }
                else if (act == ACT_LEAKY_RELU) { REBUILD_CASE(ACT_LEAKY_RELU) }
                else { REBUILD_CASE(ACT_IDENTITY) }
            }
            if (obuf) bf16_narrow_run(obuf, (uint16_t *)out + i0, count);
        }
        free(codes);
        free(mbuf);
        free(obuf);
    }
}

/* The exact activation mask of a z code: k >= zero_code[c], as 0/1 bytes, or with out_bits as a 1-bit
 * stream (n / 8 bytes instead of n at the backward peak). */
void mo_mask_from_codes(const uint8_t *packed, int64_t nbytes, int bits, int64_t n, int64_t C, int64_t S,
                        const int32_t *zero_code, uint8_t *out, int out_bits, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *buf = (uint8_t *)malloc(BLOCK);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            uint8_t *dst = out_bits ? buf : out + i0;
            unpack_block(packed, nbytes, bits, i0, count, dst);
            for (int64_t s = i0, e; s < i0 + count; s = e) {  /* runs of one channel c */
                const int64_t c = (s / S) % C;
                e = segment_end(s, S, i0 + count);
                const uint8_t zc = (uint8_t)zero_code[c];
                uint8_t *o = dst + (s - i0);
                for (int64_t i = 0; i < e - s; i++) o[i] = o[i] >= zc;
            }
            if (out_bits) pack_block(buf, count, 1, i0, out, (n + 7) / 8);
        }
        free(buf);
    }
}

/* Sums of x̂ and g x̂ over a run of at most BLOCK elements, x̂ = the book's value (decoded into dec) times the
 * channel's std of x̂: float partial sums in LANES lanes (vectorised), added in double. */
static inline void sums_run(const uint8_t *restrict k, const uint8_t *restrict mask, const float *restrict g,
                            int64_t count, int split, int is_book, const float *restrict book, int bins, float sd,
                            float *restrict dec, double *sum_x, double *sum_gx) {
    decode_run(k, mask, count, split, bins, is_book, book, dec);
    float lx[LANES], lgx[LANES];
    for (int j = 0; j < LANES; j++) lx[j] = lgx[j] = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__) && LANES == 16
    /* GCC 12 turned the plain loop below into shuffles and scalar adds (this pass took twice the time of the
       input-gradient pass); the same lanes and operations, written out */
    {
        const __m512 vsd = _mm512_set1_ps(sd);
        __m512 vx = _mm512_setzero_ps(), vgx = _mm512_setzero_ps();
        for (; i + LANES <= count; i += LANES) {
            const __m512 xh = _mm512_mul_ps(_mm512_loadu_ps(dec + i), vsd);
            vx = _mm512_add_ps(vx, xh);
            vgx = _mm512_add_ps(vgx, _mm512_mul_ps(_mm512_loadu_ps(g + i), xh));
        }
        _mm512_storeu_ps(lx, vx);
        _mm512_storeu_ps(lgx, vgx);
    }
#endif
    for (; i + LANES <= count; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float xh = dec[i + j] * sd;
            lx[j] += xh;
            lgx[j] += g[i + j] * xh;
        }
    double sx = 0.0, sgx = 0.0;
    for (; i < count; i++) {
        float xh = dec[i] * sd;
        sx += xh;
        sgx += (double)(g[i] * xh);
    }
    for (int j = 0; j < LANES; j++) {
        sx += lx[j];
        sgx += lgx[j];
    }
    *sum_x += sx;
    *sum_gx += sgx;
}

/* One channel's run of the input gradient; `io` is g on entry and the gradient on exit when `out` is NULL
 * (the caller's g is not needed afterwards), so both forms stay free of aliasing and vectorise. */
static inline void grad_run(const uint8_t *restrict k, const uint8_t *restrict mask, float *restrict io,
                            float *restrict out, int64_t count, int split, int is_book, const float *restrict book,
                            int bins, float *restrict dec, float sd, float xm, float a, float bsub, float scale) {
    decode_run(k, mask, count, split, bins, is_book, book, dec);
    if (out) {
        for (int64_t i = 0; i < count; i++) {
            float xh = dec[i] * sd;
            out[i] = (((xh - xm) * a + io[i]) - bsub) * scale;
        }
    } else {
        for (int64_t i = 0; i < count; i++) {
            float xh = dec[i] * sd;
            io[i] = (((xh - xm) * a + io[i]) - bsub) * scale;
        }
    }
}

static inline void masked_run(const float *restrict gr, const uint8_t *restrict mk, float *restrict o,
                              int64_t count, int leaky, float slope);

/* BN backward, pass 2: grad_x = (((x̂ - xmean) a + g) - b) s per channel, x̂ rebuilt again from its code
 * (the order of stash._bn_backward's in-place ops); no full-size x̂ is ever stored. out may be g (in place).
 * g NULL: g is rebuilt a block at a time from grad and the mask (the activation's backward, as pass 1 did),
 * so no full-size g is ever written. */
static void mo_bn_grad(const uint8_t *packed, int64_t nbytes, int bits, int64_t n, int64_t C, int64_t S,
                const float *book, int is_book, int split, const uint8_t *mask, int mask_bits, const float *xstd,
                const void *g, const void *grad, int leaky, float slope, const float *xmean, const float *a,
                const float *bsub, const float *scale, void *out, int types, int nthreads) {
    const int bins = 1 << bits;
    const int64_t T = book_stride(is_book, split, bins);
#pragma omp parallel num_threads(nthreads)
    {
        const int g_bf16 = (types & TYPE_G_BF16) != 0, out_bf16 = (types & TYPE_OUT_BF16) != 0;
        uint8_t *codes = (uint8_t *)malloc(BLOCK), *mbuf = (uint8_t *)malloc(BLOCK);
        float *dec = (float *)malloc(BLOCK * sizeof(float));  /* a run's decoded x̂ / std */
        /* this block's g as float: where g is NULL (made from grad) or bf16 (widened) */
        float *gbuf = g && !g_bf16 ? NULL : (float *)malloc(BLOCK * sizeof(float));
        float *gin = !g && (types & TYPE_GRAD_BF16) ? (float *)malloc(BLOCK * sizeof(float)) : NULL;
        float *obuf = out_bf16 ? (float *)malloc(BLOCK * sizeof(float)) : NULL;  /* the block's float grad_x */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            unpack_block(packed, nbytes, bits, i0, count, codes);
            const uint8_t *mb = block_mask(split || !g ? mask : NULL, mask_bits, n, i0, count, mbuf);
            if (!g) {
                if (gin) bf16_widen_run((const uint16_t *)grad + i0, gin, count);
                masked_run(gin ? gin : (const float *)grad + i0, mb, gbuf, count, leaky, slope);
            } else if (g_bf16) bf16_widen_run((const uint16_t *)g + i0, gbuf, count);
            for (int64_t s = i0, e; s < i0 + count; s = e) {  /* runs of one channel c */
                const int64_t c = (s / S) % C;
                e = segment_end(s, S, i0 + count);
                const float sd = xstd[c], *bk = book + c * T;
                float *io = gbuf ? gbuf + (s - i0) : (float *)g + s;
                float *o = out_bf16 ? obuf + (s - i0) : (out == g ? NULL : (float *)out + s);
                if (split)
                    grad_run(codes + (s - i0), mb + (s - i0), io, o, e - s, 1, is_book, bk, bins, dec, sd, xmean[c], a[c],
                             bsub[c], scale[c]);
                else
                    grad_run(codes + (s - i0), NULL, io, o, e - s, 0, is_book, bk, bins, dec, sd, xmean[c], a[c], bsub[c],
                             scale[c]);
            }
            if (out_bf16) bf16_narrow_run(obuf, (uint16_t *)out + i0, count);  /* after g's block was read */
        }
        free(codes);
        free(mbuf);
        free(dec);
        free(gbuf);
        free(gin);
        free(obuf);
    }
}

/* The activation's exact mask from its input z, with ATen's comparisons (stash_grid._mask): ReLU !(z <= 0)
 * (a NaN passes), ReLU6 !(z <= 0 || z >= 6), LeakyReLU z > 0; as 0/1 bytes. */
void mo_act_mask(const void *zv, int z_bf16, int64_t n, int act, uint8_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *zbuf = z_bf16 ? (float *)malloc(BLOCK * sizeof(float)) : NULL;  /* the block's z, widened */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            const int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            const float *z = zbuf ? zbuf : (const float *)zv + i0;
            uint8_t *o = out + i0;
            if (zbuf) bf16_widen_run((const uint16_t *)zv + i0, zbuf, count);
            if (act == ACT_RELU6)
                for (int64_t i = 0; i < count; i++) o[i] = (uint8_t)!((z[i] <= 0.0f) | (z[i] >= 6.0f));
            else if (act == ACT_LEAKY_RELU)
                for (int64_t i = 0; i < count; i++) o[i] = (uint8_t)(z[i] > 0.0f);
            else
                for (int64_t i = 0; i < count; i++) o[i] = (uint8_t)!(z[i] <= 0.0f);
        }
        free(zbuf);
    }
}

/* out = mask ? grad : (leaky ? grad * slope : 0) over a run (at most BLOCK elements), and its sum: float
 * partial sums in LANES lanes of at most BLOCK / LANES terms each (what the compiler vectorises), added in
 * double. */
static inline void masked_run(const float *restrict gr, const uint8_t *restrict mk, float *restrict o,
                              int64_t count, int leaky, float slope) {
    for (int64_t i = 0; i < count; i++) {
        float g = gr[i], other = leaky ? g * slope : 0.0f;  /* both computed: a branch-free select */
        o[i] = mk[i] ? g : other;
    }
}

static inline double masked_sum_run(const float *restrict gr, const uint8_t *restrict mk, float *restrict o,
                                    int64_t count, int leaky, float slope) {
    masked_run(gr, mk, o, count, leaky, slope);
    float lane[LANES];
    for (int j = 0; j < LANES; j++) lane[j] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += o[i + j];
    double total = 0.0;
    for (; i < count; i++) total += o[i];
    for (int j = 0; j < LANES; j++) total += lane[j];
    return total;
}

/* The scale identity's clip term over a run: the sum of gr where the mask is 0 and sign * code >= th, in LANES
 * independent lanes. Not vectorised: GCC 12 at -O3 -march=native on an AMD EPYC with AVX2 (no AVX-512) vectorised
 * this select wrongly (ReLU6 weight gradients off by up to 6.2 against the plain path, caught by
 * tests/stash/test_stash_identity.py; -O2, no -march=native or -fno-tree-vectorize each gave the right sums). */
__attribute__((optimize("no-tree-vectorize"))) static double clip_sum_run(const float *restrict gr, const uint8_t *restrict cd, const uint8_t *restrict mk,
                                  int64_t count, float th, float sgn) {
    float lane[LANES];
    for (int j = 0; j < LANES; j++) lane[j] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES)
        for (int j = 0; j < LANES; j++) {
            int hit = (mk[i + j] == 0) & (sgn * (float)cd[i + j] >= th);
            lane[j] += hit ? gr[i + j] : 0.0f;
        }
    double total = 0.0;
    for (; i < count; i++)
        if (mk[i] == 0 && sgn * (float)cd[i] >= th) total += gr[i];
    for (int j = 0; j < LANES; j++) total += lane[j];
    return total;
}

/* Least / greatest of a run into a[0..4] = (lo, hi0, lo1, hi, any NaN), in LANES independent lanes: a plain
 * loop the compiler turns into vector min / max (each lane's `u < lo ? u : lo` is exactly the instruction's
 * semantics). No `omp simd` min/max reduction: GCC 12 vectorised the masked one wrongly (a greatest value
 * short of the true one, caught by tests/test_native.py). The mask's bytes are widened to 32 bits first:
 * a select between floats on a byte comparison is a mix of widths GCC 12 does not vectorise (the masked
 * run was 8x slower than the unmasked one). */
static inline __attribute__((always_inline)) void extremes_lanes(const float *restrict v, const uint8_t *restrict mk,
                                                                 int64_t count, float *a, const int masked) {
    float lo[LANES], hi0[LANES], lo1[LANES], hi[LANES];
    int32_t nan[LANES];
    for (int j = 0; j < LANES; j++) {
        lo[j] = a[0]; hi0[j] = a[1]; lo1[j] = a[2]; hi[j] = a[3]; nan[j] = 0;
    }
    int32_t on[LANES];
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES) {
        if (masked)
            for (int j = 0; j < LANES; j++) on[j] = (int32_t)mk[i + j];
        else
            for (int j = 0; j < LANES; j++) on[j] = 0;
        for (int j = 0; j < LANES; j++) {
            float u = v[i + j];
            float u0 = on[j] != 0 ? -INFINITY : u, u1 = on[j] != 0 ? u : INFINITY;
            lo[j] = u < lo[j] ? u : lo[j];
            hi[j] = u > hi[j] ? u : hi[j];
            hi0[j] = u0 > hi0[j] ? u0 : hi0[j];
            lo1[j] = u1 < lo1[j] ? u1 : lo1[j];
            nan[j] |= u != u;
        }
    }
    for (; i < count; i++) {
        float u = v[i];
        int onr = masked ? mk[i] != 0 : 0;
        float u0 = onr ? -INFINITY : u, u1 = onr ? u : INFINITY;
        lo[0] = u < lo[0] ? u : lo[0];
        hi[0] = u > hi[0] ? u : hi[0];
        hi0[0] = u0 > hi0[0] ? u0 : hi0[0];
        lo1[0] = u1 < lo1[0] ? u1 : lo1[0];
        nan[0] |= u != u;
    }
    int any = a[4] != 0.0f;
    for (int j = 0; j < LANES; j++) {
        a[0] = lo[j] < a[0] ? lo[j] : a[0];
        a[1] = hi0[j] > a[1] ? hi0[j] : a[1];
        a[2] = lo1[j] < a[2] ? lo1[j] : a[2];
        a[3] = hi[j] > a[3] ? hi[j] : a[3];
        any |= nan[j];
    }
    a[4] = any ? 1.0f : 0.0f;
}

/* two copies, each with its own constant `masked`, so neither loop tests the pointer per element */
static void extremes_run(const float *restrict v, const uint8_t *restrict mk, int64_t count, float *a) {
    if (mk) extremes_lanes(v, mk, count, a, 1);
    else extremes_lanes(v, NULL, count, a, 0);
}

/* Per channel of x: its least and greatest value, and with a mask the greatest where the mask is 0 and
 * the least where it is 1 (stash_grid._ends before its affine map, which is monotonic): rows
 * (lo, hi0, lo1, hi) of out (4 x C floats). An empty side gives +-inf, a channel with a NaN gives NaN. */
void mo_channel_extremes(const void *x, int x_bf16, const uint8_t *mask, int64_t n, int64_t C, int64_t S, float *out,
                         int nthreads) {
    int threads = nthreads < 1 ? 1 : nthreads;
    float *acc = (float *)malloc((size_t)threads * 5 * C * sizeof(float));
    for (int64_t i = 0; i < (int64_t)threads * C; i++) {
        float *a = acc + 5 * i;
        a[0] = INFINITY; a[1] = -INFINITY; a[2] = INFINITY; a[3] = -INFINITY; a[4] = 0.0f;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *xbuf = x_bf16 ? (float *)malloc(BLOCK * sizeof(float)) : NULL;  /* the block's x, widened */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            if (xbuf) bf16_widen_run((const uint16_t *)x + i0, xbuf, count);
            for (int64_t s = i0, e; s < i0 + count; s = e) {  /* runs of one channel c */
                const int64_t c = (s / S) % C;
                e = segment_end(s, S, i0 + count);
                const float *xs = xbuf ? xbuf + (s - i0) : (const float *)x + s;
                if (mask) extremes_run(xs, mask + s, e - s, acc + 5 * ((size_t)t * C + c));
                else extremes_run(xs, NULL, e - s, acc + 5 * ((size_t)t * C + c));
            }
        }
        free(xbuf);
    }
    for (int64_t c = 0; c < C; c++) {
        float lo = INFINITY, hi0 = -INFINITY, lo1 = INFINITY, hi = -INFINITY;
        int nan = 0;
        for (int t = 0; t < threads; t++) {
            const float *a = acc + 5 * ((size_t)t * C + c);
            lo = a[0] < lo ? a[0] : lo;
            hi0 = a[1] > hi0 ? a[1] : hi0;
            lo1 = a[2] < lo1 ? a[2] : lo1;
            hi = a[3] > hi ? a[3] : hi;
            nan |= a[4] != 0.0f;
        }
        out[c] = nan ? NAN : lo;
        out[C + c] = nan ? NAN : hi0;
        out[2 * C + c] = nan ? NAN : lo1;
        out[3 * C + c] = nan ? NAN : hi;
    }
    free(acc);
}

/* ---- Per-channel constants of a chain's x̂ code (C floats, not n): _ends' affine map,
 * _grid, the encode scale and the consumers' affine, in one call instead of some sixty small tensor ops.
 * The same float32 operations in the same order as the plain path; NaN propagates as torch.clamp /
 * minimum / maximum propagate it. */

static inline float clampf_nan(float v, float lo, float hi) { return v != v ? v : (v < lo ? lo : (v > hi ? hi : v)); }
static inline float minf_nan(float a, float b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }
static inline float maxf_nan(float a, float b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }
/* stash_grid.follow_ends: the data's end clamped to +-reach where it lies beyond +-past, else to +-half */
static inline float follow_end(float e, float half, float past, float reach) {
    float lim = fabsf(e) > past ? reach : half;
    return clampf_nan(e, -lim, lim);
}

/* Inputs: invstd and xstd (stash_grid._xhat_std, from PyTorch: its sqrt is not always the correctly rounded
 * one that sqrtf gives, so computing it here changed the last bit); weight / bias (NULL: 1 / 0); mean; raw (4 x C extremes of x from mo_channel_extremes,
 * NULL without data ends); inner (raw holds each side's inner extremes: a residual chain); bits; half (the
 * window's half-width); reach (how far an outer end may follow the data: stash_grid.x_grid_reach; past half
 * only where K is in stash_grid.REACH, where a grid over one window follows it too); past (an outer end follows
 * the data past the window only where the data's end lies beyond it: stash_grid.x_grid_past); split; relu6;
 * residual (the sides' inner ends from the data, not the kink); data_ends (stash_grid.DATA_ENDS: an outer end at the window's edge moves to
 * where the data end).
 * Outputs: scale = invstd / max(xstd, 1e-12), grid (rows lo0, w0[, lo1, w1]: 2 or 4 x C), enc (grid with
 * widths at least FLT_MIN, as the encoder takes them) and, when affine is not NULL, the consumers' rows
 * beta + gamma xstd lo, gamma xstd w per side. */
void mo_chain_grid(int64_t C, const float *invstd, const float *xstd, const float *weight, const float *bias,
                   const float *mean, const float *raw, int inner, int bits, float half, float reach, float past,
                   int split, int relu6, int residual, int data_ends, float *scale, float *grid, float *enc,
                   float *affine) {
    const float bins = (float)(1 << bits), tiny = FLT_MIN;
    for (int64_t c = 0; c < C; c++) {
        const float sd = xstd[c];
        float sdc = sd < 1e-12f ? 1e-12f : sd;  /* clamp_min: NaN stays NaN */
        float sc = invstd[c] / sdc;
        scale[c] = sc;
        float ends[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (raw) {
            float m[4];
            for (int r = 0; r < 4; r++) m[r] = (raw[r * C + c] - mean[c]) * sc;
            if (inner) {
                for (int r = 0; r < 4; r++) ends[r] = isinf(raw[r * C + c]) ? raw[r * C + c] : m[r];
            } else {
                ends[0] = m[0]; ends[1] = m[3]; ends[2] = m[0]; ends[3] = m[3];
            }
        }
        float lo = -half, hi = half;
        if (!split) {
            if (raw && reach > half) {  /* each edge moves out to the data's end, at most to +-reach */
                float e0 = follow_end(ends[0], half, past, reach), e3 = follow_end(ends[3], half, past, reach);
                if (isfinite(e0) && e0 < lo) lo = e0;
                if (isfinite(e3) && e3 > hi) hi = e3;
            }
            grid[c] = lo;
            grid[C + c] = (hi - lo) / bins;
            enc[c] = grid[c];
            enc[C + c] = grid[C + c] < tiny ? tiny : grid[C + c];
            if (affine) {
                float g = weight ? weight[c] : 1.0f, b = bias ? bias[c] : 0.0f, gs = g * sd;
                affine[c] = b + gs * grid[c];
                affine[C + c] = gs * grid[C + c];
            }
            continue;
        }
        float lo0, hi0, lo1, hi1;
        if (residual) {
            lo0 = lo; hi0 = clampf_nan(ends[1], -half, half); lo1 = clampf_nan(ends[2], -half, half); hi1 = hi;
        } else {
            float g = weight ? weight[c] : 1.0f, b = bias ? bias[c] : 0.0f;
            float s = g * sd;
            int ok = fabsf(s) > tiny;  /* false for NaN too */
            float safe = ok ? s : 1.0f;
            float tau = clampf_nan(ok ? -b / safe : lo, -half, half);
            if (relu6) {
                float tau6 = clampf_nan(ok ? (6.0f - b) / safe : hi, -half, half);
                lo1 = minf_nan(tau, tau6); hi1 = maxf_nan(tau, tau6); lo0 = lo; hi0 = hi;
            } else {
                int pos = s > 0.0f;
                lo1 = pos ? tau : lo; hi1 = pos ? hi : tau;
                lo0 = pos ? lo : tau; hi0 = pos ? tau : hi;
            }
            if (!ok) { lo1 = lo; hi1 = hi; lo0 = lo; hi0 = hi; }
        }
        if (raw && data_ends) {
            float e[4];
            int fin[4];
            for (int r = 0; r < 4; r++) {
                e[r] = follow_end(ends[r], half, past, reach);
                fin[r] = isfinite(e[r]);
            }
            if (lo0 <= -half && fin[0]) lo0 = e[0];
            if (hi0 >= half && fin[1]) hi0 = e[1];
            if (lo1 <= -half && fin[2]) lo1 = e[2];
            if (hi1 >= half && fin[3]) hi1 = e[3];
        }
        float row[4] = {lo0, (hi0 - lo0) / bins, lo1, (hi1 - lo1) / bins};
        for (int r = 0; r < 4; r++) {
            grid[r * C + c] = row[r];
            enc[r * C + c] = (r % 2 && row[r] < tiny) ? tiny : row[r];
        }
        if (affine) {
            float g = weight ? weight[c] : 1.0f, b = bias ? bias[c] : 0.0f, gs = g * sd;
            affine[c] = b + gs * row[0];
            affine[C + c] = gs * row[1];
            affine[2 * C + c] = b + gs * row[2];
            affine[3 * C + c] = gs * row[3];
        }
    }
}

/* ---- The whole BN backward of a chain in two passes, with no full-size x̂ (stash._bn_backward):
 * pass 1 per channel sums x̂ and g x̂ (and, given `grad`, first writes g = the activation's backward of grad
 * through the mask and sums it: one read of g fewer than a separate pass); then per channel
 *   m = mean x̂,  sum_gx = sum g x̂ - m sum g  (the sum of g times centred x̂; `exact_ok[c]` takes exact_val[c]),
 *   a = -sum_gx / count,  b = sum_g / count,  s = gamma * invstd;
 * pass 2 writes grad_x = (((x̂ - m) a + g) - b) s into out (which may be g). sum_g is read (no grad) or written
 * (float), sum_gx written (float). g NULL (with grad and a mask): the caller needs no g, so it is never written
 * at full size; each pass makes a block's g from grad and the mask again (one full-size write and read fewer,
 * the same values). `types` (TYPE_*): grad, g and out may be bfloat16, widened and narrowed a block at a time, so
 * an autocast step's backward makes no full-size float32 tensor (the sums and grad_x are the float32 ones). */
void mo_bn_backward(const uint8_t *packed, int64_t nbytes, int bits, int64_t n, int64_t C, int64_t S,
                    const float *book, int is_book, int split, const uint8_t *mask, int mask_bits, const float *xstd,
                    const void *grad, int act, float slope, void *g,
                    float *sum_g, const float *gamma_invstd, const float *exact_val, const uint8_t *exact_ok,
                    const float *solve, float top, void *out, float *sum_gx, int types, int nthreads) {
    /* solve (memopt/stash/identity.py, with grad and a mask): rows R, beta, gamma, threshold, sign, ok per
       channel; the weight gradient becomes (R - top * clip - beta * sum_g) / gamma where ok and finite, clip
       being the sum of grad over the mask-false elements whose code satisfies sign * code >= threshold */
    int threads = nthreads < 1 ? 1 : nthreads;
    const int bins = 1 << bits;
    const int64_t T = book_stride(is_book, split, bins);
    const int clipping = solve && grad && mask && top != 0.0f;
    const int keep_g = g != NULL;  /* g NULL (with grad and a mask): the caller needs only grad_x, g stays per block */
    const int grad_bf16 = grad && (types & TYPE_GRAD_BF16), g_bf16 = (types & TYPE_G_BF16) != 0;
    double *acc = (double *)calloc((size_t)threads * 4 * C, sizeof(double));
#pragma omp parallel num_threads(threads)
    {
        uint8_t *codes = (uint8_t *)malloc(BLOCK), *mbuf = (uint8_t *)malloc(BLOCK);
        float *dec = (float *)malloc(BLOCK * sizeof(float));  /* a run's decoded x̂ / std */
        /* g of this block as float: not kept, or kept as bf16 (narrowed after the block) */
        float *gbuf = keep_g && !g_bf16 ? NULL : (float *)malloc(BLOCK * sizeof(float));
        float *gin = grad_bf16 ? (float *)malloc(BLOCK * sizeof(float)) : NULL;  /* the block's grad, widened */
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        double *ax = acc + (size_t)t * 4 * C, *agx = ax + C, *ag = agx + C, *aclip = ag + C;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks(n); b++) {
            int64_t i0 = b * BLOCK, count = n - i0 < BLOCK ? n - i0 : BLOCK;
            unpack_block(packed, nbytes, bits, i0, count, codes);
            const uint8_t *mb = block_mask(mask, mask_bits, n, i0, count, mbuf);
            if (gin) bf16_widen_run((const uint16_t *)grad + i0, gin, count);
            else if (!grad && g_bf16) bf16_widen_run((const uint16_t *)g + i0, gbuf, count);  /* g is the input */
            const float *gr = gin ? gin : grad ? (const float *)grad + i0 : NULL;  /* the block's grad */
            for (int64_t s = i0, e; s < i0 + count; s = e) {  /* runs of one channel c */
                const int64_t c = (s / S) % C;
                e = segment_end(s, S, i0 + count);
                float *gs = gbuf ? gbuf + (s - i0) : (float *)g + s;
                if (grad) ag[c] += masked_sum_run(gr + (s - i0), mb + (s - i0), gs, e - s, act == ACT_LEAKY_RELU, slope);
                if (clipping && isfinite(solve[3 * C + c]))  /* an infinite threshold: nothing can be clipped */
                    aclip[c] += clip_sum_run(gr + (s - i0), codes + (s - i0), mb + (s - i0), e - s, solve[3 * C + c],
                                             solve[4 * C + c]);
                const float sd = xstd[c], *bk = book + c * T;
                if (split)
                    sums_run(codes + (s - i0), mb + (s - i0), gs, e - s, 1, is_book, bk, bins, sd, dec, ax + c, agx + c);
                else sums_run(codes + (s - i0), NULL, gs, e - s, 0, is_book, bk, bins, sd, dec, ax + c, agx + c);
            }
            if (grad && keep_g && g_bf16) bf16_narrow_run(gbuf, (uint16_t *)g + i0, count);  /* g is an output */
        }
        free(codes);
        free(mbuf);
        free(dec);
        free(gbuf);
        free(gin);
    }
    const double count = (double)(C ? n / C : 1);
    float *xmean = (float *)malloc(4 * (size_t)C * sizeof(float));
    float *a = xmean + C, *bsub = a + C, *scale = bsub + C;
    for (int64_t c = 0; c < C; c++) {
        double sx = 0.0, sgx = 0.0, sg = 0.0, sclip = 0.0;
        for (int t = 0; t < threads; t++) {
            sx += acc[(size_t)t * 4 * C + c];
            sgx += acc[(size_t)t * 4 * C + C + c];
            sg += acc[(size_t)t * 4 * C + 2 * C + c];
            sclip += acc[(size_t)t * 4 * C + 3 * C + c];
        }
        if (grad) sum_g[c] = (float)sg;
        double m = sx / count;
        float centred = (float)(sgx - m * (double)sum_g[c]);  /* m is about 0: nothing cancels */
        if (exact_ok && exact_ok[c]) centred = exact_val[c];
        if (solve && solve[5 * C + c] != 0.0f) {
            const float rhs = solve[c] - top * (float)sclip;
            const float solved = (rhs - solve[C + c] * sum_g[c]) / solve[2 * C + c];
            if (isfinite(solved)) centred = solved;
        }
        sum_gx[c] = centred;
        xmean[c] = (float)m;
        a[c] = -centred / (float)count;
        bsub[c] = sum_g[c] / (float)count;
        scale[c] = gamma_invstd[c];
    }
    free(acc);
    mo_bn_grad(packed, nbytes, bits, n, C, S, book, is_book, split, mask, mask_bits, xstd, keep_g ? g : NULL, grad,
               act == ACT_LEAKY_RELU, slope, xmean, a, bsub, scale, out, types, nthreads);
    free(xmean);
}
