#!/usr/bin/env bash
# One pass over a GPU machine: build, test, benchmark and profile, every output into one folder.
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]     (default: $OUT, else benchmarks/out/gpu-run)
#
# For a machine lent for a short while: everything is prepared beforehand, each step has a time
# limit and the steps run in order of value, so whatever time there is gives the most figures.
# A failing step is logged and the next one runs; the exit status is that of the first failure.
# Needs a CUDA build of torch, nvcc and ninja (pytest for the tests); imports the packages from
# the source folders (docs/design.rst, "Testing CUDA code"). Steps:
#   env        nvidia-smi, torch and CUDA versions, the host CPU, `python -m amp_fused_ops info`
#   prebuilt   with GPU_RUN_WHEELS=<wheelhouse> (a carried dist/ with a prebuilt wheel for this
#              machine's torch): benchmarks/gpu_prebuilt_wheel.sh, the wheel installed without
#              a CUDA toolkit in reach, the time to the first FusedAdam step, its gpu tests
#   build      the CUDA extension for this GPU's architecture (the loader's just-in-time build)
#   norm_tests the gpu tests of the fused norms' kernels (both sets of kernels)
#   bench_norm FusedLayerNorm / FusedRMSNorm against torch, the resident and the per-row kernels
#              side by side: wall, device (CUDA graph replay) and host time per step
#   gpu_tests  every test marked gpu (GPU_RUN_TEST_PATHS: only these), in pytest-xdist workers
#              where installed (GPU_RUN_WORKERS, default 4)
#   benches    bench_norm_host, with and without grad, and profile_norm_step (a norm step's
#              host cost, and where it goes), bench_multi_tensor_adam (wall and device time), bench_optimizer_overhead
#              (wall and host time), bench_norm with memory_efficient (bfloat16; in
#              OUT_DIR/memory_efficient), bench_o2_step_host (amp O2's FusedAdam step, host
#              time), bench_amp_step and bench_o1_ops (O1's host cost per op) on cuda,
#              profile_o1_step (where an O1 step's host time goes against autocast's)
#   profile    nsys / ncu of one norm step per set of kernels, where the tools exist
#
# One command may run for 10 minutes at most where the machine is lent, less than all of the
# steps' limits: GPU_RUN_FROM=<step> skips the steps before that one (env always runs), so a
# second call goes on where the first was stopped; GPU_RUN_SKIP="<step> ..." skips those steps.
# The compiled kernels stay in benchmarks/out/kernel-cache (not in OUT_DIR, which each call gets
# empty), so a second call on the same machine does not compile them again.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-${OUT:-benchmarks/out/gpu-run}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PYTHONPATH=$(ls -d "$PWD"/packages/*/src | paste -sd: -)
export PYTHONPATH
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export AMP_FUSED_OPS_CACHE=${AMP_FUSED_OPS_CACHE:-$PWD/benchmarks/out/kernel-cache}
STATUS=0
FROM=${GPU_RUN_FROM:-}
# Images whose Python is only `python3` (the steps call `python`).
if ! command -v python > /dev/null && command -v python3 > /dev/null; then
    mkdir -p "$PWD/benchmarks/out/bin"
    ln -sf "$(command -v python3)" "$PWD/benchmarks/out/bin/python"
    export PATH=$PWD/benchmarks/out/bin:$PATH
fi
# The gpu tests in several pytest-xdist workers where it is installed (one GPU, shared: the
# largest norm tests take up to 27 GiB each, and 8 workers ran an H200 out of memory).
XDIST=()
if python -c "import xdist" 2> /dev/null; then XDIST=(-n "${GPU_RUN_WORKERS:-4}"); fi

# step <name> <seconds> <command>...: run it with a time limit, its output into <name>.log.
step() {
    local name=$1 limit=$2 start=$SECONDS rc=0
    shift 2
    if [ -n "$FROM" ] && [ "$name" != env ]; then
        if [ "$name" != "$FROM" ]; then
            echo "gpu_run: $name skipped (GPU_RUN_FROM=$GPU_RUN_FROM)"
            return 0
        fi
        FROM=""
    fi
    if [[ " ${GPU_RUN_SKIP:-} " == *" $name "* ]]; then
        echo "gpu_run: $name skipped (GPU_RUN_SKIP)"
        return 0
    fi
    echo "gpu_run: $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
    echo "$name rc=$rc $((SECONDS - start)) s" | tee -a "$OUT_DIR/steps.txt"
    if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi
    tail -n 5 "$OUT_DIR/$name.log"
}

ARCH=$(python -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${ARCH:-9.0}}

step env 60 bash -c 'nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version; lscpu | grep -i "model name\|flags"; python -m amp_fused_ops info'
if [ -n "${GPU_RUN_WHEELS:-}" ]; then
    step prebuilt 200 bash benchmarks/gpu_prebuilt_wheel.sh "$GPU_RUN_WHEELS" "$OUT_DIR"
fi
step build 300 python -m amp_fused_ops build cuda
step norm_tests 180 python -m pytest -q -m gpu -p no:cacheprovider "${XDIST[@]}" \
    packages/amp-fused-ops/tests/test_contract_norm_ops.py \
    packages/amp-fused-ops/tests/test_normalization_cuda.py
step bench_norm 240 python benchmarks/bench_norm.py --device cuda \
    --hidden 512 1024 2048 4096 8192 16384 --dtypes bfloat16 float16 float32 \
    --rounds 2 --iters 30 --out-dir "$OUT_DIR"
# shellcheck disable=SC2086 # GPU_RUN_TEST_PATHS: paths (or node ids) separated by spaces
step gpu_tests 300 python -m pytest -q -m gpu -p no:cacheprovider "${XDIST[@]}" --maxfail=20 \
    ${GPU_RUN_TEST_PATHS:-packages tests}
step bench_norm_host 90 python benchmarks/bench_norm_host.py --device cuda --out-dir "$OUT_DIR"
step bench_norm_host_no_grad 60 python benchmarks/bench_norm_host.py --device cuda --no-grad \
    --out-dir "$OUT_DIR"
step profile_norm 90 python benchmarks/profile_norm_step.py --device cuda --hidden 1024
step bench_adam 150 python benchmarks/bench_multi_tensor_adam.py --device cuda --out-dir "$OUT_DIR"
step bench_overhead 120 python benchmarks/bench_optimizer_overhead.py --device cuda \
    --out-dir "$OUT_DIR"
step bench_norm_me 120 python benchmarks/bench_norm.py --device cuda --memory-efficient \
    --hidden 4096 12288 16384 --dtypes bfloat16 --rounds 2 --iters 30 \
    --out-dir "$OUT_DIR/memory_efficient"
step bench_o2_host 90 python benchmarks/bench_o2_step_host.py --device cuda --out-dir "$OUT_DIR"
step bench_amp_step 200 python benchmarks/bench_amp_step.py --device cuda --out-dir "$OUT_DIR"
step bench_o1_ops 90 python benchmarks/bench_o1_ops.py --device cuda --out-dir "$OUT_DIR"
step profile_o1_step 120 python benchmarks/profile_o1_step.py --device cuda --half-dtype float16

PROFILE='
import os, sys, torch
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm
os.environ["AMP_FUSED_OPS_NORM_KERNELS"] = sys.argv[1]
hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
cls = FusedRMSNorm if len(sys.argv) > 3 and sys.argv[3] == "rms" else FusedLayerNorm
norm = cls(hidden).cuda().bfloat16()
x = torch.randn(16384, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
for _ in range(5):
    torch.autograd.grad(norm(x), [x, *norm.parameters()], dy)
torch.cuda.synchronize()
'
for kernels in resident per_row; do
    if command -v nsys > /dev/null; then
        step "nsys_$kernels" 120 nsys profile --stats=true -o "$OUT_DIR/nsys_$kernels" \
            python -c "$PROFILE" "$kernels"
    fi
    if command -v ncu > /dev/null; then
        step "ncu_$kernels" 180 ncu --clock-control none --kernel-name regex:norm_ --launch-skip 8 --launch-count 4 \
            --set full -o "$OUT_DIR/ncu_$kernels" python -c "$PROFILE" "$kernels"
    fi
done
# Rows of 16384: the backward's parameter-gradient sums in shared memory (resident) or by the
# column kernel (resident_column), speed of light and memory only.
if command -v ncu > /dev/null; then
    for kernels in resident resident_column; do
        step "ncu_16384_$kernels" 120 ncu --clock-control none --kernel-name regex:norm_ --launch-skip 8 \
            --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section Occupancy -o "$OUT_DIR/ncu_16384_$kernels" python -c "$PROFILE" "$kernels" 16384
    done
fi
# RMSNorm (no bias) at 4096: the kernels compiled without a bias (resident) against those for a
# bias with the bias skipped at run time (resident_generic): registers, occupancy, throughput.
if command -v ncu > /dev/null; then
    for kernels in resident resident_generic; do
        step "ncu_rms_$kernels" 120 ncu --clock-control none --kernel-name regex:norm_ --launch-skip 8 \
            --launch-count 4 --section SpeedOfLight --section Occupancy --section LaunchStats \
            -o "$OUT_DIR/ncu_rms_$kernels" python -c "$PROFILE" "$kernels" 4096 rms
    done
fi
# The prebuilt check's virtualenv: large, and made again on the next machine.
rm -rf "$OUT_DIR/prebuilt-venv"
if [ -n "$FROM" ]; then
    echo "gpu_run: GPU_RUN_FROM=$GPU_RUN_FROM names no step; nothing ran" >&2
    STATUS=2
fi
echo "gpu_run: done, status $STATUS; outputs in $OUT_DIR"
exit "$STATUS"
