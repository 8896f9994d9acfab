#!/usr/bin/env bash
# Time from `pip install` to the end of the first FusedAdam step, in a fresh virtualenv with the
# torch of the running python3 linked in: the wheel with prebuilt kernels against the plain
# wheel (its CPU kernels compiled just in time, into an empty kernel cache).
#
#   nox -s build && nox -s wheel_prebuilt        # the wheelhouse dist/, both wheels in it
#   bash benchmarks/first_step_after_install.sh  # run at the root of a checkout
#
# Each line: the seconds of `pip install`, of the process that makes the first step (imports
# included), and which CPU kernels it ran on.
set -euo pipefail
cd "$(dirname "$0")/.."
ls dist/amp_fused_ops-*-none-any.whl dist/amp_fused_ops-*-manylinux*.whl > /dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
site=$(python3 -c "import pathlib, torch; print(pathlib.Path(torch.__file__).parents[1])")
step='import time, torch
start = time.perf_counter()
from amp_optimizers import FusedAdam
from amp_fused_ops import extensions
params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(4)]
for p in params:
    p.grad = torch.randn(1000)
FusedAdam(params, lr=1e-3).step()
state = extensions.extension_status("cpu").state
print(f"first step {time.perf_counter() - start:.1f} s in the process, kernels {state}")'
mkdir "$work/plain"
cp dist/*-none-any.whl "$work/plain/"  # the wheelhouse without the prebuilt wheel
for kind in prebuilt plain; do
    venv="$work/venv-$kind"
    python3 -m virtualenv -q "$venv"
    echo "$site" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch-site.pth"
    links=dist
    [ "$kind" = plain ] && links="$work/plain"
    mkdir "$work/cache-$kind"
    t0=$(date +%s.%N)
    "$venv/bin/pip" install -q --no-compile --find-links "$links" amp-fused-ops amp-optimizers
    t1=$(date +%s.%N)
    line=$(AMP_FUSED_OPS_CACHE="$work/cache-$kind" OMP_NUM_THREADS=1 "$venv/bin/python" -c "$step" 2>/dev/null)
    t2=$(date +%s.%N)
    python3 -c "print('$kind wheel: pip install %.1f s, first-step process %.1f s, total %.1f s ($line)' % ($t1 - $t0, $t2 - $t1, $t2 - $t0))"
done
