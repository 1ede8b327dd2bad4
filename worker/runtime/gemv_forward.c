/* cblas_sgemm for libmlx on a CPU: thin products skip OpenBLAS's sgemm.
 *
 * Why: OpenBLAS's sgemm packs both matrices into blocks before it
 * multiplies, so a one-row product (a lone request's decode step) copies
 * every weight matrix once per call and costs about what eight rows cost.
 * OpenBLAS forwards one-row calls to gemv itself only on ARM64, RISC-V and
 * POWER builds; mlx calls sgemm for every float32 matmul. So:
 *
 * - one row, or one column: OpenBLAS's sgemv, which reads the matrix once;
 * - 2 to THIN_KERNEL_ROWS rows times a matrix stored by its rows (x W^T,
 *   every linear layer's product): the kernel below, which reads the matrix
 *   once and keeps the rows in cache. Measured on an AMD EPYC against
 *   sgemm, 256x768 to 9728x2560, one thread each: 2-3x sgemm's speed at
 *   2-4 rows, 1.4-2x at 8, 1.1-1.5x at 16, 0.8-1.2x at 40. Where OpenBLAS
 *   runs several threads the kernel splits a large product among as many
 *   and takes up to THIN_KERNEL_ROWS_THREADED rows (2 threads each:
 *   1.7-3.3x at 2-4 rows, 0.65-2x at 8-16). x86-64 with AVX2 and FMA only
 *   (checked at run time; elsewhere the rule below serves);
 * - other products of up to THIN_ROWS rows: sgemv a row at a time (2 rows
 *   0.5-0.8x sgemm's time, 3 rows 0.6-0.8x, 4 rows 1.0-1.7x);
 * - the rest: sgemm.
 *
 * The kernel sums each output in the same order whatever the number of
 * rows, so a row of a 2-row product is bit for bit that row in a 16-row one.
 *
 * worker/runtime/cpu_backend.py compiles this file with the system's C
 * compiler, opens the result before OpenBLAS in the global symbol scope (so
 * libmlx's cblas_sgemm binds here) and hands it OpenBLAS's own functions
 * through lattice_gemv_init before mlx is imported.
 */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, THIN_ROWS = 3, THIN_KERNEL_ROWS = 16, THIN_KERNEL_ROWS_THREADED = 4 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static unsigned long long forwarded, in_kernel;
static int kernel_rows; /* the most rows the kernel takes; 0: it is off */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <pthread.h>
#define HAVE_KERNEL 1
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A tile's outputs: each one's 8 lanes summed, then its last k % 8 terms. */
AVX2 __attribute__((always_inline)) static inline void store(int mr, int nr, __m256 (*acc)[3], const float **x, const float **w, int k8,
                                                              int k, float alpha, float beta, float *c, int ldc) {
    for (int u = 0; u < mr; u++)
        for (int t = 0; t < nr; t++) {
            float r = hsum(acc[u][t]);
            for (int p = k8; p < k; p++) r = __builtin_fmaf(x[u][p], w[t][p], r);
            float *y = c + (long)u * ldc + t;
            /* BLAS leaves c unread when beta is 0 (mlx hands over an
             * uninitialised buffer). */
            *y = beta == 0.0f ? alpha * r : alpha * r + beta * *y;
        }
}

#define FMA3(s, xv)                              \
    s[0] = _mm256_fmadd_ps(xv, v0, s[0]);        \
    s[1] = _mm256_fmadd_ps(xv, v1, s[1]);        \
    s[2] = _mm256_fmadd_ps(xv, v2, s[2]);

/* c's rows i..i+mr, columns j..j+nr (mr <= rows, nr <= 3) from rows of a
 * and b, rows 4 or 2: up to 12 sums in registers, 3 of b's rows loaded once
 * per 8 columns of k for `rows` of a's. Tiles short of rows or columns
 * repeat their first one. Inlined with `rows` a constant, so the sums stay
 * in registers. */
AVX2 __attribute__((always_inline)) static inline void tile(const int rows, int mr, int nr, int k, float alpha, const float *a, int lda,
                                                             const float *b, int ldb, float beta, float *c, int ldc) {
    const float *x[4], *w[3];
    for (int u = 0; u < rows; u++) x[u] = a + (long)(u < mr ? u : 0) * lda;
    for (int t = 0; t < 3; t++) w[t] = b + (long)(t < nr ? t : 0) * ldb;
    __m256 z = _mm256_setzero_ps();
    __m256 s[4][3] = {{z, z, z}, {z, z, z}, {z, z, z}, {z, z, z}};
    int k8 = k & ~7;
    for (int p = 0; p < k8; p += 8) {
        __m256 v0 = _mm256_loadu_ps(w[0] + p), v1 = _mm256_loadu_ps(w[1] + p), v2 = _mm256_loadu_ps(w[2] + p);
        __m256 xv = _mm256_loadu_ps(x[0] + p);
        FMA3(s[0], xv)
        xv = _mm256_loadu_ps(x[1] + p);
        FMA3(s[1], xv)
        if (rows == 4) {
            xv = _mm256_loadu_ps(x[2] + p);
            FMA3(s[2], xv)
            xv = _mm256_loadu_ps(x[3] + p);
            FMA3(s[3], xv)
        }
    }
    store(mr, nr, s, x, w, k8, k, alpha, beta, c, ldc);
}

AVX2 static void tile4(int mr, int nr, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                       int ldc) {
    tile(4, mr, nr, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* The last one or two rows. */
AVX2 static void tile2(int mr, int nr, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c,
                       int ldc) {
    tile(2, mr, nr, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* c (m x n) = alpha a b^T + beta c, a (m x k) and b (n x k) stored by rows.
 * Column blocks outside, row tiles inside: each block of b is read from
 * memory once, while every row of a passes over it from cache. */
AVX2 static void rows_times_rows(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta,
                                 float *c, int ldc) {
    for (int j = 0; j < n; j += 3) {
        int nr = n - j < 3 ? n - j : 3;
        const float *bj = b + (long)j * ldb;
        int i = 0;
        for (; m - i >= 3; i += 4)
            tile4(m - i < 4 ? m - i : 4, nr, k, alpha, a + (long)i * lda, lda, bj, ldb, beta, c + (long)i * ldc + j, ldc);
        if (i < m) tile2(m - i, nr, k, alpha, a + (long)i * lda, lda, bj, ldb, beta, c + (long)i * ldc + j, ldc);
    }
}

/* The kernel's threads: with OpenBLAS's thread count, the columns (rows of
 * b) are split among as many threads, in blocks of 3, so every output is
 * computed as it would be by one thread. Products under THREADED_FROM
 * multiply-adds stay on the calling thread (waking the others costs more).
 * The helpers sleep on a condition variable between products rather than
 * spin: OpenBLAS's own threads spin, and the two pools must not fight over
 * the cores. */
enum { MAX_THREADS = 64, THREADED_FROM = 1 << 22 };
static int threads = 1;
static int helpers_started; /* helper threads made in this process (see fork_child) */
static struct {
    int parts, m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const float *a, *b;
    float *c;
} job;
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER; /* one threaded product at a time */
static pthread_cond_t job_ready = PTHREAD_COND_INITIALIZER, job_done = PTHREAD_COND_INITIALIZER;
static unsigned long generation;              /* products posted to the helpers so far */
static unsigned long start_generation[MAX_THREADS]; /* a helper's first look: the count when it was made */
static int pending;

static void part_of_job(int part, int parts) {
    int blocks = (job.n + 2) / 3;
    int lo = (int)((long)blocks * part / parts) * 3, hi = (int)((long)blocks * (part + 1) / parts) * 3;
    if (hi > job.n) hi = job.n;
    if (lo < hi)
        rows_times_rows(job.m, hi - lo, job.k, job.alpha, job.a, job.lda, job.b + (long)lo * job.ldb, job.ldb, job.beta, job.c + lo, job.ldc);
}

static void *helper(void *arg) {
    int part = (int)(long)arg;
    pthread_mutex_lock(&job_lock);
    /* Not the current count: the product it was made for may be posted
     * before this thread first runs. */
    unsigned long seen = start_generation[part];
    for (;;) {
        while (generation == seen) pthread_cond_wait(&job_ready, &job_lock);
        seen = generation;
        pthread_mutex_unlock(&job_lock);
        part_of_job(part, job.parts);
        pthread_mutex_lock(&job_lock);
        if (--pending == 0) pthread_cond_signal(&job_done);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers: it starts its own. */
static void fork_child(void) {
    helpers_started = 0;
    pthread_mutex_init(&job_lock, NULL);
    pthread_mutex_init(&caller_lock, NULL);
    pthread_cond_init(&job_ready, NULL);
    pthread_cond_init(&job_done, NULL);
}

static int start_helpers(void) {
    static int fork_handled;
    if (!fork_handled) {
        pthread_atfork(NULL, NULL, fork_child);
        fork_handled = 1;
    }
    while (helpers_started < threads - 1) {
        pthread_t t;
        /* Part numbers start at 1: the caller takes part 0. */
        start_generation[helpers_started + 1] = generation;
        if (pthread_create(&t, NULL, helper, (void *)(long)(helpers_started + 1)) != 0) break;
        pthread_detach(t);
        helpers_started++;
    }
    return helpers_started;
}

static void thin_product(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    if (threads < 2 || (long)m * n * k < THREADED_FROM || pthread_mutex_trylock(&caller_lock) != 0) {
        rows_times_rows(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    pthread_mutex_lock(&job_lock);
    int helpers = start_helpers();
    job.parts = helpers + 1, job.m = m, job.n = n, job.k = k, job.lda = lda, job.ldb = ldb, job.ldc = ldc;
    job.alpha = alpha, job.beta = beta, job.a = a, job.b = b, job.c = c;
    pending = helpers;
    generation++;
    pthread_cond_broadcast(&job_ready);
    pthread_mutex_unlock(&job_lock);
    part_of_job(0, helpers + 1);
    pthread_mutex_lock(&job_lock);
    while (pending > 0) pthread_cond_wait(&job_done, &job_lock);
    pthread_mutex_unlock(&job_lock);
    pthread_mutex_unlock(&caller_lock);
}
#endif

/* kernel_threads: 0 keeps the kernel off; otherwise the threads it may use
 * (OpenBLAS's count). */
void lattice_gemv_init(void *sgemm, void *sgemv, int kernel_threads) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
#ifdef HAVE_KERNEL
    __builtin_cpu_init();
    int usable = kernel_threads > 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    threads = kernel_threads < 1 ? 1 : kernel_threads > MAX_THREADS ? MAX_THREADS : kernel_threads;
    kernel_rows = !usable ? 0 : threads == 1 ? THIN_KERNEL_ROWS : THIN_KERNEL_ROWS_THREADED;
#else
    (void)kernel_threads;
#endif
}

/* sgemm calls not sent to sgemm so far, and those the kernel computed (for
 * tests and logs); the most rows the kernel takes (0: it is off). */
unsigned long long lattice_gemv_forwarded(void) { return forwarded; }
unsigned long long lattice_gemv_in_kernel(void) { return in_kernel; }
unsigned long long lattice_gemv_kernel_rows(void) { return (unsigned long long)kernel_rows; }

/* y (out) = alpha op(a) x (in) + beta y, where a is stored row-major as
 * out x in (NO_TRANS) or in x out (TRANS). */
static void gemv(int trans, int out, int in, float alpha, const float *a, int lda, const float *x, int incx, float beta, float *y,
                 int incy) {
    if (beta == 0.0f) {
        /* BLAS leaves y unread when beta is 0, and mlx hands over an
         * uninitialised buffer; some OpenBLAS versions scale y by beta
         * anyway, which would turn a stale NaN into a result. */
        for (int i = 0; i < out; i++) y[(long)i * incy] = 0.0f;
        beta = 1.0f;
    }
    if (trans == NO_TRANS)
        real_sgemv(ROW_MAJOR, NO_TRANS, out, in, alpha, a, lda, x, incx, beta, y, incy);
    else
        real_sgemv(ROW_MAJOR, TRANS, in, out, alpha, a, lda, x, incx, beta, y, incy);
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                 float beta, float *c, int ldc) {
    int plain = order == ROW_MAJOR && (ta == NO_TRANS || ta == TRANS) && (tb == NO_TRANS || tb == TRANS);
    if (plain && real_sgemv && m > 0 && n > 0 && k > 0) {
#ifdef HAVE_KERNEL
        if (m >= 2 && m <= kernel_rows && n > 1 && ta == NO_TRANS && tb == TRANS) {
            thin_product(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            forwarded++;
            in_kernel++;
            return;
        }
#endif
        if (m <= THIN_ROWS) {
            /* Row i of c (1 x n) = op(b)^T (n x k) times row i of op(a) (k). */
            int incx = ta == NO_TRANS ? 1 : lda;
            for (int i = 0; i < m; i++) {
                const float *x = ta == NO_TRANS ? a + (long)i * lda : a + i;
                gemv(tb == TRANS ? NO_TRANS : TRANS, n, k, alpha, b, ldb, x, incx, beta, c + (long)i * ldc, 1);
            }
            forwarded++;
            return;
        }
        if (n == 1) {
            /* c (m x 1) = op(a) (m x k) times the column of b (k). */
            gemv(ta, m, k, alpha, a, lda, b, tb == NO_TRANS ? ldb : 1, beta, c, ldc);
            forwarded++;
            return;
        }
    }
    real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
