/* The row Adam's step over whole blocks of rows, reading each row's gradient where it landed.
 *
 * The block Adam (engine/block_row_adam.py) steps the blocks a step touched with torch's fused Adam kernel, which
 * needs each block's gradient as one contiguous tensor: rows that routing left out of a block get zeros, so most
 * blocks are first assembled in an accumulator. This kernel does the same step without that copy: a row's gradient
 * is read where it lies (the step's one landed gradient, or the accumulator where a row was written) and a row with
 * none is stepped with a zero gradient, in the same pass that reads and writes the weights and moments.
 *
 * The arithmetic is torch's fused CPU Adam kernel's, operation for operation (torch 2.x, its vectorized path), so the
 * results are bit for bit those of the torch path: every operation below is one IEEE single-precision operation, the
 * first moment's update is one fused multiply-add (fmaf), and the file is compiled with contraction off so the
 * compiler fuses nothing else. The loader (engine/native_row_adam.py) checks that equality on the machine before it
 * uses the kernel, and hands it only blocks whose size torch's kernel steps without its scalar tail.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

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

/* One row, in torch's order of operations, from the gradients `gi_value` (k: the block's constants). Options are
 * applied as operations that leave a value unchanged when off (a clamp to ±infinity, a division by 1, a product by 1),
 * which give the same bits as skipping them and keep the loop free of branches, so it vectorizes. Coupled L2 and the
 * lerp's form are literal constants of each loop (L2, SMALL): a choice the vectorizer cannot blend (and fmaf(w, 0, g)
 * is not g for an infinite weight). */
#define ADAM_ROW(gi_value, L2, SMALL)                                                                             \
    for (int64_t i = 0; i < width; i++) {                                                                         \
        float gi = (gi_value);                                                                                    \
        gi = gi < k.lo ? k.lo : (gi > k.hi ? k.hi : gi); /* a NaN gradient stays NaN, as clamp_ leaves it */     \
        float w = p[i] * k.decay;                                                                                 \
        gi = (gi / k.grad_scale) * k.sign;                                                                        \
        if (L2) gi = fmaf(w, k.l2, gi);                                                                           \
        float mi = m[i];                                                                                          \
        mi = fmaf(k.coeff, gi - mi, (SMALL) ? mi : gi);                                                           \
        float vi = fmaf(k.one_minus_beta2 * gi, gi, v[i] * k.beta2);                                             \
        float denom = sqrtf(vi) / k.bias2_sqrt + k.eps;                                                          \
        m[i] = mi;                                                                                                \
        v[i] = vi;                                                                                                \
        p[i] = w + (k.neg_step_size * mi) / denom;                                                               \
    }

#define ADAM_ROW_FORMS(gi_value)                                                                                  \
    if (k.l2_on) {                                                                                                \
        if (k.lerp_small) ADAM_ROW(gi_value, 1, 1) else ADAM_ROW(gi_value, 1, 0)                                  \
    } else {                                                                                                      \
        if (k.lerp_small) ADAM_ROW(gi_value, 0, 1) else ADAM_ROW(gi_value, 0, 0)                                  \
    }

/* One row with a gradient, and one without (stepped from zeros, what an assembled block holds there). The constants
 * are copied into a local: a store through a float pointer could otherwise change a field of *c, and the compiler
 * would reload them at every element instead of vectorizing. */
static void adam_row(float* restrict p, float* restrict m, float* restrict v, const float* restrict g, int64_t width,
                     const Consts* c) {
    const Consts k = *c;
    ADAM_ROW_FORMS(g[i])
}

static void adam_zero_row(float* restrict p, float* restrict m, float* restrict v, int64_t width, const Consts* c) {
    const Consts k = *c;
    ADAM_ROW_FORMS(0.0f)
}

/* Steps `num_blocks` blocks (sorted ids in `blocks`) of matrices [N, width] stored row-major.
 *
 * hyper: 5 doubles per block (lr, beta1, weight decay, eps, gradient divisor), as the torch path's kernel call gets
 *     them. beta2, step, decoupled, maximize: the step's; clamp, bound: value clipping to [-bound, bound].
 * Gradients, one of two layouts:
 *   - kept (written == NULL): grad is [num_grad_rows, width] for the sorted rows `grad_rows`;
 *   - accumulator (written != NULL): grad is [N, width], a row's gradient valid where written[row] != 0.
 * Returns the kept rows read (kept layout; the caller checks every one was), or 0.
 */
int64_t lo_row_adam_blocks(float* param, float* exp_avg, float* exp_avg_sq, int64_t width, int64_t block_rows,
                           const int64_t* blocks, int64_t num_blocks, const double* hyper, double beta2, int64_t step,
                           int decoupled, int maximize, int clamp, float bound, const float* grad,
                           const int64_t* grad_rows, int64_t num_grad_rows, const uint8_t* written) {
    int64_t next = 0; /* the first kept row not yet passed */
    int64_t read = 0;
    for (int64_t k = 0; k < num_blocks; k++) {
        Consts c = block_consts(hyper + 5 * k, beta2, step, decoupled, maximize, clamp, bound);
        int64_t first = blocks[k] * block_rows;
        for (int64_t row = first; row < first + block_rows; row++) {
            size_t at = (size_t)row * (size_t)width;
            const float* g = NULL;
            if (written == NULL) {
                while (next < num_grad_rows && grad_rows[next] < row) next++;
                if (next < num_grad_rows && grad_rows[next] == row) {
                    g = grad + (size_t)next * (size_t)width;
                    read++;
                }
            } else if (written[row]) {
                g = grad + at;
            }
            if (g != NULL) adam_row(param + at, exp_avg + at, exp_avg_sq + at, g, width, &c);
            else adam_zero_row(param + at, exp_avg + at, exp_avg_sq + at, width, &c);
        }
    }
    return read;
}
