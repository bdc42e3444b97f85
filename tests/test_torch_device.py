"""zephon.torch.loader(device=..., normalize=...): batches moved to a device and uint8 image
columns normalised there as torchvision's ToTensor + Normalize would, in NCHW (contiguous
or channels_last), on the consumer's thread or the pinning thread, without changing which
batches a checkpoint counts; the arguments checked up front. The CUDA tests run only
where CUDA is present."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from _images import write_jpegs
from _resume import assert_resumes

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import ZephonConfigError

torch = pytest.importorskip("torch")
import zephon.torch as zt  # noqa: E402

pytestmark = pytest.mark.torch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
NORM = {"image": (MEAN, STD)}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def image_sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8), "label": i,
            "name": f"img{i}"}


def gray_sample(i: int) -> dict:
    return {"image": np.full((3, 2), 10 * i, dtype=np.uint8)}


def chw_sample(i: int) -> dict:
    return {"image": np.moveaxis(image_sample(i)["image"], -1, 0).copy()}


def pipe(n: int = 24, fn=image_sample, **opts) -> Pipeline:
    return Pipeline(sources.from_callable(n, fn), seed=3, chunk_size=4).batch(4) \
        .options(RuntimeOptions(**opts))


def reference(images: np.ndarray, mean=MEAN, std=STD) -> torch.Tensor:
    """torchvision's ToTensor + Normalize of a (N, H, W, C) uint8 batch, written out."""
    x = torch.from_numpy(np.array(images)).permute(0, 3, 1, 2).float().div(255)
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x - m) / s


def key(batch) -> tuple:
    return batch.meta["lane"], batch.meta["lane_index"], tuple(batch["name"])


def test_normalize_gives_torchvisions_nchw_float_and_leaves_other_columns():
    raw = list(pipe())
    got = list(zt.loader(pipe(), device="cpu", normalize=NORM))
    assert len(got) == len(raw) == 6
    for batch, ref in zip(got, raw, strict=True):
        image = batch["image"]
        assert image.dtype == torch.float32 and image.shape == (4, 3, 5, 4)
        assert image.is_contiguous()
        torch.testing.assert_close(image, reference(ref["image"]), rtol=0, atol=2e-6)
        assert torch.equal(batch["label"], torch.from_numpy(ref["label"]))
        assert batch["name"] == ref["name"] and batch.meta == ref.meta


def test_channels_last_is_the_same_values_in_channels_last_memory():
    plain = list(zt.loader(pipe(), normalize=NORM))
    last = list(zt.loader(pipe(), normalize=NORM, channels_last=True))
    for a, b in zip(plain, last, strict=True):
        assert b["image"].shape == a["image"].shape
        assert b["image"].is_contiguous(memory_format=torch.channels_last)
        assert not b["image"].is_contiguous()
        assert torch.equal(a["image"], b["image"])


def test_nchw_batches_grayscale_batches_and_one_value_for_all_channels():
    hwc = list(zt.loader(pipe(), normalize=NORM))
    chw = list(zt.loader(pipe(fn=chw_sample), normalize=NORM, layout="CHW"))
    for a, b in zip(hwc, chw, strict=True):
        assert torch.equal(a["image"], b["image"])
    gray = list(zt.loader(pipe(fn=gray_sample), normalize={"image": (0.5, 0.25)}))
    raw = list(pipe(fn=gray_sample))
    for batch, ref in zip(gray, raw, strict=True):
        assert batch["image"].shape == (4, 1, 3, 2)
        want = (torch.from_numpy(ref["image"]).float()[:, None] / 255 - 0.5) / 0.25
        torch.testing.assert_close(batch["image"], want, rtol=0, atol=2e-6)
    one = next(iter(zt.loader(pipe(), normalize={"image": (0.5, 0.5)})))
    torch.testing.assert_close(one["image"], reference(next(iter(pipe()))["image"],
                                                      (0.5,) * 3, (0.5,) * 3),
                               rtol=0, atol=2e-6)


def test_device_moves_every_tensor_and_keeps_the_rest():
    raw = list(pipe())
    got = list(zt.loader(pipe(), device=torch.device("cpu")))
    for batch, ref in zip(got, raw, strict=True):
        assert batch["image"].dtype == torch.uint8  # no normalize: moved as it is
        assert torch.equal(batch["image"], torch.from_numpy(ref["image"]))
        assert batch["name"] == ref["name"]
    assert zt.loader(pipe(), device="cpu").device == torch.device("cpu")
    assert zt.loader(pipe()).device is None


def test_the_pinning_thread_normalises_and_only_handed_out_batches_count():
    def make():
        return zt.loader(pipe(), pin_memory=True, prefetch=3, device="cpu", normalize=NORM)

    def save(loader, it):
        assert loader._thread is not None and loader._thread.is_alive()  # it ran ahead
        return loader.state_dict()

    plain = [b["image"] for b in zt.loader(pipe(), normalize=NORM)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no accelerator to pin for
        pinned = [b["image"] for b in make()]
        for a, b in zip(plain, pinned, strict=True):
            assert torch.equal(a, b)
        assert_resumes(make, 2, key=key, save=save,
                       load=lambda loader, state: loader.load_state_dict(state))
        # and a state_dict of a normalising loader restores into a plain one
        assert_resumes(make, 3, key=key, save=save, again=lambda: zt.loader(pipe()),
                       load=lambda loader, state: loader.load_state_dict(state))


def decode(sample: dict) -> dict:
    """The test's decode op: PIL, RGB, as ImageFolder's default loader does."""
    from PIL import Image

    with Image.open(io.BytesIO(sample["image"])) as img:
        array = np.asarray(img.convert("RGB"))
    return {"image": array, "label": sample["label"], "path": sample["path"]}


def test_image_folder_decode_and_device_normalise_match_torchvisions_pipeline(tmp_path):
    for k, cls in enumerate(["cat", "dog", "eel"]):
        write_jpegs(tmp_path / "train" / cls, 3, (6, 5), seed=k)
    src = sources.image_folder(str(tmp_path / "train"))
    loader = zt.loader(Pipeline(src, seed=1, chunk_size=2).map(decode).batch(3),
                       device="cpu", normalize=NORM)
    seen = 0
    for batch in loader:
        from PIL import Image

        for row, (path, label) in enumerate(zip(batch["path"], batch["label"].tolist(),
                                                strict=True)):
            with Image.open(path) as img:  # what ImageFolder + ToTensor + Normalize give
                want = reference(np.asarray(img.convert("RGB"))[None])[0]
            torch.testing.assert_close(batch["image"][row], want, rtol=0, atol=2e-6)
            assert label == src.class_to_idx[path.split("/")[-2]]
            seen += 1
    assert seen == len(src) == 9


# -- the arguments, checked up front ----------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu-9000"), "device must be"),
    (dict(device=3.5), "device must be"),
    (dict(non_blocking="yes"), "non_blocking"),
    (dict(channels_last=1), "channels_last"),
    (dict(layout="NHWC"), "layout must be one of"),
    (dict(normalize=[MEAN, STD]), "normalize must be None or a mapping"),
    (dict(normalize={"image": MEAN}), r"pair \(mean, std\)"),
    (dict(normalize={"image": ((123.7, 116.3, 103.5), (58.4, 57.1, 57.4))}), "divide them by 255"),
    (dict(normalize={"image": (MEAN, (0.2, 0.0, 0.2))}), r"std in \(0, 1\]"),
    (dict(normalize={"image": (MEAN, (0.2, 0.2))}), "3 means and 2 stds"),
    (dict(normalize={"image": ("abc", STD)}), "finite number"),
    (dict(normalize={"image": ((float("nan"),), STD)}), "finite number"),
    (dict(normalize={7: (MEAN, STD)}), "column names"),
])
def test_bad_arguments_are_config_errors_before_any_batch(kwargs, match):
    with pytest.raises(ZephonConfigError, match=match):
        zt.loader(pipe(), **kwargs)


def test_a_device_this_machine_lacks_is_refused():
    if torch.cuda.is_available():
        with pytest.raises(ZephonConfigError, match="device"):
            zt.loader(pipe(), device=f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ZephonConfigError, match=r"cuda.is_available\(\) is False"):
            zt.loader(pipe(), device="cuda")


@pytest.mark.parametrize("normalize, fn, match", [
    ({"pixels": (MEAN, STD)}, image_sample, r"column 'pixels'.*\['image', 'label', 'name'\]"),
    ({"label": (0.5, 0.5)}, image_sample, "takes uint8 images.*int64"),
    ({"image": (MEAN, STD)}, gray_sample, "3 means and 3 stds for images of 1 channel"),
])
def test_a_batch_that_does_not_fit_normalize_is_a_config_error_naming_it(normalize, fn, match):
    with pytest.raises(ZephonConfigError, match=match):
        next(iter(zt.loader(pipe(fn=fn), normalize=normalize)))


# -- CUDA ---------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("pin_memory", [False, True])
def test_cuda_batches_arrive_normalised_on_the_device_for_the_consumers_stream(pin_memory):
    want = list(zt.loader(pipe(48), normalize=NORM))
    loader = zt.loader(pipe(48), device="cuda", pin_memory=pin_memory, prefetch=4,
                       normalize=NORM, channels_last=True)
    consumer = torch.cuda.Stream()
    busy = torch.randn(2048, 2048, device="cuda")
    got = []
    with torch.cuda.stream(consumer):  # not the default stream: the wait must be on this one
        for batch in loader:
            assert batch["image"].device.type == "cuda"
            assert batch["label"].device.type == "cuda"
            # work queued on the consumer's stream reads the batch after its copy
            got.append((batch["image"] * 1.0).to("cpu", non_blocking=False))
            for _ in range(4):  # keep the consumer's stream busy while the next one comes
                busy @ busy
    torch.cuda.synchronize()
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b["image"], rtol=0, atol=2e-6)
