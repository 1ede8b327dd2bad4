/* cblas_sgemm for libmlx on a CPU: a product with at most THIN_ROWS rows,
 * or with one column, goes to OpenBLAS's sgemv (a row at a time), everything
 * else to its sgemm.
 *
 * Why: OpenBLAS's sgemm packs both matrices into blocks before it
 * multiplies, so a one-row product (a lone request's decode step) copies
 * every weight matrix once per call and costs about what eight rows cost;
 * sgemv reads the matrix once. Row by row, sgemv stays ahead up to three
 * rows (measured on an AMD EPYC, 256x768 to 9728x2560: 2 rows 0.5-0.8x
 * sgemm's time, 3 rows 0.6-0.8x, 4 rows 1.0-1.7x). OpenBLAS forwards
 * one-row calls itself only on ARM64, RISC-V and POWER builds; mlx calls
 * sgemm for every float32 matmul.
 *
 * worker/runtime/cpu_backend.py compiles this file with the system's C
 * compiler, opens the result before OpenBLAS in the global symbol scope (so
 * libmlx's cblas_sgemm binds here) and hands it OpenBLAS's own functions
 * through lattice_gemv_init before mlx is imported.
 */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, THIN_ROWS = 3 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static unsigned long long forwarded;

void lattice_gemv_init(void *sgemm, void *sgemv) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
}

/* sgemm calls sent to sgemv so far (for tests and logs). */
unsigned long long lattice_gemv_forwarded(void) { return forwarded; }

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
