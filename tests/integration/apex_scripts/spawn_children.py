"""An Apex-era script whose child processes import apex: one per start method.

Run under ``python -m amp_legacy_fp16.apex_run``: prints one line per child, naming where
``apex.optimizers.FusedAdam`` came from.
"""

import multiprocessing as mp

import torch.multiprocessing as torch_mp


def child(queue):
    import amp_C
    from apex.amp import _amp_state
    from apex.optimizers import FusedAdam

    queue.put(
        f"{FusedAdam.__module__} ops={len([n for n in dir(amp_C) if 'multi_tensor' in n])} "
        f"scalers={_amp_state.loss_scalers}"
    )


def rank_child(rank, queue):
    child(queue)


if __name__ == "__main__":
    for method in ("spawn", "forkserver", "fork"):
        ctx = mp.get_context(method)
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(queue,))
        process.start()
        print(f"{method}: {queue.get(timeout=300)}")
        process.join()
        assert process.exitcode == 0, (method, process.exitcode)
    queue = mp.get_context("spawn").SimpleQueue()
    torch_mp.spawn(rank_child, args=(queue,), nprocs=2)
    for _ in range(2):
        print(f"torch.multiprocessing.spawn: {queue.get()}")
