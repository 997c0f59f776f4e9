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
#if W == 8 /* one vcvtps2pd zmm, ymm: GCC 12 makes __builtin_convertvector four narrow ones and two shuffles, which
              * made the loops below bound by the shuffle port; the same exact conversion */
static inline dvec wide_f32(svec v) { return (dvec)_mm512_cvtps_pd((__m256)v); }
#else
static inline dvec wide_f32(svec v) { return __builtin_convertvector(v, dvec); }
#endif
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

/* ---- non-finite values: exact counts, statistics over the finite values ---------------------------------------
 * gs_masked_*: one pass: out[0] NaN count, out[1] +Inf count, out[2] -Inf count, out[3] zeros (+0 and -0),
 *   out[4] finite count, out[5] sum, out[6] sum of squares, out[7] min, out[8] max, each over the finite values
 *   only (min +Inf and max -Inf when there is none). Sums in double: a float32's cannot overflow; a float64's can
 *   (|x| past 1.3e154), which the caller sees as a sum that is not finite.
 * gs_masked_m2_*: the sum of squared differences of the finite values from `mean` (the second pass of the
 *   finite variance). */
#define DEFINE_MASKED(T, S)                                                                       \
    void gs_masked_##S(const T *x, int64_t n, double *out) {                                     \
        const dvec zero = {0}, pinf = zero + INFINITY, ninf = zero - INFINITY;                    \
        dmask cn = {0}, cp = {0}, cm = {0}, cz = {0}, cf = {0};                                   \
        dvec s = {0}, q = {0}, mn = pinf, mx = ninf;                                              \
        int64_t i = 0, stop = n - n % W;                                                          \
        for (; i < stop; i += W) {                                                                \
            dvec a;                                                                               \
            LOAD_##S(a, x + i);                                                                   \
            dmask f = (a - a) == zero; /* Inf - Inf and NaN - NaN are NaN */                      \
            cn -= (dmask)(a != a); cp -= (dmask)(a == pinf); cm -= (dmask)(a == ninf);            \
            cz -= (dmask)(a == zero); cf -= f;                                                    \
            dvec v = (dvec)((dmask)a & f); /* the finite values, +0 elsewhere */                  \
            s += v; q += v * v;                                                                   \
            mn = min_f64((dvec)(((dmask)a & f) | ((dmask)pinf & ~f)), mn);                        \
            mx = max_f64((dvec)(((dmask)a & f) | ((dmask)ninf & ~f)), mx);                        \
        }                                                                                         \
        double S = 0, Q = 0, MN = INFINITY, MX = -INFINITY;                                       \
        int64_t N = 0, P = 0, M = 0, Z = 0, F = 0;                                                \
        for (int j = 0; j < W; j++) {                                                             \
            S += s[j]; Q += q[j]; N += cn[j]; P += cp[j]; M += cm[j]; Z += cz[j]; F += cf[j];     \
            MN = mn[j] < MN ? mn[j] : MN; MX = mx[j] > MX ? mx[j] : MX;                           \
        }                                                                                         \
        for (; i < n; i++) {                                                                      \
            double d = (double)x[i];                                                              \
            if (d - d == 0) {                                                                     \
                F++; S += d; Q += d * d; MN = d < MN ? d : MN; MX = d > MX ? d : MX; Z += d == 0; \
            } else if (d != d) {                                                                  \
                N++;                                                                              \
            } else if (d > 0) {                                                                   \
                P++;                                                                              \
            } else {                                                                              \
                M++;                                                                              \
            }                                                                                     \
        }                                                                                         \
        out[0] = (double)N; out[1] = (double)P; out[2] = (double)M; out[3] = (double)Z;           \
        out[4] = (double)F; out[5] = S; out[6] = Q; out[7] = MN; out[8] = MX;                     \
    }                                                                                             \
                                                                                                  \
    double gs_masked_m2_##S(const T *x, int64_t n, double mean) {                                \
        const dvec zero = {0}, m = zero + mean;                                                   \
        dvec q = {0};                                                                             \
        int64_t i = 0, stop = n - n % W;                                                          \
        for (; i < stop; i += W) {                                                                \
            dvec a;                                                                               \
            LOAD_##S(a, x + i);                                                                   \
            dmask f = (a - a) == zero;                                                            \
            dvec d = (dvec)((dmask)(a - m) & f);                                                  \
            q += d * d;                                                                           \
        }                                                                                         \
        double Q = 0;                                                                             \
        for (int j = 0; j < W; j++) Q += q[j];                                                    \
        for (; i < n; i++) {                                                                      \
            double d = (double)x[i];                                                              \
            if (d - d == 0) Q += (d - mean) * (d - mean);                                         \
        }                                                                                         \
        return Q;                                                                                 \
    }

#define LOAD_f32(a, p) do { (a) = wide_f32(load_f32(p)); } while (0)
#define LOAD_f64(a, p) memcpy(&(a), (p), sizeof(a))
DEFINE_MASKED(float, f32)
DEFINE_MASKED(double, f64)

/* ---- the finished statistics vector of one tensor (gradstore/recording/stats.py, VEC_LEN positions) -------------
 * gs_stats: out[0..9] = nan, posinf, neginf, zeros, finite count, norm, min, max, mean, std (Bessel-corrected;
 * NaN marks "not computed": zeros, mean and std at health), for n > 0 values of kind 0 (float32) or 1 (float64),
 * level 1 (health) or 2 (full). The same arithmetic, in the same order, as stats.py's host code: an all-finite
 * tensor takes the one-pass kernel (and the second pass around the mean where the mean dominates); one that is
 * NaN throughout gives the masked results without a second pass (the kernel's min and max skip NaN); any other
 * non-finite one takes gs_masked and gs_masked_m2. Returns 0, or 1 where the sums of finite float64 values
 * overflow (|x| past 1.3e154), or whose largest finite magnitude is so small that its squares underflow (`tiny`):
 * the caller measures that tensor with its values scaled (stats.py, `_masked`).
 * The products below go through a volatile so that no compiler fuses them into a multiply-add: the results are
 * bit for bit those of the same expressions in Python. */
static double product(double a, double b) { volatile double p = a * b; return p; }

static void all_nan(int64_t n, int level, double *out) {
    double nan = NAN;
    double full[10] = {(double)n, 0, 0, 0, 0, 0, INFINITY, -INFINITY, nan, -0.0};
    double health[10] = {(double)n, 0, 0, nan, 0, 0, INFINITY, -INFINITY, nan, nan};
    memcpy(out, level == 2 ? full : health, sizeof full);
}

/* stats.py `_tiny`: the largest finite magnitude (min, max of the finite values) is so small that the squares lose
 * precision to underflow: float64 values below 2^-500 (squares near the smallest normal double), float32 ones below
 * 2^-50 at health (squares added in float32). The caller measures those scaled, as an overflow. */
static int tiny(int kind, int level, double mn, double mx) {
    double big = fmax(fabs(mn), fabs(mx)); /* +Inf where no value is finite */
    double limit = kind == 1 ? 0x1p-500 : (level != 2 ? 0x1p-50 : 0.0);
    return big > 0.0 && big < limit;
}

static double std_of(double m2, int64_t n) { /* stats.py `_std` */
    return n > 1 ? sqrt((m2 > 0.0 ? m2 : 0.0) / (double)(n - 1)) : NAN;
}

int gs_stats(const void *x, int64_t n, int kind, int level, double *out) {
    double r[9];
    if (level != 2) {
        if (kind == 0) gs_health_f32(x, n, r); else gs_health_f64(x, n, r);
        if (isfinite(r[0])) {
            if (tiny(kind, level, r[1], r[2])) return 1;
            double v[10] = {0, 0, 0, NAN, (double)n, sqrt(r[0]), r[1], r[2], NAN, NAN};
            memcpy(out, v, sizeof v);
            return 0;
        }
        if (r[1] == INFINITY && r[2] == -INFINITY) { all_nan(n, level, out); return 0; }
    } else {
        if (kind == 0) gs_full_f32(x, n, r); else gs_full_f64(x, n, r);
        double s = r[0], sumsq = r[1], mn = r[2], mx = r[3];
        if (isfinite(s) && isfinite(sumsq)) {
            if (tiny(kind, level, mn, mx)) return 1;
            double mean = s / (double)n;
            double m2 = sumsq - product(s, mean);
            if (mn == mx) {
                m2 = 0.0;
            } else if (m2 < product(1e-4 * s, mean)) { /* the mean dominates: redo around the mean */
                m2 = kind == 0 ? gs_m2_f32(x, n, mean) : gs_m2_f64(x, n, mean);
            }
            double v[10] = {0, 0, 0, r[4], (double)n, sqrt(sumsq), mn, mx, mean, std_of(m2, n)};
            memcpy(out, v, sizeof v);
            return 0;
        }
        if (mn == INFINITY && mx == -INFINITY) { all_nan(n, level, out); return 0; }
    }
    if (kind == 0) gs_masked_f32(x, n, r); else gs_masked_f64(x, n, r);
    double nf = r[4], s = r[5], q = r[6];
    if (!(isfinite(s) && isfinite(q)) || tiny(kind, level, r[7], r[8])) return 1;
    out[0] = r[0]; out[1] = r[1]; out[2] = r[2]; out[4] = nf; out[5] = sqrt(q); out[6] = r[7]; out[7] = r[8];
    if (level == 2) {
        double mean = s / nf; /* 0 / 0: NaN where nothing is finite, as the masked path */
        double m2 = nf > 0 ? (kind == 0 ? gs_masked_m2_f32(x, n, mean) : gs_masked_m2_f64(x, n, mean)) : 0.0;
        if (!isfinite(m2)) return 1;
        out[3] = r[3]; out[8] = mean; out[9] = sqrt(m2 / (nf - 1)); /* sqrt(0 / -1) = -0.0 with none finite */
    } else {
        out[3] = NAN; out[8] = NAN; out[9] = NAN;
    }
    return 0;
}

/* gs_stats of `count` tensors in one call: tensor i has `numels[i]` > 0 values of kind `kinds[i]` at ptrs[i]; its
 * vector goes to out[10 i .. 10 i + 9] and gs_stats's return value to rc[i]. */
void gs_stats_many(int64_t count, const int64_t *ptrs, const int64_t *numels, const int8_t *kinds, int level,
                   double *out, int8_t *rc) {
    for (int64_t i = 0; i < count; i++)
        rc[i] = (int8_t)gs_stats((const void *)(intptr_t)ptrs[i], numels[i], kinds[i], level, out + 10 * i);
}

int gs_abi_version(void) { return 10; }
