// The element math of the SGD, Adagrad, LAMB and NovoGrad ops, and of scale and axpby, written
// once for the CUDA functors (csrc/cuda) and the CPU loops (csrc/cpu), in float32. The
// pure-PyTorch reference is the same formulas in PyTorch ops (in src/amp_fused_ops/):
// reference/_optim.py (SGD, Adagrad), reference/_layerwise.py (LAMB, NovoGrad),
// reference/_lamb_stages.py (the LAMB stages) and reference/_ops.py (scale, axpby). The Adam ops
// are in adam_math.h.
//
// The flags are ordinary arguments: the CPU loops pass compile-time constants (template
// parameters of their functors), which the compiler folds after inlining, so each loop
// vectorizes without a branch; the CUDA functors pass their run-time flags.
//
// A weight decay of 0 adds no term anywhere (0 * inf would turn an infinite parameter into
// nan), as the reference does.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace amp_fused_ops {
namespace math {

// --- scale and axpby -------------------------------------------------------------------------

C10_HOST_DEVICE inline float scale_math(float x, float scale) { return x * scale; }

C10_HOST_DEVICE inline float axpby_math(float a, float x, float b, float y) {
  return a * x + b * y;
}

// --- SGD (Apex's multi_tensor_sgd) -----------------------------------------------------------

struct SgdScalars {
  float weight_decay;
  float momentum;
  float dampening;
  float lr;
  float scale;  // the gradients are multiplied by it first
};

// One SGD step on one element; p and (with momentum) buf updated in place:
//   g = grad * scale (+ wd * p unless wd_after_momentum)
//   buf = g on the first run, else momentum * buf + (1 - dampening) * g     (with momentum)
//   g = g + momentum * buf (nesterov) or buf                                (with momentum)
//   g += wd * p (wd_after_momentum);  p -= lr * g
// buf is neither read on the first run nor touched without momentum.
C10_HOST_DEVICE inline void sgd_math(const SgdScalars& s, bool momentum, bool nesterov,
                                     bool first_run, bool wd_after_momentum, float grad,
                                     float& p, float& buf) {
  const bool decay = s.weight_decay != 0.0f;
  float g = grad * s.scale;
  if (decay && !wd_after_momentum) {
    g = g + s.weight_decay * p;
  }
  if (momentum) {
    buf = first_run ? g : s.momentum * buf + (1.0f - s.dampening) * g;
    g = nesterov ? g + s.momentum * buf : buf;
  }
  if (decay && wd_after_momentum) {
    g = g + s.weight_decay * p;
  }
  p = p - s.lr * g;
}

// --- Adagrad (Apex's multi_tensor_adagrad) ---------------------------------------------------

struct AdagradScalars {
  float lr;
  float epsilon;
  float weight_decay;
};

// One Adagrad step on one element; p and the sum of squares h updated in place:
//   g = grad (+ wd * p in mode 0); h += g * g; p -= lr * (g / (sqrt(h) + eps) (+ wd * p in 1)).
C10_HOST_DEVICE inline void adagrad_math(const AdagradScalars& s, bool decoupled, float g,
                                         float& p, float& h) {
  const bool decay = s.weight_decay != 0.0f;
  if (decay && !decoupled) {
    g = g + s.weight_decay * p;
  }
  h = h + g * g;
  float update = g / (::sqrtf(h) + s.epsilon);
  if (decay && decoupled) {
    update = update + s.weight_decay * p;
  }
  p = p - s.lr * update;
}

// --- LAMB (Apex's multi_tensor_lamb, first pass) ---------------------------------------------

struct LambScalars {
  float beta1;
  float beta2;
  float beta3;            // 1 - beta1 with grad averaging, else 1
  float one_minus_beta2;  // 1 - beta2 in double on the host, then rounded (as the reference)
  float bc1;    // bias corrections 1 - beta**step, or 1 without them
  float bc2;
  float epsilon;
  float weight_decay;
};

// The moments (m, v in place) and the returned float32 update of one element, on the clipped
// gradient g; the trust ratio of the second pass scales it:
//   g (+ wd * p in mode 0); m = b1 m + b3 g; v = b2 v + (1 - b2) g g;
//   update = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd * p in mode 1)
C10_HOST_DEVICE inline float lamb_update_math(const LambScalars& s, bool decoupled, float g,
                                              float p, float& m, float& v) {
  const bool decay = s.weight_decay != 0.0f;
  if (decay && !decoupled) {
    g = g + s.weight_decay * p;
  }
  m = s.beta1 * m + s.beta3 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  float update = (m / s.bc1) / (::sqrtf(v / s.bc2) + s.epsilon);
  if (decay && decoupled) {
    update = update + s.weight_decay * p;
  }
  return update;
}

// The clipping divisor of the gradients: global_norm / max_norm when the global norm is
// larger, else 1 (a max_norm of 0 clips every nonzero norm: g / inf = 0, as Apex).
C10_HOST_DEVICE inline float lamb_clip_math(float global_norm, float max_norm) {
  return global_norm > max_norm ? global_norm / max_norm : 1.0f;
}

// --- LAMB stages (Apex's multi_tensor_lamb_stage1_cuda / multi_tensor_lamb_stage2_cuda) ------

struct LambStage1Scalars {
  float beta1;
  float beta2;
  float one_minus_beta1;  // 1 - beta1 in double on the host, then rounded (as the reference)
  float one_minus_beta2;
  float bc1;  // bias corrections 1 - beta**(step + 1)
  float bc2;
  float epsilon;
};

// Stage 1 on one element: the moments (m, v in place) and the returned update, with `clip`
// from lamb_clip_math and `decay` the tensor's weight decay:
//   g = grad / clip; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   update = (m / bc1) / (sqrt(v / bc2) + eps) + decay * p
C10_HOST_DEVICE inline float lamb_stage1_math(const LambStage1Scalars& s, float clip,
                                              float decay, float grad, float p, float& m,
                                              float& v) {
  const float g = grad / clip;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  const float update = (m / s.bc1) / (::sqrtf(v / s.bc2) + s.epsilon);
  return update + p * decay;
}

// The trust ratio of one tensor (LAMB's second pass and stage 2): param_norm / update_norm
// when both norms are nonzero and the ratio applies (use_nvlamb or weight_decay != 0), else 1.
C10_HOST_DEVICE inline float lamb_trust_ratio_math(bool use_ratio, float param_norm,
                                                   float update_norm) {
  return (use_ratio && param_norm != 0.0f && update_norm != 0.0f) ? param_norm / update_norm
                                                                  : 1.0f;
}

// Stage 2 on one element, with ratio = lr * lamb_trust_ratio_math(...): p - ratio * update.
C10_HOST_DEVICE inline float lamb_stage2_math(float p, float update, float ratio) {
  return p - update * ratio;
}

// --- NovoGrad (Apex's multi_tensor_novograd, second pass) ------------------------------------

struct NovoGradScalars {
  float beta1;
  float beta3;  // 1 - beta1 with grad averaging, else 1
  float bc1;
  float lr;
  float weight_decay;
};

// One NovoGrad step on one element, with denom = grad_norm / bc2 + eps of its tensor:
//   mode 0: m = b1 m + b3 (g / denom + wd p); p -= lr * m / bc1
//   mode 1: m = b1 m + b3 g;                   p -= lr * ((m / bc1) / denom + wd p)
C10_HOST_DEVICE inline void novograd_math(const NovoGradScalars& s, bool decoupled, float denom,
                                          float g, float& p, float& m) {
  const bool decay = s.weight_decay != 0.0f;
  float update;
  if (!decoupled) {
    float scaled = g / denom;
    if (decay) {
      scaled = scaled + s.weight_decay * p;
    }
    m = s.beta1 * m + s.beta3 * scaled;
    update = m / s.bc1;
  } else {
    m = s.beta1 * m + s.beta3 * g;
    update = m / s.bc1 / denom;
    if (decay) {
      update = update + s.weight_decay * p;
    }
  }
  p = p - s.lr * update;
}

}  // namespace math
}  // namespace amp_fused_ops
