/* A tree ensemble evaluated by leaf masks: learned.TreeEnsemble.predict's numpy path, compiled, because numpy's
 * cost per operation rules at a bundle's size (tens to hundreds of kernels, a few hundred trees) and the first
 * select of a new problem has a budget of 200 us in all.
 *
 * The tables are learned.TreeEnsemble._masks': per feature its splits' thresholds, sorted, and a table whose row p
 * holds per tree the leaves that remain once the first p splits' tests (x <= threshold) failed; all tables'
 * rows one after another in `stack`. A row of x keeps in each tree the AND of one table row per feature (p: how
 * many thresholds lie below its value) and exits at the lowest set bit: the leftmost leaf left. */
#include <stdint.h>

/* On x86-64 Linux, one copy of each function for x86-64-v3 (AVX2 for the mask ANDs, BMI's tzcnt for the lowest
 * set bit: 18% less time than the baseline build on the 2-core dev machine's EPYC, bench/results/selection_cost_*)
 * and one baseline copy, picked when the library loads by what this CPU has: the cached build stays right on a
 * machine that shares it but lacks AVX2. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define TD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TD_CLONES
#endif

/* How many thresholds lie below the value (Python's bisect_left); NaN fails every test: past them all. */
static int64_t below(const double *thresholds, int64_t count, double value) {
    if (value != value)
        return count;
    int64_t lo = 0, hi = count;
    while (lo < hi) {
        int64_t mid = (lo + hi) >> 1;
        if (thresholds[mid] < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* For each of `rows` rows of x (row r at x + r * x_stride, its features by index):
 *   alive = start (the row's own at start + r * start_stride, or one for all rows with start_stride 0; all ones
 *           where start is NULL) AND, for each of the `columns` features f, the stack row base[f] + below(f's
 *           thresholds, x[f]);
 *   masks_out (where not NULL): alive, at masks_out + r * trees;
 *   out (where not NULL): the sum over the trees of leaf_values[tree * width + lowest set bit of alive].
 * A column alike in every row (a feature of the problem alone) is searched and ANDed once, into `shared`; the
 * others' indices go to `varying`. Scratch: shared holds 2 x `trees` masks, alive `trees` (unused with
 * masks_out), varying `columns` indices. Returns 0, or -1 where a tree has no leaf left (tables not of these
 * trees).
 * Kernels side by side often share their varying columns' values (one tile, other stages or warps): a value equal
 * to the row before's is not searched again, and where all of a row's table rows are the row before's, their AND
 * is too. The table rows are ANDed four at a time and the leaves summed into four partial sums: one pass over the
 * masks per four columns, four add chains instead of one. */
#define EVALUATE(NAME, MASK, LOWEST)                                                                                \
    TD_CLONES                                                                                                       \
    int NAME(int64_t rows, int64_t trees, int64_t width, const double *x, int64_t x_stride, int64_t columns,        \
             const int64_t *column, const int64_t *base, const int64_t *first, const int64_t *count,                \
             const double *thresholds, const MASK *stack, const MASK *start, int64_t start_stride,                  \
             const double *leaf_values, MASK *shared, MASK *alive, int64_t *varying, MASK *masks_out,               \
             double *out) {                                                                                         \
        int64_t n_varying = 0;                                                                                      \
        if (rows <= 0)                                                                                              \
            return 0;                                                                                               \
        for (int64_t t = 0; t < trees; ++t)                                                                         \
            shared[t] = (MASK)~(MASK)0;                                                                             \
        for (int64_t j = 0; j < columns; ++j) {                                                                     \
            int64_t f = column[j], r = 1;                                                                           \
            double value = x[f];                                                                                    \
            while (r < rows && x[r * x_stride + f] == value)                                                        \
                ++r;                                                                                                \
            if (r < rows || value != value) {                                                                       \
                varying[n_varying++] = f;                                                                           \
                continue;                                                                                           \
            }                                                                                                       \
            const MASK *m = stack + (base[f] + below(thresholds + first[f], count[f], value)) * trees;              \
            for (int64_t t = 0; t < trees; ++t)                                                                     \
                shared[t] &= m[t];                                                                                  \
        }                                                                                                           \
        MASK *v = shared + trees; /* the AND of the varying columns' rows, made again where a row's differ */       \
        int64_t p_last[n_varying > 0 ? n_varying : 1];                                                              \
        double x_last[n_varying > 0 ? n_varying : 1];                                                               \
        for (int64_t r = 0; r < rows; ++r) {                                                                        \
            const double *xr = x + r * x_stride;                                                                    \
            MASK *a = masks_out ? masks_out + r * trees : alive;                                                    \
            int same = r > 0;                                                                                       \
            for (int64_t j = 0; j < n_varying; ++j) {                                                               \
                int64_t f = varying[j];                                                                             \
                int64_t p = r > 0 && xr[f] == x_last[j] ? p_last[j]                                                 \
                                                         : below(thresholds + first[f], count[f], xr[f]);           \
                same = same && p == p_last[j];                                                                      \
                p_last[j] = p;                                                                                      \
                x_last[j] = xr[f];                                                                                  \
            }                                                                                                       \
            if (!same) {                                                                                            \
                for (int64_t t = 0; t < trees; ++t)                                                                 \
                    v[t] = (MASK)~(MASK)0;                                                                          \
                int64_t j = 0;                                                                                      \
                for (; j + 4 <= n_varying; j += 4) {                                                                \
                    const MASK *m0 = stack + (base[varying[j]] + p_last[j]) * trees;                                \
                    const MASK *m1 = stack + (base[varying[j + 1]] + p_last[j + 1]) * trees;                        \
                    const MASK *m2 = stack + (base[varying[j + 2]] + p_last[j + 2]) * trees;                        \
                    const MASK *m3 = stack + (base[varying[j + 3]] + p_last[j + 3]) * trees;                        \
                    for (int64_t t = 0; t < trees; ++t)                                                             \
                        v[t] &= (m0[t] & m1[t]) & (m2[t] & m3[t]);                                                  \
                }                                                                                                   \
                for (; j < n_varying; ++j) {                                                                        \
                    const MASK *m = stack + (base[varying[j]] + p_last[j]) * trees;                                 \
                    for (int64_t t = 0; t < trees; ++t)                                                             \
                        v[t] &= m[t];                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            if (start) {                                                                                            \
                const MASK *s = start + r * start_stride;                                                           \
                for (int64_t t = 0; t < trees; ++t)                                                                 \
                    a[t] = s[t] & shared[t] & v[t];                                                                 \
            } else {                                                                                                \
                for (int64_t t = 0; t < trees; ++t)                                                                 \
                    a[t] = shared[t] & v[t];                                                                        \
            }                                                                                                       \
            if (out) {                                                                                              \
                double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;                                                      \
                int64_t t = 0;                                                                                      \
                for (; t + 4 <= trees; t += 4) {                                                                    \
                    if (!a[t] || !a[t + 1] || !a[t + 2] || !a[t + 3])                                               \
                        return -1;                                                                                  \
                    s0 += leaf_values[t * width + LOWEST(a[t])];                                                    \
                    s1 += leaf_values[(t + 1) * width + LOWEST(a[t + 1])];                                          \
                    s2 += leaf_values[(t + 2) * width + LOWEST(a[t + 2])];                                          \
                    s3 += leaf_values[(t + 3) * width + LOWEST(a[t + 3])];                                          \
                }                                                                                                   \
                for (; t < trees; ++t) {                                                                            \
                    if (!a[t])                                                                                      \
                        return -1;                                                                                  \
                    s0 += leaf_values[t * width + LOWEST(a[t])];                                                    \
                }                                                                                                   \
                out[r] = (s0 + s1) + (s2 + s3);                                                                     \
            }                                                                                                       \
        }                                                                                                           \
        return 0;                                                                                                   \
    }

EVALUATE(td_forest_u32, uint32_t, __builtin_ctz)
EVALUATE(td_forest_u64, uint64_t, __builtin_ctzll)
