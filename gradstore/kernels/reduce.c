/* gradstore's fused reductions: the statistics of a dense block of floats in one pass over memory.
 *
 * Built by gradstore/kernel.py on first use (cc -O3 -march=native) and called through ctypes. The loops
 * use GCC/Clang vector extensions: 2 x 8 independent lanes per accumulator, each lane accumulated in order,
 * so no -ffast-math is needed and NaN and Inf keep their IEEE meaning. Sums are accumulated in double.
 *
 * gs_full_*:   out[0] sum, out[1] sum of squares, out[2] min, out[3] max, out[4] count of zeros
 * gs_health_*: out[0] sum of squares, out[1] min, out[2] max
 * gs_m2_*:     returns the sum of squared differences from `mean`
 *
 * A NaN anywhere makes the sums NaN, an Inf makes them Inf or NaN: the caller checks the sum of squares
 * for finiteness (a float32's square cannot overflow a double) and counts non-finite values elsewhere.
 * min and max skip NaN, so they are meaningful only when the sums are finite.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef double f64x8 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int64_t i64x8 __attribute__((vector_size(64)));

static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline f64x8 load_f64(const double *p) { f64x8 v; memcpy(&v, p, sizeof v); return v; }
static inline f64x8 wide_f32(f32x8 v) { return __builtin_convertvector(v, f64x8); }
static inline f64x8 wide_f64(f64x8 v) { return v; }
/* a < b ? a : b (and a > b ? a : b) lane by lane: a NaN in a keeps b. x86's min/max instructions have
 * exactly this meaning; elsewhere a compare and a bit blend. */
#if defined(__AVX__)
#include <immintrin.h>
static inline f32x8 min_f32(f32x8 a, f32x8 b) { return (f32x8)_mm256_min_ps((__m256)a, (__m256)b); }
static inline f32x8 max_f32(f32x8 a, f32x8 b) { return (f32x8)_mm256_max_ps((__m256)a, (__m256)b); }
#else
static inline f32x8 min_f32(f32x8 a, f32x8 b) { i32x8 m = a < b; return (f32x8)(((i32x8)a & m) | ((i32x8)b & ~m)); }
static inline f32x8 max_f32(f32x8 a, f32x8 b) { i32x8 m = a > b; return (f32x8)(((i32x8)a & m) | ((i32x8)b & ~m)); }
#endif
#if defined(__AVX512F__)
static inline f64x8 min_f64(f64x8 a, f64x8 b) { return (f64x8)_mm512_min_pd((__m512d)a, (__m512d)b); }
static inline f64x8 max_f64(f64x8 a, f64x8 b) { return (f64x8)_mm512_max_pd((__m512d)a, (__m512d)b); }
#else
static inline f64x8 min_f64(f64x8 a, f64x8 b) { i64x8 m = a < b; return (f64x8)(((i64x8)a & m) | ((i64x8)b & ~m)); }
static inline f64x8 max_f64(f64x8 a, f64x8 b) { i64x8 m = a > b; return (f64x8)(((i64x8)a & m) | ((i64x8)b & ~m)); }
#endif

#define LANES 16 /* elements per iteration: two vectors of 8 */

/* T: element type, S: suffix (f32/f64), V: vector of 8 T, I: the integer vector a comparison of V gives */
#define DEFINE(T, S, V, I)                                                                        \
    void gs_full_##S(const T *x, int64_t n, double *out) {                                       \
        const V zero = {0};                                                                       \
        f64x8 s0 = {0}, s1 = {0}, q0 = {0}, q1 = {0};                                             \
        V mn0 = zero + INFINITY, mn1 = mn0, mx0 = zero - INFINITY, mx1 = mx0;                     \
        I z0 = {0}, z1 = {0};                                                                     \
        int64_t i = 0, stop = n - n % LANES;                                                      \
        for (; i < stop; i += LANES) {                                                            \
            V a = load_##S(x + i), b = load_##S(x + i + 8);                                       \
            f64x8 da = wide_##S(a), db = wide_##S(b);                                             \
            s0 += da; s1 += db;                                                                   \
            q0 += da * da; q1 += db * db;                                                         \
            mn0 = min_##S(a, mn0); mn1 = min_##S(b, mn1);                                         \
            mx0 = max_##S(a, mx0); mx1 = max_##S(b, mx1);                                         \
            z0 -= (I)(a == zero); z1 -= (I)(b == zero); /* true is -1 */                          \
        }                                                                                         \
        double S = 0, Q = 0, MN = INFINITY, MX = -INFINITY;                                       \
        int64_t Z = 0;                                                                            \
        for (int j = 0; j < 8; j++) {                                                             \
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
        f64x8 q0 = {0}, q1 = {0};                                                                 \
        V mn0 = zero + INFINITY, mn1 = mn0, mx0 = zero - INFINITY, mx1 = mx0;                     \
        int64_t i = 0, stop = n - n % LANES;                                                      \
        for (; i < stop; i += LANES) {                                                            \
            V a = load_##S(x + i), b = load_##S(x + i + 8);                                       \
            f64x8 da = wide_##S(a), db = wide_##S(b);                                             \
            q0 += da * da; q1 += db * db;                                                         \
            mn0 = min_##S(a, mn0); mn1 = min_##S(b, mn1);                                         \
            mx0 = max_##S(a, mx0); mx1 = max_##S(b, mx1);                                         \
        }                                                                                         \
        double Q = 0, MN = INFINITY, MX = -INFINITY;                                              \
        for (int j = 0; j < 8; j++) {                                                             \
            Q += q0[j] + q1[j];                                                                   \
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
        f64x8 q0 = {0}, q1 = {0}, m = (f64x8){0} + mean;                                          \
        int64_t i = 0, stop = n - n % LANES;                                                      \
        for (; i < stop; i += LANES) {                                                            \
            f64x8 da = wide_##S(load_##S(x + i)) - m, db = wide_##S(load_##S(x + i + 8)) - m;     \
            q0 += da * da; q1 += db * db;                                                         \
        }                                                                                         \
        double Q = 0;                                                                             \
        for (int j = 0; j < 8; j++) Q += q0[j] + q1[j];                                           \
        for (; i < n; i++) { double d = (double)x[i] - mean; Q += d * d; }                        \
        return Q;                                                                                 \
    }

DEFINE(float, f32, f32x8, i32x8)
DEFINE(double, f64, f64x8, i64x8)

int gs_abi_version(void) { return 1; }
