"""A training script whose pipeline functions live in the script itself (the main module),
copied into a package directory and run by tests/test_checkpoint_main_script.py.

    python mainpkg/job.py MODE DIR        # or: python -m mainpkg.job MODE DIR, or torchrun

Modes: ``save`` (take K batches, write DIR/state), ``restore`` (restore DIR/state, check
the rest of the stream), ``spawn-save`` / ``torch-spawn-save`` (a spawn child, through
multiprocessing or torch.multiprocessing, takes the checkpoint; this process restores
it), ``dcp-save`` (every rank under torchrun saves the loader with
torch.distributed.checkpoint) and ``spawn-dcp-restore`` (a spawn child loads it on one
rank, without a process group). Prints OK; anything else fails with a traceback.
"""

import gc
import multiprocessing
import os
import sys

import numpy as np

K, N, LANES = 3, 64, 2


def load(i):
    return {"x": np.full(3, i, dtype=np.int64)}


def bump(s):
    return {"x": s["x"] + 1}


def build(world=1, rank=0, **opts):
    from zephon import Pipeline, RuntimeOptions, sources

    return (Pipeline(sources.from_callable(N, load), seed=5, chunk_size=4)
            .map(bump).batch(4)
            .options(RuntimeOptions(runner="inline", world_size=world, global_rank=rank,
                                    canonical_replicas=LANES,
                                    mapping_strategy="interleaved", **opts)))


def first_column(batches):
    return [int(b["x"][0, 0]) for b in batches]


def save(directory):
    it = iter(build())
    for _ in range(K):
        next(it)
    state = it.checkpoint()
    it.close()
    with open(os.path.join(directory, "state"), "wb") as fh:
        fh.write(state)


def restore(directory, delivered=K):
    with open(os.path.join(directory, "state"), "rb") as fh:
        state = fh.read()
    pipe = build()
    pipe.restore(state)
    rest = first_column(pipe)
    assert rest == first_column(build())[delivered:], "the resumed stream differs"


def _torch_child(index, directory):
    save(directory)


def spawn_save(directory, torch_spawn):
    if torch_spawn:
        import torch.multiprocessing as tmp

        tmp.spawn(_torch_child, args=(directory,), nprocs=1, join=True)
    else:
        child = multiprocessing.get_context("spawn").Process(target=save, args=(directory,))
        child.start()
        child.join()
        assert child.exitcode == 0, f"the child failed: {child.exitcode}"
    restore(directory)


def dcp_save(directory):
    import torch._dynamo  # noqa: F401 - before the group exists (examples/train_ddp.py, shut_down_gloo)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import zephon.torch as zt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = zt.loader(build(world, rank, aggregate_store="torch://"))
    it = iter(loader)
    for _ in range(K):
        next(it)
    dcp.save({"data": loader}, checkpoint_id=os.path.join(directory, "dcp"))
    loader.close()
    dist.destroy_process_group()
    gc.collect()  # joins gloo's threads while the interpreter is alive


def _dcp_restore(directory, world):
    import torch.distributed.checkpoint as dcp

    import zephon.torch as zt

    fresh = zt.loader(build())
    dcp.load({"data": fresh}, checkpoint_id=os.path.join(directory, "dcp"))
    rest = [int(b["x"][0, 0]) for b in fresh]
    assert rest == first_column(build())[world * K:], "the resumed stream differs"


def spawn_dcp_restore(directory, world):
    child = multiprocessing.get_context("spawn").Process(target=_dcp_restore,
                                                         args=(directory, world))
    child.start()
    child.join()
    assert child.exitcode == 0, f"the child failed: {child.exitcode}"


if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "save":
        save(where)
    elif mode == "restore":
        restore(where)
    elif mode in ("spawn-save", "torch-spawn-save"):
        spawn_save(where, mode == "torch-spawn-save")
    elif mode == "dcp-save":
        dcp_save(where)
    elif mode == "spawn-dcp-restore":
        spawn_dcp_restore(where, int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    if os.environ.get("RANK", "0") == "0":
        print("OK")
