// Emulator stand-in for <cuda_runtime.h>.
#pragma once
#include "../amp_emu_runtime.h"
