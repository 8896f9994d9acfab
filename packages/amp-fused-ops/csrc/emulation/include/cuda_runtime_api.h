// Emulator stand-in for <cuda_runtime_api.h>.
#pragma once
#include "../amp_emu_runtime.h"
