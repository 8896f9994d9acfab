// The schemas of the two ops (the arguments of amp_fused_ops' multi_tensor_adam).
#pragma once

#define SCHEMA_ADAM \
  "adam_like(int chunk_size, Tensor noop_flag, Tensor(a!)[] grads, Tensor(b!)[] params, " \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, float beta1, float beta2, " \
    "float eps, int step, int mode, int bias_correction, float weight_decay) -> ()"
#define SCHEMA_EMPTY \
  "empty_body(int chunk_size, Tensor noop_flag, Tensor(a!)[] grads, Tensor(b!)[] params, " \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, float beta1, float beta2, " \
    "float eps, int step, int mode, int bias_correction, float weight_decay) -> ()"
