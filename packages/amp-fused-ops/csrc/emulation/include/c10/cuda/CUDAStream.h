// Emulator stand-in for <c10/cuda/CUDAStream.h>.
#pragma once
#include <ATen/cuda/CUDAContext.h>
