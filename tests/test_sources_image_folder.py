"""sources.image_folder: an ImageFolder tree read as torchvision reads it (classes, labels,
order, extensions, links), its samples' bytes, the fingerprint that keeps a checkpoint
from resuming over another tree, and the errors of a bad tree, at build and at read."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from _resume import assert_resumes
from _streams import keys_of

from zephon import Pipeline, RuntimeOptions, StoreOptions, sources
from zephon.errors import CheckpointError, SourceError, ZephonConfigError

TV_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def put(path, data: bytes | None = None) -> bytes:
    """Write ``data`` (default: bytes derived from the path) at ``path``, making its dirs."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = data if data is not None else f"bytes of {os.path.basename(path)}".encode() * 3
    with open(path, "wb") as fh:
        fh.write(data)
    return data


def torchvision_samples(root: str, extensions=TV_EXTENSIONS) -> tuple[list, list]:
    """``ImageFolder(root)``'s classes and ``samples``, by torchvision's own algorithm
    (``find_classes`` and ``make_dataset`` of torchvision.datasets.folder, verbatim in
    substance): the reference the source must agree with."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for where, _, names in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for name in sorted(names):
                path = os.path.join(where, name)
                if path.lower().endswith(extensions):
                    samples.append((path, label))
    return classes, samples


@pytest.fixture
def tree(tmp_path):
    """A tree with the cases torchvision's order and filter decide: nested directories whose
    names sort differently as paths and as names ('sub' < 'sub-x' < 'sub/y'), extensions in
    any case, files that are not images, files at the root, a hidden class, a class that is
    a link to a directory elsewhere and an image that is a link to a file elsewhere."""
    root = tmp_path / "train"
    for rel in ["cat/b.jpg", "cat/a.PNG", "cat/A.jpeg", "cat/sub/z.png", "cat/sub-x/y.jpg",
                "cat/sub/deeper/x.webp", "cat/sub.d/w.bmp", "dog/1.JPG", "dog/10.tif",
                "dog/2.tiff", "dog/3.pgm", "dog/4.ppm", ".hidden/h.jpg", "zebra/only.jpg"]:
        put(str(root / rel))
    put(str(root / "cat" / "notes.txt"))
    put(str(root / "cat" / "no_extension"))
    put(str(root / "dog" / "jpg"))  # ends with "jpg" but not ".jpg"
    put(str(root / "stray.jpg"))    # at the root: no class
    elsewhere = tmp_path / "elsewhere"
    put(str(elsewhere / "bird" / "k.jpg"))
    put(str(elsewhere / "linked.png"))
    os.symlink(elsewhere / "bird", root / "bird")
    os.symlink(elsewhere / "linked.png", root / "dog" / "5.png")
    return str(root)


def test_classes_labels_and_order_are_torchvision_imagefolder(tree):
    src = sources.image_folder(tree)
    classes, samples = torchvision_samples(tree)
    assert src.classes == classes == [".hidden", "bird", "cat", "dog", "zebra"]
    assert src.class_to_idx == {c: k for k, c in enumerate(classes)}
    got = [(s["path"], s["label"]) for s in (src.get(i) for i in range(len(src)))]
    assert got == samples
    assert src.targets.tolist() == [label for _, label in samples]
    # the cases that tell the orders apart are there
    cat = [os.path.relpath(p, tree) for p, label in samples if label == 2]
    assert cat == ["cat/A.jpeg", "cat/a.PNG", "cat/b.jpg", "cat/sub/z.png",
                   "cat/sub-x/y.jpg", "cat/sub.d/w.bmp", "cat/sub/deeper/x.webp"]


def test_a_sample_is_the_files_bytes_its_label_and_path(tree):
    src = sources.image_folder(tree)
    for i in range(len(src)):
        sample = src.get(i)
        assert set(sample) == {"image", "label", "path"}
        with open(sample["path"], "rb") as fh:
            assert sample["image"] == fh.read()
        assert isinstance(sample["label"], int) and isinstance(sample["image"], bytes)
        assert src.identity(i) == ("image_folder", i)
    with pytest.raises(IndexError):
        src.get(len(src))


def test_extensions_select_case_insensitively(tree):
    src = sources.image_folder(tree, extensions=[".JPG"], allow_empty=True)
    _, samples = torchvision_samples(tree, (".jpg",))
    assert [src.get(i)["path"] for i in range(len(src))] == [p for p, _ in samples]
    assert len(src) == 6
    with pytest.raises(ZephonConfigError, match="dot"):
        sources.image_folder(tree, extensions=["jpg"])
    with pytest.raises(ZephonConfigError, match="extensions"):
        sources.image_folder(tree, extensions=[])
    with pytest.raises(ZephonConfigError, match="root"):
        sources.image_folder(42)


def test_the_same_tree_gives_the_same_indices_and_fingerprint_in_every_process(tree):
    a, b = sources.image_folder(tree), sources.image_folder(tree)
    assert a.describe() == b.describe()
    copy = pickle.loads(pickle.dumps(a))
    assert copy.describe() == a.describe()
    assert [copy.get(i) for i in range(len(a))] == [b.get(i) for i in range(len(b))]


def _change(tree, how: str) -> None:
    path = os.path.join(tree, "cat", "b.jpg")
    if how == "added":
        put(os.path.join(tree, "dog", "6.jpg"))
    elif how == "removed":
        os.unlink(path)
    elif how == "renamed":
        os.rename(path, os.path.join(tree, "cat", "bb.jpg"))
    elif how == "resized":
        put(path, b"other")
    elif how == "touched":  # same bytes, another mtime
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif how == "class":
        put(os.path.join(tree, "eel", "e.jpg"))


@pytest.mark.parametrize("how", ["added", "removed", "renamed", "resized", "touched", "class"])
def test_a_checkpoint_does_not_resume_over_another_tree(tree, how):
    pipe = Pipeline(sources.image_folder(tree), seed=1, chunk_size=2).batch(2)
    it = iter(pipe)
    next(it)
    state = it.checkpoint()
    it.close()
    _change(tree, how)
    other = Pipeline(sources.image_folder(tree), seed=1, chunk_size=2).batch(2)
    with pytest.raises(CheckpointError, match="fingerprint"):
        other.restore(state)


def test_without_mtimes_a_copy_with_other_times_resumes_but_other_sizes_do_not(tree):
    before = sources.image_folder(tree, fingerprint_mtimes=False).describe()
    _change(tree, "touched")
    assert sources.image_folder(tree, fingerprint_mtimes=False).describe() == before
    _change(tree, "resized")
    assert sources.image_folder(tree, fingerprint_mtimes=False).describe() != before


def test_the_root_may_move_and_still_resume(tree, tmp_path):
    before = sources.image_folder(tree).describe()
    moved = tmp_path / "moved" / "train"
    os.makedirs(moved.parent)
    os.rename(tree, moved)
    assert sources.image_folder(str(moved)).describe() == before


def key(batch) -> tuple:
    return (batch.meta["lane"], batch.meta["lane_index"], tuple(batch["path"]),
            tuple(np.asarray(batch["label"]).tolist()), tuple(batch["image"]))


def make_pipe(tree, **opts):
    return Pipeline(sources.image_folder(tree), seed=7, chunk_size=3).batch(2) \
        .options(RuntimeOptions(**opts))


def test_process_workers_read_what_inline_reads_and_a_rebuilt_source_resumes(tree):
    inline = keys_of(make_pipe(tree), key)
    assert keys_of(make_pipe(tree, runner="process", max_workers=2), key) == inline
    # a checkpoint resumes into a pipeline over a source built again on the same tree
    assert_resumes(lambda: make_pipe(tree), 3, key=key,
                   again=lambda: make_pipe(tree, runner="threads", max_workers=2))


# -- a bad tree, when the source is built -----------------------------------------------------
def test_a_root_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(SourceError, match="missing"):
        sources.image_folder(str(tmp_path / "missing"))
    put(str(tmp_path / "file.jpg"))
    with pytest.raises(SourceError, match=r"file\.jpg.*is a regular file.*directory"):
        sources.image_folder(str(tmp_path / "file.jpg"))
    os.makedirs(tmp_path / "flat")
    put(str(tmp_path / "flat" / "a.jpg"))  # images but no class directory
    with pytest.raises(SourceError, match="no class directory"):
        sources.image_folder(str(tmp_path / "flat"))


def test_a_class_without_images_is_refused_by_name_unless_allowed(tmp_path):
    root = tmp_path / "t"
    put(str(root / "a" / "x.jpg"))
    put(str(root / "b" / "readme.txt"))
    put(str(root / "c" / "y.png"))
    with pytest.raises(SourceError, match=r"'.*/t/b'.*allow_empty=True"):
        sources.image_folder(str(root))
    src = sources.image_folder(str(root), allow_empty=True)
    assert src.classes == ["a", "b", "c"]  # b keeps its label: c is still 2
    assert [src.get(i)["label"] for i in range(len(src))] == [0, 2]
    with pytest.raises(ZephonConfigError, match="allow_empty"):
        sources.image_folder(str(root), allow_empty="yes")


def test_a_dangling_link_a_link_cycle_and_a_fifo_are_refused_naming_them(tmp_path):
    root = tmp_path / "t"
    put(str(root / "a" / "x.jpg"))
    os.symlink(tmp_path / "nowhere.jpg", root / "a" / "gone.jpg")
    with pytest.raises(SourceError, match=r"gone\.jpg is a symbolic link to nothing"):
        sources.image_folder(str(root))
    os.unlink(root / "a" / "gone.jpg")
    os.makedirs(root / "a" / "deep")
    os.symlink(root / "a", root / "a" / "deep" / "loop")
    with pytest.raises(SourceError, match=r"loop is a link back.*cycle"):
        sources.image_folder(str(root))
    os.unlink(root / "a" / "deep" / "loop")
    os.mkfifo(root / "a" / "pipe.jpg")
    with pytest.raises(SourceError, match=r"pipe\.jpg is a fifo"):
        sources.image_folder(str(root))


# -- a tree that changes after the listing, when a sample is read -----------------------------
@pytest.mark.parametrize("how, message", [
    ("removed", "vanished since the source was built"),
    ("resized", "its size changed"),
    ("touched", "modified"),
    ("fifo", "it is now a fifo"),
])
def test_an_image_changed_after_the_listing_is_a_source_error_naming_it(tree, how, message):
    src = sources.image_folder(tree)
    i = next(i for i in range(len(src)) if src.get(i)["path"].endswith("cat/b.jpg"))
    if how == "fifo":
        path = os.path.join(tree, "cat", "b.jpg")
        os.unlink(path)
        os.mkfifo(path)
    else:
        _change(tree, how)
    with pytest.raises(SourceError, match=rf"cat/b.jpg \(sample {i}, class 'cat'\).*{message}"):
        src.get(i)
    src.get(0)  # the others still read


def test_a_run_over_a_changed_image_fails_with_its_name(tree):
    pipe = Pipeline(sources.image_folder(tree), shuffle=False).batch(4)
    os.unlink(os.path.join(tree, "cat", "sub", "z.png"))
    with pytest.raises(Exception, match=r"z\.png.*vanished"):
        list(pipe)


# -- a remote root -------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", [False, True])
def test_a_remote_tree_reads_like_the_local_one(tree, tmp_path, cache):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from _s3_server import BUCKET, MotoServer, storage_options

    server = MotoServer()
    try:
        prefix = f"images-{cache}/train"
        for where, _, names in os.walk(tree, followlinks=True):
            for name in names:
                path = os.path.join(where, name)
                with open(path, "rb") as fh:
                    server.put(f"{prefix}/{os.path.relpath(path, tree)}", fh.read())
        io = StoreOptions(cache_enabled=cache, cache_root=str(tmp_path / "cache"),
                          retry_backoff_initial_s=0.01, retry_backoff_max_s=0.05)
        remote = sources.image_folder(f"s3://{BUCKET}/{prefix}",
                                      storage_options=storage_options(server.endpoint),
                                      io_options=io)
        local = sources.image_folder(tree, fingerprint_mtimes=False)
        assert remote.classes == local.classes and len(remote) == len(local)
        opts = RuntimeOptions(io_options=io, runner="process", max_workers=2)
        got = list(Pipeline(remote, seed=4, chunk_size=4).options(opts))
        want = list(Pipeline(local, seed=4, chunk_size=4))
        rel = [(os.path.relpath(s["path"], tree), s["label"], s["image"]) for s in want]
        assert [(s["path"].split(prefix + "/", 1)[1], s["label"], s["image"])
                for s in got] == rel
        assert got[0]["path"].startswith(f"s3://{BUCKET}/{prefix}/")
        server.delete(f"{prefix}/cat/b.jpg")
        i = next(i for i in range(len(remote)) if remote.relative_path(i) == "cat/b.jpg")
        if not cache:  # streamed: the object is gone; cached: the copy still serves
            with pytest.raises(SourceError, match=r"cat/b\.jpg"):
                remote.get(i)
    finally:
        server.stop()
