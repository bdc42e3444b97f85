"""zephon.torch: tensor batches zero-copy from the arena, pinning on a background thread,
the Stateful protocol (torch.save, torch.distributed.checkpoint), the IterableDataset
adapter, tensors through validation, batch() and the process transport."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import _pipeline_fns as F
import _torch_fns as T
import numpy as np
import pytest
from _resume import END, assert_resumes, passes
from _streams import keys_of

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import CheckpointError, ValidationError, ZephonConfigError

torch = pytest.importorskip("torch")
import zephon.torch as zt  # noqa: E402

pytestmark = pytest.mark.torch


def pipeline(n=60, **opts):
    return Pipeline(sources.from_callable(n, F.make_sample), seed=5, chunk_size=4) \
        .map(F.double).batch(3).options(RuntimeOptions(**opts))


def key(b) -> tuple:
    return b.meta["lane"], b.meta["lane_index"], tuple(np.asarray(b["id"]).tolist())


def load_state_dict(loader, state: dict) -> None:
    """How :func:`assert_resumes` restores a loader."""
    loader.load_state_dict(state)


def test_numeric_columns_become_tensors_other_columns_and_meta_stay():
    pipe = Pipeline(sources.from_callable(8, lambda i: {"id": i, "name": f"s{i}",
                                                        "x": np.arange(3) + i}),
                    seed=1, chunk_size=4).batch(4)
    batches = list(zt.loader(pipe))
    numpy_batches = list(pipe._with())
    assert len(batches) == len(numpy_batches) == 2
    for got, ref in zip(batches, numpy_batches):
        assert isinstance(got["x"], torch.Tensor) and isinstance(got["id"], torch.Tensor)
        assert got["name"] == ref["name"] and isinstance(got["name"], list)
        assert torch.equal(got["x"], torch.from_numpy(ref["x"]))
        assert got.meta == ref.meta


def test_tensors_share_the_arena_memory_and_keep_it_leased():
    # batches made by a process stage arrive in the worker's shared-memory arena
    pipe = Pipeline(sources.from_callable(48, T.make_big_sample), seed=2, chunk_size=4) \
        .batch(4).map_batch(F.total) \
        .options(RuntimeOptions(runner="process", max_workers=2,
                                shm_min_new_allocation_bytes=0))
    kept = []
    for i, batch in enumerate(pipe):
        array = batch["x"]
        # a view of an arena region (leased), not a private or in-band copy
        assert array.base is not None and not isinstance(array.base, (bytes, bytearray))
        x = zt.to_torch(batch)["x"]
        assert x.data_ptr() == array.__array_interface__["data"][0]  # zero-copy
        if i % 3 == 0:
            kept.append((x, torch.from_numpy(batch["id"].copy())))
        del batch, x, array
        gc.collect()
    # tensors kept while many more batches went through the arena still hold their values
    # (their regions stayed leased instead of being recycled)
    assert len(kept) >= 3
    for x, ids in kept:
        expected = ids.float().reshape(-1, 1).expand(-1, x.shape[1])
        assert torch.equal(x, expected)


def test_state_dict_round_trips_through_torch_save(tmp_path):
    def save(loader, it):
        torch.save({"data": loader.state_dict()}, tmp_path / "ckpt.pt")
        return torch.load(tmp_path / "ckpt.pt", weights_only=True)["data"]

    reference, following = passes(pipeline, 2, key)
    for cut in (5, END):
        assert_resumes(lambda: zt.loader(pipeline(runner="inline")), cut, key=key,
                       again=lambda: zt.loader(pipeline(runner="threads", max_workers=2)),
                       reference=reference, following=following, save=save,
                       load=load_state_dict)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_pinned_loader_counts_only_handed_out_batches(runner):
    opts = dict(runner=runner, max_workers=2) if runner == "process" else dict(runner=runner)
    loaders = []

    def make():
        loaders.append(zt.loader(pipeline(**opts), pin_memory=True, prefetch=3))
        return loaders[-1]

    def save(loader, it):
        # the thread has pulled ahead of what was handed out
        assert loader._thread is not None and loader._thread.is_alive()
        return loader.state_dict()

    reference, following = passes(pipeline, 2, key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no accelerator on CPU machines
        assert_resumes(make, 4, again=lambda: zt.loader(pipeline()), key=key,
                       reference=reference, following=following, save=save,
                       load=load_state_dict)
    assert loaders[0]._thread is None  # closed after the state was taken


def test_pin_memory_without_an_accelerator_warns_and_still_delivers():
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present: batches are really pinned")
    with pytest.warns(RuntimeWarning, match="no accelerator"):
        batches = list(zt.loader(pipeline(), pin_memory=True))
    assert keys_of(batches, key) == keys_of(pipeline()._with(), key)


def test_a_pipeline_error_reaches_the_consumer_through_the_pinning_thread():
    pipe = Pipeline(sources.from_callable(30, F.make_sample), seed=1, chunk_size=4) \
        .map(F.boom).batch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(Exception, match="thirteen"):
            list(zt.loader(pipe, pin_memory=True))


def test_load_state_dict_refuses_what_state_dict_did_not_make():
    loader = zt.loader(pipeline())
    with pytest.raises(CheckpointError, match="zephon_checkpoint"):
        loader.load_state_dict({"model": 1})
    with pytest.raises(CheckpointError):
        loader.load_state_dict({zt.STATE_KEY: b"garbage"})


def test_bad_arguments_are_config_errors():
    with pytest.raises(ZephonConfigError, match="Pipeline"):
        zt.loader([1, 2, 3])
    with pytest.raises(ZephonConfigError, match="pin_memory"):
        zt.loader(pipeline(), pin_memory="yes")
    with pytest.raises(ZephonConfigError, match="prefetch"):
        zt.loader(pipeline(), prefetch=0)


DCP_SCRIPT = r"""
import os, sys
sys.path.insert(0, {tests!r})
import numpy as np, torch
import torch.distributed.checkpoint as dcp
import zephon.torch as zt
from _streams import keys_of
from test_torch_loader import key, pipeline

if __name__ == "__main__":
    loader = zt.loader(pipeline())
    it = iter(loader)
    head = [next(it) for _ in range(4)]
    model = torch.nn.Linear(2, 2)
    dcp.save({{"model": model, "data": loader}}, checkpoint_id={path!r})
    fresh = zt.loader(pipeline(runner="threads", max_workers=2))
    model2 = torch.nn.Linear(2, 2)
    dcp.load({{"model": model2, "data": fresh}}, checkpoint_id={path!r})
    assert torch.equal(model.weight, model2.weight)
    reference = keys_of(pipeline()._with(), key)
    assert keys_of(head, key) + keys_of(fresh, key) == reference, "stream differs"
    print("OK")
"""


def test_torch_distributed_checkpoint_stores_model_and_data_in_one_call(tmp_path):
    # DCP without a process group (one process); a subprocess keeps its globals out of ours
    code = DCP_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)),
                             path=str(tmp_path / "dcp"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_dataset_adapter_works_with_a_dataloader_without_workers():
    ds = zt.dataset(pipeline())
    got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
    assert keys_of(got, key) == keys_of(pipeline()._with(), key)
    assert isinstance(got[0]["x"], torch.Tensor)


def test_dataset_adapter_refuses_dataloader_workers_saying_what_to_use():
    ds = zt.dataset(pipeline())
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
    with pytest.raises(Exception, match=r"num_workers=0.*max_workers") as info:
        list(loader)
    assert "ZephonConfigError" in str(info.value) or isinstance(info.value, ZephonConfigError)


def tensor_pipeline(**opts):
    return Pipeline(sources.from_callable(20, F.make_sample), seed=3, chunk_size=4) \
        .map(T.to_tensor).batch(4).options(RuntimeOptions(**opts))


def test_a_deterministic_map_returning_tensors_passes_strict_validation():
    batches = list(tensor_pipeline(auto_validation="strict"))
    assert batches and all(isinstance(b["x"], torch.Tensor) for b in batches)


def test_a_nondeterministic_tensor_map_is_still_caught():
    # torch's global RNG left unseeded (seeded per call, the default, it is exact)
    pipe = Pipeline(sources.from_callable(20, F.make_sample), seed=3).map(T.noisy_tensor) \
        .options(RuntimeOptions(auto_validation="strict", seed_global_rngs="off"))
    with pytest.raises(ValidationError, match="Z002"):
        list(pipe)


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_batch_stacks_tensors_as_it_stacks_arrays(runner):
    opts = dict(runner=runner, max_workers=2) if runner == "process" else dict(runner=runner)
    batches = list(tensor_pipeline(auto_validation="off", **opts))
    for b in batches:
        n = len(b["id"])
        assert isinstance(b["x"], torch.Tensor) and b["x"].shape == (n, 4)
        assert b["x"].dtype == torch.float32 and b["w"].shape == (n, 3)
        assert torch.equal(b["w"][:, 0], torch.as_tensor(b["id"]).float())
    assert keys_of(batches, key) == keys_of(tensor_pipeline(runner="inline"), key)


def test_validation_compares_tensors_bit_for_bit():
    from zephon.pipeline.validate import _same

    a = torch.tensor([1.0, float("nan"), 3.0])
    assert _same(a, a.clone())
    assert not _same(a, torch.tensor([1.0, float("nan"), 4.0]))
    assert not _same(a, a.double())
    assert not _same(a, a.reshape(3, 1))
    assert not _same(a, a.numpy())
    assert _same({"t": torch.arange(3)}, {"t": torch.arange(3)})


def test_tensors_returned_by_process_workers_arrive_as_tensors_in_the_arena():
    pipe = Pipeline(sources.from_callable(24, F.make_sample), seed=4, chunk_size=4) \
        .map(T.to_big_tensor) \
        .options(RuntimeOptions(runner="process", max_workers=2, auto_validation="off",
                                shm_min_new_allocation_bytes=0))
    seen = 0
    for sample in pipe:
        t = sample["t"]
        assert isinstance(t, torch.Tensor) and torch.equal(t, torch.full_like(t, sample["id"]))
        base = t.numpy().base  # the tensor wraps a view of an arena region: no copy
        assert base is not None and not isinstance(base, (bytes, bytearray))
        seen += 1
    assert seen == 24


@pytest.mark.parametrize("pin_memory", [False, True])
def test_state_after_close_counts_only_batches_handed_out(pin_memory):
    def save(loader, it):
        loader.close()  # the pinning thread had pulled batches ahead of the loop
        return loader.state_dict()

    reference, following = passes(lambda: zt.loader(pipeline()), 2, key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no accelerator to pin for
        for cut in (5, END):
            assert_resumes(lambda: zt.loader(pipeline(runner="threads", max_workers=2),
                                             pin_memory=pin_memory, prefetch=3),
                           cut, again=lambda: zt.loader(pipeline()), key=key,
                           reference=reference, following=following, save=save,
                           load=load_state_dict)


def test_a_refused_state_leaves_the_loader_where_it_was():
    full = keys_of(zt.loader(pipeline()), key)
    loader = zt.loader(pipeline())
    head = [b for _, b in zip(range(3), loader)]
    other = zt.loader(pipeline().map(F.double))
    next(iter(other))
    foreign = other.state_dict()
    other.close()
    import torch

    for bad in (foreign, {"zephon_checkpoint": b"garbage"},
                {"zephon_checkpoint": torch.zeros(4, dtype=torch.int64)}):
        with pytest.raises(CheckpointError):
            loader.load_state_dict(bad)
    assert keys_of(head, key) + keys_of(loader, key) == full  # it went on after batch 3


def test_columns_torch_cannot_view_become_tensors_of_a_copy():
    import torch

    batch = zt.to_torch({"rev": np.arange(6)[::-1], "be": np.arange(4, dtype=">i4")})
    assert torch.equal(batch["rev"], torch.arange(6).flip(0))
    assert batch["be"].tolist() == [0, 1, 2, 3]
