/* Fused CPU kernels for the generic stash's group codes and few-bit backward (memopt/runtime/native_generic.py
 * wraps them; memopt/runtime/native.py compiles this file with kernels.c into one library, same flags).
 *
 * The plain-PyTorch path (memopt/stash/generic.py: group_quantize, _code_groups, group_dequantize;
 * memopt/fewbit/ops.py: _scale_by_levels) runs a dozen full-size ops per tensor (aminmax, sub, div, round, clamp,
 * cast, pack; unpack, copy, mul, add; unpack, take, mul). Each kernel here does one pass with the same float32
 * arithmetic in the same order (built with -ffp-contract=off, no fast-math), so codes, group parameters, rebuilt
 * values and gradients are bit-identical to that path (tests/runtime/test_native_generic.py):
 *
 * - group minimum and maximum as torch.aminmax(dim=1) finds them on the CPU: a sequential scan that keeps the
 *   first element attaining each extreme, so a group whose extreme is zero keeps the sign of its first zero, and
 *   a group holding a NaN has the first NaN (its bits) as both extremes;
 * - step = (max - min) / (2^K - 1); t = (v - min) / max(step, FLT_MIN) (a NaN step stays NaN), IEEE divisions;
 *   rounded half to even (torch.round), clamped to [0, 2^K - 1], a NaN coded 0 (what PyTorch's cast gives);
 * - rebuilt value: (float)code * step, then + min (two roundings, as mul_ then add_);
 * - few-bit backward: grad * levels[code] (torch.mul(grad, levels.take(codes))).
 *
 * Codes are the LSB-first stream of memopt/runtime/bitpack.py: element i occupies stream bits [i*K, (i+1)*K).
 * Work is split into spans whose first element is a multiple of 8 (and, to code, of the group), so every span
 * starts on a byte of the stream and threads never share a byte.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define GCHUNK 2048 /* elements whose codes are made (or unpacked) into a stack buffer at a time: a multiple of 8 */

/* A bfloat16 input (autocast's CPU activations; `x_bf16` below) is widened into a float buffer a span or chunk at a
 * time (kernels.c's widening): exact, so the codes are those of its float32 copy, which the callers made whole
 * before. */
void mo_bf16_widen(const uint16_t *in, float *out, int64_t count);

static inline const float *widened(const void *x, int x_bf16, int64_t i0, int64_t count, float *buf) {
    if (!x_bf16) return (const float *)x + i0;
    mo_bf16_widen((const uint16_t *)x + i0, buf, count);
    return buf;
}

/* ---- packing: codes [0, count) are elements i0 + k (i0 a multiple of 8); the last byte zero-padded ---- */

static inline __attribute__((always_inline)) void pack_k(const uint8_t *restrict codes, int64_t count, const int bits,
                                                          uint8_t *restrict p) {
    int64_t full = count / 8;
    for (int64_t g = 0; g < full; g++) {
        uint64_t w = 0;
        for (int j = 0; j < 8; j++) w |= (uint64_t)codes[8 * g + j] << (bits * j);
        for (int b = 0; b < bits; b++) p[g * bits + b] = (uint8_t)(w >> (8 * b));
    }
    int64_t rest = count - full * 8;
    if (rest) {
        uint64_t w = 0;
        for (int64_t j = 0; j < rest; j++) w |= (uint64_t)codes[8 * full + j] << (bits * j);
        int64_t nb = (rest * bits + 7) / 8;
        for (int64_t b = 0; b < nb; b++) p[full * bits + b] = (uint8_t)(w >> (8 * b));
    }
}

static void pack_span(const uint8_t *codes, int64_t count, int bits, int64_t i0, uint8_t *out) {
    uint8_t *p = out + i0 / 8 * bits;
    switch (bits) {
    case 1: pack_k(codes, count, 1, p); break;
    case 2: pack_k(codes, count, 2, p); break;
    case 3: pack_k(codes, count, 3, p); break;
    case 4: pack_k(codes, count, 4, p); break;
    case 5: pack_k(codes, count, 5, p); break;
    case 6: pack_k(codes, count, 6, p); break;
    case 7: pack_k(codes, count, 7, p); break;
    default: memcpy(p, codes, (size_t)count); break;
    }
}

static inline __attribute__((always_inline)) void unpack_k(const uint8_t *restrict p, int64_t count, const int bits,
                                                            uint8_t *restrict dst) {
    const uint64_t m = (1u << bits) - 1u;
    int64_t full = count / 8;
    for (int64_t g = 0; g < full; g++) {
        uint64_t w = 0;
        for (int b = 0; b < bits; b++) w |= (uint64_t)p[g * bits + b] << (8 * b);
        for (int j = 0; j < 8; j++) dst[8 * g + j] = (uint8_t)((w >> (bits * j)) & m);
    }
    int64_t rest = count - full * 8;
    if (rest) {  /* only the stream's last bytes: never read past them */
        uint64_t w = 0;
        int64_t nb = (rest * bits + 7) / 8;
        for (int64_t b = 0; b < nb; b++) w |= (uint64_t)p[full * bits + b] << (8 * b);
        for (int64_t j = 0; j < rest; j++) dst[8 * full + j] = (uint8_t)((w >> (bits * j)) & m);
    }
}

static void unpack_span(const uint8_t *packed, int bits, int64_t i0, int64_t count, uint8_t *dst) {
    const uint8_t *p = packed + i0 / 8 * bits;
    switch (bits) {
    case 1: unpack_k(p, count, 1, dst); break;
    case 2: unpack_k(p, count, 2, dst); break;
    case 3: unpack_k(p, count, 3, dst); break;
    case 4: unpack_k(p, count, 4, dst); break;
    case 5: unpack_k(p, count, 5, dst); break;
    case 6: unpack_k(p, count, 6, dst); break;
    case 7: unpack_k(p, count, 7, dst); break;
    default: memcpy(dst, p, (size_t)count); break;
    }
}

/* ---- group encode ---- */

/* least and greatest of m values (m >= 1), and whether any is NaN: in vector registers where the ISA has them
   (GCC 12 does not vectorise the plain lanes below); which of two equal zeros comes out is fixed afterwards */
static void extremes_of(const float *restrict v, int64_t m, float *lo_out, float *hi_out, int *nan_out) {
    float a = v[0], b = v[0];
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (m >= 16) {
        __m512 lo = _mm512_set1_ps(v[0]), hi = lo;
        __mmask16 bad = 0;
        for (; i + 16 <= m; i += 16) {
            __m512 x = _mm512_loadu_ps(v + i);
            lo = _mm512_min_ps(x, lo);
            hi = _mm512_max_ps(x, hi);
            bad |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        }
        a = _mm512_reduce_min_ps(lo);
        b = _mm512_reduce_max_ps(hi);
        nan = bad != 0;
    }
#elif defined(__AVX__)
    if (m >= 8) {
        __m256 lo = _mm256_set1_ps(v[0]), hi = lo, bad = _mm256_setzero_ps();
        for (; i + 8 <= m; i += 8) {
            __m256 x = _mm256_loadu_ps(v + i);
            lo = _mm256_min_ps(x, lo);
            hi = _mm256_max_ps(x, hi);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        }
        float l8[8], h8[8];
        _mm256_storeu_ps(l8, lo);
        _mm256_storeu_ps(h8, hi);
        for (int j = 0; j < 8; j++) {
            a = l8[j] < a ? l8[j] : a;
            b = h8[j] > b ? h8[j] : b;
        }
        nan = _mm256_movemask_ps(bad) != 0;
    }
#endif
    for (; i < m; i++) {
        float x = v[i];
        a = x < a ? x : a;
        b = x > b ? x : b;
        nan |= x != x;
    }
    *lo_out = a;
    *hi_out = b;
    *nan_out = nan;
}

/* torch.aminmax(dim=1) of one group: the values, then the element torch keeps where that matters (its CPU
   kernel scans in order and replaces an extreme only by a strictly smaller / greater value, stopping at the
   first NaN): with a NaN, the first NaN is both extremes; a zero extreme is the group's first zero, sign and all */
static void group_extremes(const float *restrict v, int64_t m, float *lo_out, float *hi_out) {
    float a, b;
    int nan;
    extremes_of(v, m, &a, &b, &nan);
    int64_t i;
    if (nan) {
        for (i = 0; v[i] == v[i]; i++) {}
        a = b = v[i];
    } else if (a == 0.0f || b == 0.0f) {
        for (i = 0; v[i] != 0.0f; i++) {}
        if (a == 0.0f) a = v[i];
        if (b == 0.0f) b = v[i];
    }
    *lo_out = a;
    *hi_out = b;
}

static inline float divisor_of(float step) { return step != step ? step : (step < FLT_MIN ? FLT_MIN : step); }

/* nearest-rounded codes of count values of one group */
static inline void code_run(const float *restrict v, int64_t count, float lo, float d, float top,
                            uint8_t *restrict dst) {
    for (int64_t i = 0; i < count; i++) {
        float t = rintf((v[i] - lo) / d);
        t = t > 0.0f ? t : 0.0f;  /* a NaN goes to 0, as PyTorch's cast of the clamped NaN */
        t = t < top ? t : top;
        dst[i] = (uint8_t)(int32_t)t;
    }
}

/* elements per span: a multiple of the group and of 8, at least about GCHUNK */
static int64_t span_of(int64_t group) {
    int64_t a = group, b = 8;
    while (b) { int64_t r = a % b; a = b; b = r; }
    int64_t span = group / a * 8;
    while (span < GCHUNK) span *= 2;
    return span;
}

void mo_group_encode(const void *xv, int x_bf16, int64_t n, int64_t group, int bits, uint8_t *out, float *params,
                     int nthreads) {
    const int64_t ngroups = (n + group - 1) / group, span = span_of(group), nspans = (n + span - 1) / span;
    const float top = (float)((1 << bits) - 1);
    float *lo_row = params, *step_row = params + ngroups;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t s = 0; s < nspans; s++) {
        const int64_t i0 = s * span, count = n - i0 < span ? n - i0 : span;
        float *wide = x_bf16 ? (float *)malloc((size_t)count * sizeof(float)) : NULL;
        const float *xs = widened(xv, x_bf16, i0, count, wide);  /* the span's values as float */
        for (int64_t k = 0; k < count; k += group) {  /* the span's groups: minimum and step */
            const int64_t g = (i0 + k) / group, m = count - k < group ? count - k : group;
            float lo, hi;
            group_extremes(xs + k, m, &lo, &hi);
            lo_row[g] = lo;
            step_row[g] = (hi - lo) / top;
        }
        uint8_t buf[GCHUNK];
        for (int64_t c0 = 0; c0 < count; c0 += GCHUNK) {  /* then codes, a chunk at a time, while still in cache */
            const int64_t cc = count - c0 < GCHUNK ? count - c0 : GCHUNK;
            uint8_t *dst = bits == 8 ? out + i0 + c0 : buf;
            for (int64_t k = c0; k < c0 + cc;) {
                const int64_t g = (i0 + k) / group, end0 = (g + 1) * group - i0;
                const int64_t end = end0 < c0 + cc ? end0 : c0 + cc;
                code_run(xs + k, end - k, lo_row[g], divisor_of(step_row[g]), top, dst + (k - c0));
                k = end;
            }
            if (bits != 8) pack_span(buf, cc, bits, i0 + c0, out);
        }
        free(wide);
    }
}

/* ---- group decode: float32 values in the codes' (memory) order ---- */

void mo_group_decode(const uint8_t *packed, int64_t n, int64_t group, int bits, const float *lo_row,
                     const float *step_row, float *out, int nthreads) {
    const int64_t nchunks = (n + GCHUNK - 1) / GCHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t i0 = c * GCHUNK, cc = n - i0 < GCHUNK ? n - i0 : GCHUNK;
        uint8_t buf[GCHUNK];
        const uint8_t *codes = buf;
        if (bits == 8) codes = packed + i0;
        else unpack_span(packed, bits, i0, cc, buf);
        for (int64_t k = 0; k < cc;) {
            const int64_t g = (i0 + k) / group, end0 = (g + 1) * group - i0;
            const int64_t end = end0 < cc ? end0 : cc;
            const float lo = lo_row[g], step = step_row[g];
            float *restrict o = out + i0;
            for (int64_t i = k; i < end; i++) {
                float p = (float)codes[i] * step;
                o[i] = p + lo;
            }
            k = end;
        }
    }
}

/* ---- few-bit backward: grad * levels[code], float32 ---- */

void mo_fewbit_scale(const uint8_t *packed, int64_t n, int bits, const float *levels, const float *grad, float *out,
                     int nthreads) {
    const int64_t nchunks = (n + GCHUNK - 1) / GCHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t i0 = c * GCHUNK, cc = n - i0 < GCHUNK ? n - i0 : GCHUNK;
        uint8_t buf[GCHUNK];
        const uint8_t *codes = buf;
        if (bits == 8) codes = packed + i0;
        else unpack_span(packed, bits, i0, cc, buf);
        const float *restrict g = grad + i0;
        float *restrict o = out + i0;
        for (int64_t i = 0; i < cc; i++) o[i] = g[i] * levels[codes[i]];
    }
}

/* ---- few-bit forward of a table op: each float32 value's piece, packed ----
 * The piece is the number of borders strictly below the value (``x > border``, the borders ascending and already
 * rounded to float32 by the caller), as the plain path's comparisons (at most 15 borders) or ``bucketize`` (more)
 * count it; a NaN compares false with every border and takes ``nan_code`` (0 where the plain path compares, the
 * number of borders where ``bucketize`` puts it last). A scan of every border costs a comparison each and a binary
 * search is bound by the latency of its dependent loads (8 of them at 8 bits), so a uniform grid over [first
 * border, last border] gives a starting count and the exact count is walked from there by the same comparisons:
 * the grid only says where to start, never the answer, so a value rounded into a neighbouring cell still gets its
 * exact piece. Up to 3 borders (where the scan is as quick), or borders without a finite positive width, are
 * scanned. */
#define FEWBIT_CELLS 4096

static inline int pieces_below(float v, const float *restrict borders, int nb, const int *restrict start,
                               float first, float scale) {
    if (!start) {
        int k = 0;
        for (int j = 0; j < nb; j++) k += v > borders[j];
        return k;
    }
    const float t = (v - first) * scale; /* -inf, +inf and values outside the grid clamp to its ends */
    int c = start[t > 0 ? (t < FEWBIT_CELLS ? (int)t : FEWBIT_CELLS) : 0];
    while (c > 0 && !(borders[c - 1] < v)) c--;
    while (c < nb && borders[c] < v) c++;
    return c;
}

void mo_fewbit_encode(const void *x, int x_bf16, int64_t n, const float *borders, int nb, int bits, int nan_code,
                      uint8_t *out, int nthreads) {
    int cells[FEWBIT_CELLS + 1];
    const int *start = NULL;
    const float first = nb ? borders[0] : 0.0f, width = nb ? borders[nb - 1] - borders[0] : 0.0f;
    const float scale = width > 0 && width <= FLT_MAX ? FEWBIT_CELLS / width : 0.0f;
    if (nb > 3 && scale > 0 && scale <= FLT_MAX) {
        for (int k = 0, c = 0; k <= FEWBIT_CELLS; k++) {
            const float edge = first + (float)k / scale;
            while (c < nb && borders[c] < edge) c++;
            cells[k] = c;
        }
        start = cells;
    }
    const int64_t nchunks = (n + GCHUNK - 1) / GCHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t i0 = c * GCHUNK, cc = n - i0 < GCHUNK ? n - i0 : GCHUNK;
        uint8_t buf[GCHUNK];
        float wide[GCHUNK];
        const float *restrict v = widened(x, x_bf16, i0, cc, wide);
        for (int64_t i = 0; i < cc; i++)
            buf[i] = v[i] != v[i] ? (uint8_t)nan_code : (uint8_t)pieces_below(v[i], borders, nb, start, first, scale);
        pack_span(buf, cc, bits, i0, out);
    }
}

/* ---- the fidelity gate's comparison of two gradients: sums of g*g, a*a, g*a and (a-g)^2 in double ----
 * One pass over two float32 arrays where PyTorch takes a float64 copy of each and four reductions. Each block of
 * CMP_BLOCK elements is summed in order in double, the blocks' sums then added in block order: the result does
 * not depend on the thread count. */
#define CMP_BLOCK 65536

void mo_compare(const float *g, const float *a, int64_t n, double *partial, double *out, int nthreads) {
    const int64_t nblocks = (n + CMP_BLOCK - 1) / CMP_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t i0 = b * CMP_BLOCK, i1 = i0 + CMP_BLOCK < n ? i0 + CMP_BLOCK : n;
        double gg = 0, aa = 0, ga = 0, dd = 0;
        for (int64_t i = i0; i < i1; i++) {
            const double x = g[i], y = a[i], d = y - x;
            gg += x * x;
            aa += y * y;
            ga += x * y;
            dd += d * d;
        }
        partial[4 * b] = gg, partial[4 * b + 1] = aa, partial[4 * b + 2] = ga, partial[4 * b + 3] = dd;
    }
    out[0] = out[1] = out[2] = out[3] = 0;
    for (int64_t b = 0; b < nblocks; b++)
        for (int k = 0; k < 4; k++) out[k] += partial[4 * b + k];
}
