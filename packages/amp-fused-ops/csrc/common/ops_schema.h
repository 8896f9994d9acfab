// The dispatcher namespace of the multi-tensor ops, for the kernels' registrations.
//
// The schemas of the ops are defined in Python (src/amp_fused_ops/ops/_registry.py, the op
// registry), before any extension is loaded; the C++ CPU extension and the CUDA extension
// (and the emulation build of the CUDA sources) only register kernels, with
// TORCH_LIBRARY_IMPL, under the names the registry defines. A schema has no list of tensor
// lists, so each op takes Apex's lists as separate arguments, named after Apex's layouts.
#pragma once

// The namespace of the ops: torch.ops.amp_fused_ops. The emulation build, whose "CUDA" kernels
// run on the CPU, registers them under a namespace of its own (csrc/emulation/amp_emu.h), so
// that they never replace the C++ CPU kernels in a process that loads both.
#ifndef AMP_FUSED_OPS_NS
#define AMP_FUSED_OPS_NS amp_fused_ops
#endif
#define AMP_FUSED_OPS_STRINGIFY_(x) #x
#define AMP_FUSED_OPS_STRINGIFY(x) AMP_FUSED_OPS_STRINGIFY_(x)
#define AMP_FUSED_OPS_NS_NAME AMP_FUSED_OPS_STRINGIFY(AMP_FUSED_OPS_NS)
