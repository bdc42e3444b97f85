"""File sources trust nothing they read: member kinds and duplicates in tar shards,
compressed shards, token files that change under a live pipeline, jsonl resource
bounds and parse errors, and paths of the wrong kind. Every file here is real (GNU tar
for sparse members); every error is a SourceError naming the file and the position."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tracemalloc

import numpy as np
import pytest

from zephon import sources
from zephon.pipeline.sources import SourceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _link(tar: tarfile.TarFile, name: str, target: str, kind: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    tar.addfile(info)


def _tarfile_samples(path) -> dict:
    """{key: {ext: bytes}} as tarfile extracts the shard (links resolved by tarfile)."""
    out: dict = {}
    with tarfile.open(path) as tar:
        for m in tar:
            if m.isdir():
                continue
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def _samples(src) -> dict:
    return {s["__key__"]: {k: v for k, v in s.items() if k != "__key__"}
            for s in (src.get(i) for i in range(len(src)))}


# -- webdataset: sparse members ------------------------------------------------------------------
def _holey(path, rng) -> bytes:
    """A file with data, a 192 KiB hole, data and a trailing 64 KiB hole; its bytes."""
    head, mid = rng.bytes(8192), rng.bytes(4096)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.seek(8192 + (192 << 10))
        fh.write(mid)
        fh.truncate(8192 + (192 << 10) + 4096 + (64 << 10))
    return head + bytes(192 << 10) + mid + bytes(64 << 10)


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar is needed to write sparse tars")
@pytest.mark.parametrize("fmt", [["--format=gnu"],
                                 ["--format=posix", "--sparse-version=0.0"],
                                 ["--format=posix", "--sparse-version=0.1"],
                                 ["--format=posix", "--sparse-version=1.0"]])
def test_webdataset_reads_gnu_tar_sparse_members_like_tarfile(tmp_path, fmt):
    rng = np.random.default_rng(0)
    work = tmp_path / "files"
    work.mkdir()
    expected = {}
    names = []
    for k in range(3):  # sample k: a sparse .bin, then a regular .txt and a big .dat after it
        key = f"{k:06d}"
        expected[key] = {"bin": _holey(work / f"{key}.bin", rng),
                         "txt": f"sample {k}".encode(), "dat": rng.bytes(300 << 10)}
        (work / f"{key}.txt").write_bytes(expected[key]["txt"])
        (work / f"{key}.dat").write_bytes(expected[key]["dat"])
        names += [f"{key}.bin", f"{key}.txt", f"{key}.dat"]
    shard = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", *fmt, "-cf", str(shard), "-C", str(work), *names],
                   check=True)
    with tarfile.open(shard) as tar:
        assert all(m.issparse() for m in tar if m.name.endswith(".bin")), "tar wrote no holes"
    assert _tarfile_samples(shard) == expected  # tarfile's own extraction agrees
    src = sources.webdataset(str(shard))
    assert _samples(src) == expected


# -- webdataset: links and other member kinds ----------------------------------------------------
def test_webdataset_reads_links_to_earlier_files_as_their_bytes(tmp_path):
    shard = tmp_path / "links.tar"
    with tarfile.open(shard, "w") as tar:
        _add(tar, "d/000000.jpg", b"jpeg bytes 0")
        _add(tar, "d/000000.txt", b"caption 0")
        _add(tar, "d/000001.txt", b"caption 1")
        _link(tar, "d/000001.jpg", "d/000000.jpg", tarfile.LNKTYPE)  # hard: archive path
        _link(tar, "d/000002.jpg", "000000.jpg", tarfile.SYMTYPE)    # symbolic: relative
        _add(tar, "d/000002.txt", b"caption 2" * 20_000)  # the link's span would be too wide
    got = _samples(sources.webdataset(str(shard)))
    assert got == {"d/000000": {"jpg": b"jpeg bytes 0", "txt": b"caption 0"},
                   "d/000001": {"txt": b"caption 1", "jpg": b"jpeg bytes 0"},
                   "d/000002": {"jpg": b"jpeg bytes 0", "txt": b"caption 2" * 20_000}}
    assert got == _tarfile_samples(shard)
    dotted = tmp_path / "dotted.tar"  # what `tar -cf x.tar .` writes: names under ./
    with tarfile.open(dotted, "w") as tar:
        _add(tar, "./d/000000.jpg", b"jpeg")
        _link(tar, "./d/000001.jpg", "./d/000000.jpg", tarfile.LNKTYPE)
        _link(tar, "./d/000002.jpg", "../d/000000.jpg", tarfile.SYMTYPE)
    assert [s["jpg"] for s in _samples(sources.webdataset(str(dotted))).values()] == \
        [b"jpeg"] * 3


@pytest.mark.parametrize("name, target, kind, said", [
    ("000001.jpg", "/etc/hostname", tarfile.SYMTYPE, "is a symbolic link to the absolute path"),
    ("000001.jpg", "000002.jpg", tarfile.SYMTYPE, "is a symbolic link to '000002.jpg', which "
                                                  "is not a file stored earlier"),
    ("000001.jpg", "../outside.jpg", tarfile.SYMTYPE, "is a symbolic link to '../outside.jpg'"),
    ("000001.jpg", "nope.jpg", tarfile.LNKTYPE, "is a hard link to 'nope.jpg'"),
    ("000001.jpg", "", tarfile.FIFOTYPE, "is a fifo, not a file"),
    ("000001.jpg", "", tarfile.CHRTYPE, "is a character device, not a file"),
])
def test_webdataset_refuses_members_it_cannot_read_from_the_shard(tmp_path, name, target,
                                                                   kind, said):
    shard = tmp_path / "odd.tar"
    with tarfile.open(shard, "w") as tar:
        _add(tar, "000000.jpg", b"jpeg")
        _link(tar, name, target, kind)
        _add(tar, "000002.jpg", b"later")
    with pytest.raises(SourceError, match=rf"odd\.tar: member '{name}' {said}"):
        sources.webdataset(str(shard))


def test_webdataset_duplicate_member_in_one_sample_is_named(tmp_path):
    shard = tmp_path / "dup.tar"
    with tarfile.open(shard, "w") as tar:
        _add(tar, "000000.txt", b"a")
        _add(tar, "000001.txt", b"first")
        _add(tar, "000001.json", b"{}")
        _add(tar, "000001.txt", b"second")
    with pytest.raises(SourceError, match=r"dup\.tar: sample '000001' has two members with "
                                          r"extension 'txt'"):
        sources.webdataset(str(shard))


@pytest.mark.parametrize("mode, codec, name", [("w:gz", "gzip", "s.tar.gz"),
                                               ("w:gz", "gzip", "s.tgz"),
                                               ("w:bz2", "bzip2", "s.tar"),
                                               ("w:xz", "xz", "s.tar")])
def test_webdataset_compressed_shard_says_to_decompress(tmp_path, mode, codec, name):
    with tarfile.open(tmp_path / name, mode) as tar:
        _add(tar, "000000.txt", b"x" * 1000)
    with pytest.raises(SourceError, match=rf"{name} is {codec}-compressed: .*decompress it to "
                                          rf"a plain \.tar"):
        sources.webdataset(str(tmp_path / name))


def test_webdataset_glob_matching_a_directory_is_refused(tmp_path):
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        _add(tar, "000000.txt", b"x")
    (tmp_path / "b.tar").mkdir()
    with pytest.raises(SourceError, match=r"webdataset: .*b\.tar is a directory; a file is "
                                          r"needed"):
        sources.webdataset(str(tmp_path / "*.tar"))


# -- token files ---------------------------------------------------------------------------------
_LIVE = textwrap.dedent("""
    import os, sys
    import numpy as np
    from zephon import Pipeline, RuntimeOptions, sources

    def main(path, runner):
        src = sources.token_windows(path, seq_len=256)
        pipe = (Pipeline(src, shuffle=False, chunk_size=16).batch(4)
                .options(RuntimeOptions(runner=runner, max_workers=2)))
        tokens = np.fromfile(path, dtype=np.uint16)
        it = iter(pipe)
        first = next(it)["tokens"]
        assert np.array_equal(first.ravel(), tokens[:4 * 256])
        os.truncate(path, 2 * 4 * 256 * 2)  # two batches' worth of tokens remain
        got = 1
        try:
            for batch in it:
                got += 1
        except Exception as exc:
            print("ERROR", type(exc).__name__, exc)
        else:
            print("NO ERROR after", got, "batches")
        finally:
            it.close()

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
    """)


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_token_file_truncated_under_a_live_pipeline_is_a_source_error(tmp_path, runner):
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 50_000, 4096 * 256, dtype=np.uint16).tofile(path)
    script = tmp_path / "live.py"
    script.write_text(_LIVE)
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, str(script), str(path), runner], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # no SIGBUS (-7)
    assert "ERROR" in run.stdout and "train.bin" in run.stdout, run.stdout
    assert ("its size changed from 2097152 to 4096 bytes" in run.stdout
            or "truncated" in run.stdout), run.stdout


def test_token_file_rewritten_or_replaced_after_building_is_named(tmp_path):
    import pickle

    path = tmp_path / "t.bin"
    np.arange(4096, dtype=np.uint16).tofile(path)
    src = sources.token_windows(str(path), seq_len=64)
    assert src.get(3)["tokens"][0] == 192
    os.utime(path, ns=(1, 1))  # rewritten in place: same size, another mtime
    with pytest.raises(SourceError, match=r"t\.bin, window 5: the file changed after the "
                                          r"source was built: it was modified"):
        src.get(5)
    fresh = sources.token_windows(str(path), seq_len=64)
    np.arange(4096, dtype=np.uint16)[::-1].copy().tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", path)  # replaced: another inode
    moved = pickle.loads(pickle.dumps(fresh))  # what a worker process gets
    with pytest.raises(SourceError, match=r"t\.bin, window 0: .*replaced by another file"):
        moved.get(0)


def test_token_windows_refuses_wrong_paths_and_lengths(tmp_path):
    with pytest.raises(SourceError, match=rf"token_windows: {tmp_path} is a directory; a file "
                                          rf"is needed"):
        sources.token_windows(str(tmp_path), seq_len=4)
    with pytest.raises(SourceError, match=r"cannot read .*missing\.bin: .*No such file"):
        sources.token_windows(str(tmp_path / "missing.bin"), seq_len=4)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 1001)
    with pytest.raises(SourceError, match=r"odd\.bin: 1001 bytes of tokens is not a multiple "
                                          r"of 2 \(uint16\)"):
        sources.token_windows(str(tmp_path / "odd.bin"), seq_len=4)
    np.save(tmp_path / "short.npy", np.arange(100, dtype=np.uint32))
    data = (tmp_path / "short.npy").read_bytes()
    (tmp_path / "short.npy").write_bytes(data[:-40])
    with pytest.raises(SourceError, match=r"short\.npy: the \.npy header says 100 tokens of "
                                          r"uint32, the file holds 360 bytes"):
        sources.token_windows(str(tmp_path / "short.npy"), seq_len=4, dtype=None)
    bad = bytearray(data)
    bad[10:11] = b"("  # the header dict's opening brace
    (tmp_path / "bad.npy").write_bytes(bytes(bad))
    with pytest.raises(SourceError, match=r"bad\.npy: unreadable \.npy header"):
        sources.token_windows(str(tmp_path / "bad.npy"), seq_len=4, dtype=None)


# -- jsonl ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["zst", "gz"])
def test_jsonl_compressed_file_is_bounded_in_decompressed_size(tmp_path, codec):
    import zstandard

    body = b'{"pad": "' + b"x" * (16 << 20) + b'"}\n'  # 16 MiB from a few KiB
    path = tmp_path / f"bomb.jsonl.{codec}"
    path.write_bytes(zstandard.ZstdCompressor().compress(body) if codec == "zst"
                     else gzip.compress(body))
    assert path.stat().st_size < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(SourceError, match=rf"bomb\.jsonl\.{codec} decompresses to more "
                                              rf"than max_decompressed_bytes=4194304 bytes"):
            sources.jsonl(str(path), max_decompressed_bytes=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # never the whole stream
    assert len(sources.jsonl(str(path), max_decompressed_bytes=32 << 20)) == 1


def test_jsonl_index_is_built_in_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        for i in range(120_000):
            fh.write(json.dumps({"i": i, "text": "lorem ipsum " * 32}) + "\n")
            if i % 1000 == 0:
                fh.write("   \n\n")  # blank lines are not samples
    size = path.stat().st_size
    assert size > 40 << 20
    tracemalloc.start()
    try:
        src = sources.jsonl(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(src) == 120_000
    assert src.get(0)["i"] == 0 and src.get(1000)["i"] == 1000 and src.get(119_999)["i"] == 119_999
    assert int(src.line_no[1001]) == 1001 + 1 + 2 * 2  # blank lines after i=0 and i=1000
    assert peak < size // 2, (peak, size)  # the index and a few blocks, never the file


def test_jsonl_lines_across_blocks_and_without_newline(tmp_path):
    jsonl_module = sys.modules["zephon.pipeline.sources.jsonl"]

    long = json.dumps({"big": "y" * (5 << 20)})  # spans several read blocks
    text = '{"a": 1}\r\n' + " " * (3 << 20) + "\n" + long + "\n\n" + '{"z": 2}'
    (tmp_path / "x.jsonl").write_text(text)
    src = sources.jsonl(str(tmp_path / "x.jsonl"))
    assert jsonl_module._BLOCK < len(long)
    assert len(src) == 3 and src.get(0) == {"a": 1} and src.get(2) == {"z": 2}
    assert src.get(1)["big"] == "y" * (5 << 20)
    assert src.line_no.tolist() == [1, 3, 5]


def test_jsonl_parse_errors_name_file_line_and_byte(tmp_path):
    deep = '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"
    lines = ['{"ok": 1}', deep, "[1, 2]", '{"bad": \xff}', "\n"]
    (tmp_path / "p.jsonl").write_bytes("\n".join(lines[:3]).encode() + b"\n" +
                                       b'{"bad": \xff}\n')
    src = sources.jsonl(str(tmp_path / "p.jsonl"))
    second = len(lines[0]) + 1
    with pytest.raises(SourceError, match=rf"p\.jsonl, line 2: nested too deeply to parse .*; "
                                          rf"the line starts at byte {second}$"):
        src.get(1)
    third = second + len(deep) + 1
    with pytest.raises(SourceError, match=rf"p\.jsonl, line 3: expected an object, got list; "
                                          rf"the line starts at byte {third}$"):
        src.get(2)
    with pytest.raises(SourceError, match=r"p\.jsonl, line 4: invalid JSON .*; the line "
                                          rf"starts at byte {third + 7}$"):
        src.get(3)


def test_jsonl_glob_matching_a_directory_is_refused(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"i": 1}\n')
    (tmp_path / "b.jsonl").mkdir()
    with pytest.raises(SourceError, match=r"jsonl: .*b\.jsonl is a directory; a file is needed"):
        sources.jsonl(str(tmp_path / "*.jsonl"))


# -- hugging face datasets -----------------------------------------------------------------------
_HF_LIVE = textwrap.dedent("""
    import os, sys
    from zephon import sources

    src = sources.hf_dataset(sys.argv[1])
    assert src.get(3)["text"] == "row 3"
    (arrow,) = [os.path.join(sys.argv[1], f) for f in os.listdir(sys.argv[1])
                if f.endswith(".arrow")]
    os.truncate(arrow, 1024)
    try:
        src.get(len(src) - 1)
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc)
    else:
        print("NO ERROR")
    """)


def test_hf_dataset_arrow_file_truncated_after_building_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(20_000)]}).save_to_disk(
        str(tmp_path / "saved"))
    script = tmp_path / "hf_live.py"
    script.write_text(_HF_LIVE)
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "saved")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # no SIGBUS
    assert "ERROR SourceError" in run.stdout, run.stdout
    assert ".arrow, row 19999: the file changed after the source was built: its size " \
           "changed" in run.stdout, run.stdout


def test_hf_dataset_path_of_the_wrong_kind_is_named(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "file.arrow").write_bytes(b"x")
    with pytest.raises(SourceError, match=r"file\.arrow is a file; load_from_disk needs the "
                                          r"directory written by Dataset\.save_to_disk"):
        sources.hf_dataset(str(tmp_path / "file.arrow"))
    with pytest.raises(SourceError, match=r"nowhere does not exist; load_from_disk"):
        sources.hf_dataset(str(tmp_path / "nowhere"))


def test_jsonl_readers_hold_at_most_max_decompressed_bytes(tmp_path):
    import zstandard

    for name in ("a", "b", "c"):
        body = "".join(json.dumps({"f": name, "i": i, "pad": "p" * 900}) + "\n"
                       for i in range(100)).encode()  # about 92 KB each
        (tmp_path / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    src = sources.jsonl(str(tmp_path / "*.jsonl.zst"), max_decompressed_bytes=200_000)
    assert [src.get(i)["f"] for i in (0, 100, 200, 5, 150)] == ["a", "b", "c", "a", "b"]
    held = src._plain
    assert list(held) == [0, 1] and sum(len(v) for v in held.values()) <= 200_000
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"x": 1}\n'))
    with pytest.raises(SourceError, match=r"c\.jsonl\.zst, line 1: the file changed after the "
                                          r"source was built"):
        src.get(200)


def test_webdataset_cached_index_of_an_older_layout_is_rebuilt(tmp_path):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _s3_server import BUCKET, MotoServer, storage_options

    from zephon import StoreOptions
    from zephon.io import FileCache, IoConfig
    from zephon.pipeline.sources.webdataset import _INDEX_LAYOUT

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        _add(tar, "000000.txt", b"zero")
        _add(tar, "000001.txt", b"one")
    server = MotoServer()
    try:
        server.put("old/shard.tar", buf.getvalue())
        opts = StoreOptions(cache_enabled=True, cache_root=str(tmp_path / "cache"))
        url, so = f"s3://{BUCKET}/old/shard.tar", storage_options(server.endpoint)
        src = sources.webdataset(url, storage_options=so, io_options=opts)
        cache = FileCache(IoConfig.from_store_options(opts), so)
        stored = json.loads(cache.get_derived(src.refs[0], "wdsidx"))
        assert stored["layout"] == _INDEX_LAYOUT
        older = {"keys": stored["keys"],  # what the 3-field layout wrote: [ext, offset, size]
                 "members": [[m[:3] for m in group] for group in stored["members"]]}
        cache.put_derived(src.refs[0], "wdsidx", json.dumps(older).encode())
        again = sources.webdataset(url, storage_options=so, io_options=opts)
        assert [again.get(i)["txt"] for i in range(2)] == [b"zero", b"one"]
        assert json.loads(cache.get_derived(src.refs[0], "wdsidx"))["layout"] == _INDEX_LAYOUT
    finally:
        server.stop()
