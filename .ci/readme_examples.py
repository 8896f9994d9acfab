"""Run the ```python examples of a README exactly as printed (`nox -s build`).

Usage: python .ci/readme_examples.py packages/<name>/README.md

Each example runs alone, in a fresh namespace, with nothing defined before it: what a reader
gets who pastes that one block into a new interpreter. An example that needs a model, an
optimizer or data defines stand-ins for them where the reader sees them. The working
directory is an empty temporary folder (an example may save a checkpoint). Only
``torch.distributed`` finds a one-rank world in the environment, as ``torchrun
--nproc-per-node 1`` would set it. Exits non-zero on the first example that raises.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import tempfile
import traceback
from pathlib import Path


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
    readme = readme.resolve()
    folder = tempfile.TemporaryDirectory(prefix="readme_examples_")
    os.chdir(folder.name)
    namespace: dict[str, object] = {}
    for number, code in enumerate(examples, start=1):
        namespace = {"__name__": "__main__"}  # a new interpreter's, nothing else
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
    os.chdir(readme.parent)
    folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
