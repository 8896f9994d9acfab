// The ATen headers the kernels and their launchers use, instead of <ATen/ATen.h>: that one
// declares every operator of ATen and about doubles the compile time of each translation unit
// (the CPU extension, the CUDA extension under nvcc and both emulated builds compile every
// unit from scratch). Tensor methods come with <ATen/core/Tensor.h>; each free function a
// source calls (at::empty, at::zeros, ...) has its own header below. Compiled for host and
// device.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
