/* The row Adam's step over whole blocks of rows, reading each row's gradient where it landed.
 *
 * The block Adam (engine/rows/block_row_adam.py) steps the blocks a step touched with torch's fused Adam kernel, which
 * needs each block's gradient as one contiguous tensor: rows that routing left out of a block get zeros, so most
 * blocks are first assembled in an accumulator. This kernel does the same step without that copy: a row's gradient
 * is read where it lies (the step's one landed gradient, or the accumulator where a row was written) and a row with
 * none is stepped with a zero gradient, in the same pass that reads and writes the weights and moments.
 *
 * The arithmetic is torch's fused CPU Adam kernel's, operation for operation (torch 2.x, its vectorized path), so the
 * results are bit for bit those of the torch path: every operation below is one IEEE single-precision operation, the
 * first moment's update is one fused multiply-add (fmaf), and the file is compiled with contraction off so the
 * compiler fuses nothing else. The loader (engine/rows/native_row_adam.py) checks that equality on the machine before it
 * uses the kernel, and hands it only blocks whose size torch's kernel steps without its scalar tail.
 */

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* One block's constants, as torch's kernel derives them from its double hyper-parameters and narrows them. */
typedef struct {
    float lo, hi;         /* value clipping's bounds (±infinity: none) */
    float decay;          /* AdamW: the weight's factor 1 - lr*wd (1: none) */
    float grad_scale;     /* the gradient's divisor (1: none) */
    float sign;           /* -1 to maximize, else 1 */
    int l2_on;            /* Adam's coupled L2: wd times the weight added to the gradient */
    float l2;
    float coeff;          /* the first moment's lerp weight (1 - beta1, or its complement when not below 0.5) */
    int lerp_small;       /* |1 - beta1| < 0.5: the lerp starts from the moment, else from the gradient */
    float beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
} Consts;

static Consts block_consts(const double* hyper, double beta2, int64_t step, int decoupled, int maximize,
                           int clamp, float bound) {
    /* hyper: lr, beta1, weight_decay, eps, grad_scale (the torch path's kernel call's, per block) */
    double lr = hyper[0], beta1 = hyper[1], weight_decay = hyper[2], eps = hyper[3];
    double bias1 = 1.0 - pow(beta1, (double)step);
    double bias2 = 1.0 - pow(beta2, (double)step);
    double step_size = lr / bias1;
    Consts c;
    float weight = (float)(1.0 - beta1);
    c.lo = clamp ? -bound : -INFINITY;
    c.hi = clamp ? bound : INFINITY;
    c.decay = weight_decay != 0.0 && decoupled ? (float)(1.0 - lr * weight_decay) : 1.0f;
    c.grad_scale = (float)hyper[4];
    c.sign = maximize ? -1.0f : 1.0f;
    c.l2_on = weight_decay != 0.0 && !decoupled;
    c.l2 = (float)weight_decay;
    c.lerp_small = fabsf(weight) < 0.5f;
    c.coeff = c.lerp_small ? weight : weight - 1.0f;
    c.beta2 = (float)beta2;
    c.one_minus_beta2 = (float)(1.0 - beta2);
    c.bias2_sqrt = (float)sqrt(bias2);
    c.eps = (float)eps;
    c.neg_step_size = (float)(-step_size);
    return c;
}

/* A float rounded to bfloat16 to nearest, ties to even, as torch rounds a copy into a bf16 tensor (a NaN becomes a
 * quiet NaN: its payload may differ from torch's, which differs between its own scalar and vector code). */
static inline uint16_t bf16_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint16_t rounded = (uint16_t)((bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16);
    return x != x ? (uint16_t)0x7FC0u : rounded;
}

/* One row, in torch's order of operations, from the gradients `gi_value` (k: the block's constants). Options are
 * applied as operations that leave a value unchanged when off (a clamp to ±infinity, a product by 1), which give the
 * same bits as skipping them and keep the loop free of branches, so it vectorizes. Coupled L2, the lerp's form, the
 * bf16 mirror and the gradient's divisor are literal constants of each loop (L2, SMALL, MIRROR, SCALED): choices the
 * vectorizer cannot blend (fmaf(w, 0, g) is not g for an infinite weight), or a division that costs as much as the
 * rest of the element when the divisor is 1 (x / 1 is x, so skipping it changes no bit). */
#define ADAM_ROW(gi_value, L2, SMALL, MIRROR, SCALED)                                                             \
    for (int64_t i = 0; i < width; i++) {                                                                         \
        float gi = (gi_value);                                                                                    \
        gi = gi < k.lo ? k.lo : (gi > k.hi ? k.hi : gi); /* a NaN gradient stays NaN, as clamp_ leaves it */     \
        float w = p[i] * k.decay;                                                                                 \
        if (SCALED) gi = gi / k.grad_scale;                                                                       \
        gi = gi * k.sign;                                                                                         \
        if (L2) gi = fmaf(w, k.l2, gi);                                                                           \
        float mi = m[i];                                                                                          \
        mi = fmaf(k.coeff, gi - mi, (SMALL) ? mi : gi);                                                           \
        float vi = fmaf(k.one_minus_beta2 * gi, gi, v[i] * k.beta2);                                             \
        float denom = sqrtf(vi) / k.bias2_sqrt + k.eps;                                                          \
        m[i] = mi;                                                                                                \
        v[i] = vi;                                                                                                \
        w = w + (k.neg_step_size * mi) / denom;                                                                  \
        p[i] = w;                                                                                                 \
        if (MIRROR) mirror[i] = bf16_of(w);                                                                       \
    }

#define ADAM_ROW_SCALED(gi_value, L2, SMALL, MIRROR)                                                              \
    if (k.grad_scale != 1.0f) ADAM_ROW(gi_value, L2, SMALL, MIRROR, 1) else ADAM_ROW(gi_value, L2, SMALL, MIRROR, 0)

#define ADAM_ROW_MIRRORED(gi_value, L2, SMALL)                                                                    \
    if (mirror != NULL) ADAM_ROW_SCALED(gi_value, L2, SMALL, 1) else ADAM_ROW_SCALED(gi_value, L2, SMALL, 0)

#define ADAM_ROW_FORMS(gi_value)                                                                                  \
    if (k.l2_on) {                                                                                                \
        if (k.lerp_small) ADAM_ROW_MIRRORED(gi_value, 1, 1) else ADAM_ROW_MIRRORED(gi_value, 1, 0)                \
    } else {                                                                                                      \
        if (k.lerp_small) ADAM_ROW_MIRRORED(gi_value, 0, 1) else ADAM_ROW_MIRRORED(gi_value, 0, 0)                \
    }

/* One row with a gradient, and one without (stepped from zeros, what an assembled block holds there); `mirror`, when
 * not NULL, receives the row's new weights in bf16. The constants are copied into a local: a store through a float
 * pointer could otherwise change a field of *c, and the compiler would reload them at every element instead of
 * vectorizing. */
static void adam_row(float* restrict p, float* restrict m, float* restrict v, const float* restrict g,
                     uint16_t* restrict mirror, int64_t width, const Consts* c) {
    const Consts k = *c;
    ADAM_ROW_FORMS(g[i])
}

static void adam_zero_row(float* restrict p, float* restrict m, float* restrict v, uint16_t* restrict mirror,
                          int64_t width, const Consts* c) {
    const Consts k = *c;
    ADAM_ROW_FORMS(0.0f)
}

/* What one call steps, shared by the threads that split its blocks. */
typedef struct {
    float *param, *exp_avg, *exp_avg_sq;
    uint16_t* mirror;
    int64_t width, block_rows;
    const int64_t* blocks;
    const double* hyper;
    double beta2;
    int64_t step;
    int decoupled, maximize, clamp;
    float bound;
    const float* grad;
    const int64_t* grad_rows;
    int64_t num_grad_rows;
    const uint8_t* written;
} Call;

typedef struct {
    const Call* call;
    int64_t begin, end; /* the blocks [begin, end) of the call's list */
    int64_t read;       /* kept rows read */
} Share;

/* The first of the sorted `rows` not below `row`. */
static int64_t first_at_or_after(const int64_t* rows, int64_t count, int64_t row) {
    int64_t lo = 0, hi = count;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (rows[mid] < row) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void* step_share(void* arg) {
    Share* share = (Share*)arg;
    const Call* c = share->call;
    int64_t next = 0; /* the first kept row not yet passed */
    if (c->written == NULL && share->begin < share->end)
        next = first_at_or_after(c->grad_rows, c->num_grad_rows, c->blocks[share->begin] * c->block_rows);
    for (int64_t k = share->begin; k < share->end; k++) {
        Consts consts = block_consts(c->hyper + 5 * k, c->beta2, c->step, c->decoupled, c->maximize, c->clamp,
                                     c->bound);
        int64_t first = c->blocks[k] * c->block_rows;
        for (int64_t row = first; row < first + c->block_rows; row++) {
            size_t at = (size_t)row * (size_t)c->width;
            const float* g = NULL;
            if (c->written == NULL) {
                while (next < c->num_grad_rows && c->grad_rows[next] < row) next++;
                if (next < c->num_grad_rows && c->grad_rows[next] == row) {
                    g = c->grad + (size_t)next * (size_t)c->width;
                    share->read++;
                }
            } else if (c->written[row]) {
                g = c->grad + at;
            }
            uint16_t* mirror = c->mirror == NULL ? NULL : c->mirror + at;
            if (g != NULL) adam_row(c->param + at, c->exp_avg + at, c->exp_avg_sq + at, g, mirror, c->width, &consts);
            else adam_zero_row(c->param + at, c->exp_avg + at, c->exp_avg_sq + at, mirror, c->width, &consts);
        }
    }
    return NULL;
}

#define MAX_THREADS 64

/* Steps `num_blocks` blocks (sorted ids in `blocks`) of matrices [N, width] stored row-major.
 *
 * hyper: 5 doubles per block (lr, beta1, weight decay, eps, gradient divisor), as the torch path's kernel call gets
 *     them. beta2, step, decoupled, maximize: the step's; clamp, bound: value clipping to [-bound, bound].
 * Gradients, one of two layouts:
 *   - kept (written == NULL): grad is [num_grad_rows, width] for the sorted rows `grad_rows`;
 *   - accumulator (written != NULL): grad is [N, width], a row's gradient valid where written[row] != 0.
 * mirror: NULL, or a bf16 [N, width] copy of the matrix whose stepped rows are rewritten from the new weights.
 * threads: how many threads split the blocks (the calling one among them; each element's result does not depend on
 *     which thread computes it). Returns the kept rows read (kept layout; the caller checks every one was), or 0.
 */
int64_t lo_row_adam_blocks(float* param, float* exp_avg, float* exp_avg_sq, int64_t width, int64_t block_rows,
                           const int64_t* blocks, int64_t num_blocks, const double* hyper, double beta2, int64_t step,
                           int decoupled, int maximize, int clamp, float bound, const float* grad,
                           const int64_t* grad_rows, int64_t num_grad_rows, const uint8_t* written, uint16_t* mirror,
                           int threads) {
    Call call = {param, exp_avg, exp_avg_sq, mirror, width, block_rows, blocks, hyper, beta2, step, decoupled,
                 maximize, clamp, bound, grad, grad_rows, num_grad_rows, written};
    if (threads > num_blocks) threads = (int)num_blocks;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    Share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        shares[t].call = &call;
        shares[t].begin = num_blocks * t / threads;
        shares[t].end = num_blocks * (t + 1) / threads;
        shares[t].read = 0;
    }
    /* The other threads' shares first, then the calling thread's; a share whose thread cannot be started is stepped
     * by the calling thread too, so every block is stepped once whatever the system allows, and no thread outlives
     * the call (all are joined). */
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, step_share, &shares[t]) == 0;
    step_share(&shares[0]);
    int64_t read = shares[0].read;
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else step_share(&shares[t]);
        read += shares[t].read;
    }
    return read;
}
