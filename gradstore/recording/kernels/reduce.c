/* gradstore's fused reductions: the statistics of a dense block of floats in one pass over memory.
 *
 * Built by gradstore/recording/kernel.py on first use (cc -O3 -march=native) and called through ctypes. The loops
 * use GCC/Clang vector extensions, W doubles wide (8 with AVX-512, 4 with AVX, else 2), two vectors per
 * accumulator, each lane accumulated in order: no -ffast-math is needed and NaN and Inf keep their IEEE
 * meaning. Sums are accumulated in double.
 *
 * gs_full_*:   out[0] sum, out[1] sum of squares, out[2] min, out[3] max, out[4] count of zeros
 * gs_health_*: out[0] sum of squares, out[1] min, out[2] max; for float32 the squares are added in float32
 *              over blocks of BLOCK values per lane, each block's sums then in double: the sum of squares
 *              is within (BLOCK + 1) * 2^-24 ~ 1e-6 relative (the norm within 5e-7), at about 60 % of the
 *              full-precision cost
 * gs_m2_*:     returns the sum of squared differences from `mean`
 * gs_slices_f32: per-slice sums of squares, in double, of a float32 block of shape (outer, k, inner)
 *              (record(slices=...): gradstore/recording/slices.py)
 *
 * A NaN anywhere makes the sums NaN, an Inf makes them Inf or NaN: the caller checks the sum of squares
 * for finiteness and counts non-finite values elsewhere. Finite values can make it infinite too: float64
 * values past 1.3e154 (their squares pass the largest double), and at health float32 values past 1.8e19
 * (their squares pass the largest float in the float32 blocks); a float32's square cannot overflow a double
 * at full. The caller then measures the tensor again with its values scaled by a power of two
 * (gradstore/recording/stats.py, `_masked`): the true norm, not Inf.
 * min and max skip NaN, so they are meaningful only when the sums are finite.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define W 8
#elif defined(__AVX__)
#define W 4
#else
#define W 2
#endif

typedef double dvec __attribute__((vector_size(8 * W)));   /* W doubles */
typedef int64_t dmask __attribute__((vector_size(8 * W))); /* what comparing two dvec gives */
typedef float svec __attribute__((vector_size(4 * W)));    /* W floats */
typedef int32_t smask __attribute__((vector_size(4 * W)));

static inline svec load_f32(const float *p) { svec v; memcpy(&v, p, sizeof v); return v; }
static inline dvec load_f64(const double *p) { dvec v; memcpy(&v, p, sizeof v); return v; }
static inline dvec wide_f32(svec v) { return __builtin_convertvector(v, dvec); }
static inline dvec wide_f64(dvec v) { return v; }

/* a < b ? a : b (and a > b ? a : b) lane by lane: a NaN in a keeps b. x86's min/max instructions have
 * exactly this meaning; elsewhere a compare and a bit blend. */
#if W == 8
static inline svec min_f32(svec a, svec b) { return (svec)_mm256_min_ps((__m256)a, (__m256)b); }
static inline svec max_f32(svec a, svec b) { return (svec)_mm256_max_ps((__m256)a, (__m256)b); }
static inline dvec min_f64(dvec a, dvec b) { return (dvec)_mm512_min_pd((__m512d)a, (__m512d)b); }
static inline dvec max_f64(dvec a, dvec b) { return (dvec)_mm512_max_pd((__m512d)a, (__m512d)b); }
#elif W == 4
static inline svec min_f32(svec a, svec b) { return (svec)_mm_min_ps((__m128)a, (__m128)b); }
static inline svec max_f32(svec a, svec b) { return (svec)_mm_max_ps((__m128)a, (__m128)b); }
static inline dvec min_f64(dvec a, dvec b) { return (dvec)_mm256_min_pd((__m256d)a, (__m256d)b); }
static inline dvec max_f64(dvec a, dvec b) { return (dvec)_mm256_max_pd((__m256d)a, (__m256d)b); }
#else
static inline svec min_f32(svec a, svec b) { smask m = a < b; return (svec)(((smask)a & m) | ((smask)b & ~m)); }
static inline svec max_f32(svec a, svec b) { smask m = a > b; return (svec)(((smask)a & m) | ((smask)b & ~m)); }
static inline dvec min_f64(dvec a, dvec b) { dmask m = a < b; return (dvec)(((dmask)a & m) | ((dmask)b & ~m)); }
static inline dvec max_f64(dvec a, dvec b) { dmask m = a > b; return (dvec)(((dmask)a & m) | ((dmask)b & ~m)); }
#endif

/* zero count of the 2W values a and b (at p): a compare into a bit mask and a popcount with AVX-512 or AVX,
 * else lane counters (a true comparison is -1) */
#if W == 8
static inline void zeros_f32(const float *p, svec a, svec b, smask *z0, smask *z1, int64_t *zc) {
    (void)a; (void)b; (void)z0; (void)z1; /* one 16-float load beats joining a and b */
    *zc += __builtin_popcount(_mm512_cmpeq_ps_mask(_mm512_loadu_ps(p), _mm512_setzero_ps()));
}
static inline void zeros_f64(const double *p, dvec a, dvec b, dmask *z0, dmask *z1, int64_t *zc) {
    (void)p; (void)z0; (void)z1;
    *zc += __builtin_popcount(_mm512_cmpeq_pd_mask((__m512d)a, _mm512_setzero_pd()))
         + __builtin_popcount(_mm512_cmpeq_pd_mask((__m512d)b, _mm512_setzero_pd()));
}
#elif W == 4
static inline void zeros_f32(const float *p, svec a, svec b, smask *z0, smask *z1, int64_t *zc) {
    (void)a; (void)b; (void)z0; (void)z1; /* AVX: one 8-float compare, its sign bits, a popcount */
    *zc += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_EQ_OQ)));
}
static inline void zeros_f64(const double *p, dvec a, dvec b, dmask *z0, dmask *z1, int64_t *zc) {
    (void)p; (void)z0; (void)z1;
    *zc += __builtin_popcount(_mm256_movemask_pd(_mm256_cmp_pd((__m256d)a, _mm256_setzero_pd(), _CMP_EQ_OQ)))
         + __builtin_popcount(_mm256_movemask_pd(_mm256_cmp_pd((__m256d)b, _mm256_setzero_pd(), _CMP_EQ_OQ)));
}
#else
static inline void zeros_f32(const float *p, svec a, svec b, smask *z0, smask *z1, int64_t *zc) {
    const svec zero = {0};
    (void)p; (void)zc;
    *z0 -= (smask)(a == zero); *z1 -= (smask)(b == zero);
}
static inline void zeros_f64(const double *p, dvec a, dvec b, dmask *z0, dmask *z1, int64_t *zc) {
    const dvec zero = {0};
    (void)p; (void)zc;
    *z0 -= (dmask)(a == zero); *z1 -= (dmask)(b == zero);
}
#endif

#define BLOCK 16 /* health, float32: values per lane added in float32 before the sum moves to double */
#define LANES (2 * W) /* elements per iteration: two vectors */

/* T: element type, S: suffix (f32/f64), V: vector of W T, I: the integer vector a comparison of V gives */
#define DEFINE(T, S, V, I)                                                                        \
    void gs_full_##S(const T *x, int64_t n, double *out) {                                       \
        const V zero = {0};                                                                       \
        dvec s0 = {0}, s1 = {0}, q0 = {0}, q1 = {0};                                              \
        V mn0 = zero + INFINITY, mn1 = mn0, mx0 = zero - INFINITY, mx1 = mx0;                     \
        I z0 = {0}, z1 = {0};                                                                     \
        int64_t zc = 0, i = 0, stop = n - n % LANES;                                              \
        for (; i < stop; i += LANES) {                                                            \
            V a = load_##S(x + i), b = load_##S(x + i + W);                                       \
            dvec da = wide_##S(a), db = wide_##S(b);                                              \
            s0 += da; s1 += db;                                                                   \
            q0 += da * da; q1 += db * db;                                                         \
            mn0 = min_##S(a, mn0); mn1 = min_##S(b, mn1);                                         \
            mx0 = max_##S(a, mx0); mx1 = max_##S(b, mx1);                                         \
            zeros_##S(x + i, a, b, &z0, &z1, &zc);                                                     \
        }                                                                                         \
        double S = 0, Q = 0, MN = INFINITY, MX = -INFINITY;                                       \
        int64_t Z = zc;                                                                           \
        for (int j = 0; j < W; j++) {                                                             \
            S += s0[j] + s1[j]; Q += q0[j] + q1[j]; Z += (int64_t)z0[j] + (int64_t)z1[j];        \
            MN = mn0[j] < MN ? mn0[j] : MN; MN = mn1[j] < MN ? mn1[j] : MN;                       \
            MX = mx0[j] > MX ? mx0[j] : MX; MX = mx1[j] > MX ? mx1[j] : MX;                       \
        }                                                                                         \
        for (; i < n; i++) {                                                                      \
            double d = (double)x[i];                                                              \
            S += d; Q += d * d; MN = d < MN ? d : MN; MX = d > MX ? d : MX; Z += (x[i] == 0);     \
        }                                                                                         \
        out[0] = S; out[1] = Q; out[2] = MN; out[3] = MX; out[4] = (double)Z;                     \
    }                                                                                             \
                                                                                                  \
    void gs_health_##S(const T *x, int64_t n, double *out) {                                     \
        const V zero = {0};                                                                       \
        dvec q = {0};                                                                             \
        V mn0 = zero + INFINITY, mn1 = mn0, mx0 = zero - INFINITY, mx1 = mx0;                     \
        int64_t i = 0, stop = n - n % LANES;                                                      \
        while (i < stop) {                                                                        \
            V q0 = zero, q1 = zero; /* BLOCK iterations of squares in T, then added in double */  \
            int64_t end = i + BLOCK * LANES < stop ? i + BLOCK * LANES : stop;                    \
            for (; i < end; i += LANES) {                                                         \
                V a = load_##S(x + i), b = load_##S(x + i + W);                                   \
                q0 += a * a; q1 += b * b;                                                         \
                mn0 = min_##S(a, mn0); mn1 = min_##S(b, mn1);                                     \
                mx0 = max_##S(a, mx0); mx1 = max_##S(b, mx1);                                     \
            }                                                                                     \
            q += wide_##S(q0) + wide_##S(q1);                                                     \
        }                                                                                         \
        double Q = 0, MN = INFINITY, MX = -INFINITY;                                              \
        for (int j = 0; j < W; j++) {                                                             \
            Q += q[j];                                                                            \
            MN = mn0[j] < MN ? mn0[j] : MN; MN = mn1[j] < MN ? mn1[j] : MN;                       \
            MX = mx0[j] > MX ? mx0[j] : MX; MX = mx1[j] > MX ? mx1[j] : MX;                       \
        }                                                                                         \
        for (; i < n; i++) {                                                                      \
            double d = (double)x[i];                                                              \
            Q += d * d; MN = d < MN ? d : MN; MX = d > MX ? d : MX;                               \
        }                                                                                         \
        out[0] = Q; out[1] = MN; out[2] = MX;                                                     \
    }                                                                                             \
                                                                                                  \
    double gs_m2_##S(const T *x, int64_t n, double mean) {                                       \
        dvec q0 = {0}, q1 = {0}, m = (dvec){0} + mean;                                            \
        int64_t i = 0, stop = n - n % LANES;                                                      \
        for (; i < stop; i += LANES) {                                                            \
            dvec da = wide_##S(load_##S(x + i)) - m, db = wide_##S(load_##S(x + i + W)) - m;      \
            q0 += da * da; q1 += db * db;                                                         \
        }                                                                                         \
        double Q = 0;                                                                             \
        for (int j = 0; j < W; j++) Q += q0[j] + q1[j];                                           \
        for (; i < n; i++) { double d = (double)x[i] - mean; Q += d * d; }                        \
        return Q;                                                                                 \
    }

DEFINE(float, f32, svec, smask)
DEFINE(double, f64, dvec, dmask)

/* out[i] = the sum over o, j of x[(o * k + i) * inner + j]^2 (slice i along the middle dimension), in double.
 * A float32's square in double can neither overflow nor vanish (the smallest subnormal's is 2e-90), so out[i]
 * is 0 exactly when slice i is all zero, and not finite exactly when it holds a NaN or an infinity. One pass in
 * memory order: with inner == 1 (slices along the last dimension) the k sums are updated a vector at a time,
 * else each run of `inner` values is summed in vector lanes. */
void gs_slices_f32(const float *x, int64_t outer, int64_t k, int64_t inner, double *out) {
    for (int64_t i = 0; i < k; i++) out[i] = 0;
    if (inner == 1) {
        for (int64_t o = 0; o < outer; o++) {
            const float *row = x + o * k;
            int64_t i = 0;
            for (; i + W <= k; i += W) {
                dvec a = wide_f32(load_f32(row + i)), acc;
                memcpy(&acc, out + i, sizeof acc);
                acc += a * a;
                memcpy(out + i, &acc, sizeof acc);
            }
            for (; i < k; i++) { double d = (double)row[i]; out[i] += d * d; }
        }
        return;
    }
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t i = 0; i < k; i++) {
            const float *p = x + (o * k + i) * inner;
            dvec q0 = {0}, q1 = {0};
            int64_t j = 0, stop = inner - inner % LANES;
            for (; j < stop; j += LANES) {
                dvec a = wide_f32(load_f32(p + j)), b = wide_f32(load_f32(p + j + W));
                q0 += a * a; q1 += b * b;
            }
            double s = 0;
            for (int l = 0; l < W; l++) s += q0[l] + q1[l];
            for (; j < inner; j++) { double d = (double)p[j]; s += d * d; }
            out[i] += s;
        }
    }
}

int gs_abi_version(void) { return 2; }
