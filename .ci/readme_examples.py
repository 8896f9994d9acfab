"""Run the ```python examples of a README, as a reader would paste them (`nox -s build`).

Usage: python .ci/readme_examples.py packages/<name>/README.md

The examples use the names a reader already has in a training script (``model``,
``optimizer``, ``loader``, ``loss_fn``, ``Net``, ``x``, ``y``, ``inputs``, ``targets``); a
small CPU setup defines them before each example, so every example starts from a fresh model
and optimizer. The examples of one README share one namespace (a later one may use a name an
earlier one imported). ``torch.distributed`` finds a one-rank world in the environment, as
``torchrun --nproc-per-node 1`` would set it. Exits non-zero on the first example that raises.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import traceback
from pathlib import Path

SETUP = """
import torch
import torch.nn.functional as F

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def forward(self, x):
        return self.body(x)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(2)]
inputs, targets = x, y = loader[0]
loss_fn = F.cross_entropy
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(readme: Path) -> int:
    examples = re.findall(r"^```python\n(.*?)^```", readme.read_text(), flags=re.M | re.S)
    if not examples:
        print(f"{readme}: no Python examples")
        return 0
    one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    os.environ.update({**one_rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for number, code in enumerate(examples, start=1):
        exec(compile(SETUP, "<setup>", "exec"), namespace)
        try:
            exec(compile(code, f"{readme} example {number}", "exec"), namespace)
        except Exception:
            print(f"{readme}: example {number} failed:\n{code}", file=sys.stderr)
            traceback.print_exc()
            return 1
        print(f"{readme}: example {number} of {len(examples)} ran")
    import torch.distributed as dist

    # Drop what the examples made (a DistributedDataParallel model holds the process group and
    # its reducer) before the group goes: left to interpreter teardown, gloo's threads can be
    # destroyed while joinable ("terminate called without an active exception", exit -6).
    namespace.clear()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
