#!/usr/bin/env bash
# The amp-fused-ops wheel with prebuilt kernels on a GPU machine, as a user without a CUDA
# toolkit gets it (benchmarks/gpu_run.sh runs this as its `prebuilt` step).
#
#   bash benchmarks/gpu_prebuilt_wheel.sh WHEELHOUSE OUT_DIR
#
# WHEELHOUSE holds the wheels of `nox -s build` and the wheel of `nox -s wheel_prebuilt` built
# with this machine's torch release among its CUDA releases (e.g. `AMP_PREBUILT_TORCH=2.11.0
# AMP_PREBUILT_CUDA_TORCH=2.11.0 AMP_PREBUILT_CUDA_ARCHS=9.0 nox -s wheel_prebuilt` for
# torch 2.11.0+cu130 on an H100 or H200; the session copies it into dist/). In a fresh
# virtualenv that sees this machine's torch (--system-site-packages), with no nvcc on PATH,
# CUDA_HOME naming an empty folder and an empty kernel cache:
#   1. `pip install --no-index --find-links WHEELHOUSE amp-fused-ops amp-core amp-optimizers`,
#      then one FusedAdam step on the GPU in a new process: the time from the start of the
#      install to the end of that step, as a user waits for it;
#   2. .ci/wheel_checks.py cuda-module: the wheel's CUDA module is the one loaded;
#   3. the gpu cases of the tests in .ci/prebuilt_tests.txt, with .ci/prebuilt_wheel_plugin.py
#      (every test fails unless the CPU and CUDA modules are the wheel's);
#   4. the kernel cache is still empty: nothing was compiled.
# DEVICE=cpu runs step 1 on the CPU (a dry run of the install on a machine without a GPU; step 2
# then fails for want of a CUDA build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELHOUSE=$(cd "$1" && pwd)
OUT_DIR=$(mkdir -p "$2" && cd "$2" && pwd)
VENV=$OUT_DIR/prebuilt-venv
CACHE=$OUT_DIR/prebuilt-empty-cache
NO_TOOLKIT=$OUT_DIR/prebuilt-no-cuda-toolkit
rm -rf "$VENV" "$CACHE" "$NO_TOOLKIT"
mkdir -p "$CACHE" "$NO_TOOLKIT"
python -m venv --system-site-packages "$VENV"
# Where this python is itself a virtualenv (a machine image's torch often lives in one), the new
# virtualenv's system site-packages are the base interpreter's, which lack torch: add this
# python's own site-packages after the new virtualenv's.
python - "$VENV" <<'EOF'
import pathlib, subprocess, sys, sysconfig
if sys.prefix != sys.base_prefix:
    purelib = subprocess.check_output(
        [f"{sys.argv[1]}/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
    ).strip()
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    pathlib.Path(purelib, "_outer_site_packages.pth").write_text("\n".join(ours) + "\n")
EOF
"$VENV/bin/python" -c "import torch" || { echo "torch is not importable in $VENV" >&2; exit 1; }

# PATH without the folders that hold an nvcc; CUDA_HOME set to an empty folder, so that the
# loader's last resort (/usr/local/cuda) is not looked at either.
PATH_NO_NVCC=$(tr ':' '\n' <<< "$PATH" | while read -r dir; do
    [ -n "$dir" ] && [ ! -x "$dir/nvcc" ] && echo "$dir"
done | paste -sd: -)
user() {
    env -u PYTHONPATH PATH="$PATH_NO_NVCC" CUDA_HOME="$NO_TOOLKIT" AMP_FUSED_OPS_CACHE="$CACHE" "$@"
}
if user bash -c 'command -v nvcc' > /dev/null; then
    echo "nvcc is still reachable: $(user bash -c 'command -v nvcc')" >&2
    exit 1
fi

FIRST_STEP='
import sys, torch
from amp_optimizers import FusedAdam
params = [torch.nn.Parameter(torch.randn(1024, 1024, device=sys.argv[1])) for _ in range(4)]
for p in params:
    p.grad = torch.randn_like(p)
FusedAdam(params, lr=1e-3).step()
if params[0].is_cuda:
    torch.cuda.synchronize()
'
start=$(date +%s.%N)
user "$VENV/bin/python" -m pip install --quiet --no-deps --no-index --find-links "$WHEELHOUSE" \
    amp-fused-ops amp-core amp-optimizers
installed=$(date +%s.%N)
user "$VENV/bin/python" -c "$FIRST_STEP" "${DEVICE:-cuda}"
done_at=$(date +%s.%N)
python - "$start" "$installed" "$done_at" <<'EOF'
import sys
start, installed, done = map(float, sys.argv[1:])
print(f"pip install {installed - start:.1f} s, first FusedAdam step process {done - installed:.1f} s:"
      f" {done - start:.1f} s from pip install to the end of the first step")
EOF
user "$VENV/bin/pip" list 2>/dev/null | grep -i "^amp[-_]" || true

user "$VENV/bin/python" .ci/wheel_checks.py cuda-module "$VENV"
mapfile -t TESTS < .ci/prebuilt_tests.txt
XDIST=()
if user "$VENV/bin/python" -c "import xdist" 2> /dev/null; then XDIST=(-n "${GPU_RUN_WORKERS:-4}"); fi
user env PYTHONPATH="$PWD/.ci" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    -p prebuilt_wheel_plugin -m gpu "${XDIST[@]}" "${TESTS[@]}"
if [ -n "$(ls -A "$CACHE")" ]; then
    echo "something was compiled into the kernel cache: $(ls "$CACHE")" >&2
    exit 1
fi
echo "prebuilt wheel: its CUDA and CPU modules ran the gpu tests, nothing compiled"
