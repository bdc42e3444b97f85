"""The shared index as jsonl, parquet and array_record use it (tests/test_index_shared.py
attacks it through webdataset): an entry forged with its checksum recomputed never makes a
source deliver other data than the file holds, a file is one entry however its path is
written, and a build stopped with Ctrl-C ends at once, leaving no process behind."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _procs import wait_gone
from _tars import write_many
from test_index_shared import kill_group, start

from zephon import sources
from zephon.io.errors import SourceError
from zephon.io.index import IndexStore


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_many(tmp_path_factory.mktemp("many"))


def forge(directory: str, kind: str, layout: int, name: str, edit) -> IndexStore:
    """Edit file ``name``'s entry (and its blob) with the module's own writers: the .zidx
    checksum recomputed, as a forger who knows the format would."""
    store = IndexStore(os.path.join(directory, "_zephon_index"), kind, layout, True)
    entry = store.load()[name]
    edit(store, entry)
    store.save({name: entry})
    return store


def _lines(path: str, n: int = 6) -> None:
    with (gzip.open if path.endswith(".gz") else open)(path, "wt") as fh:
        for i in range(n):
            fh.write(json.dumps({"i": i, "pad": "x" * i}) + "\n")


def _table_edit(change):
    def edit(store, entry):
        table = np.frombuffer(store.get_blob(entry[3], "t"), dtype=np.int64).reshape(3, -1)
        table = change(table.copy())
        entry[2]["lines"] = table.shape[1]
        entry[3] = store.put_blob(np.ascontiguousarray(table).tobytes())
    return edit


def _duplicate(table):  # line 2 listed twice, line 1 gone
    table[:, 1] = table[:, 2]
    return table


def _drop(table):  # line 1 left out (every other line where it was)
    return np.delete(table, 1, axis=1)


@pytest.mark.parametrize("suffix, change", [(".jsonl", _duplicate), (".jsonl.gz", _duplicate),
                                            (".jsonl.gz", _drop)])
def test_a_forged_jsonl_line_table_fails_naming_the_index(tmp_path, suffix, change):
    d = str(tmp_path)
    path = os.path.join(d, "a" + suffix)
    _lines(path)
    truth = [sources.jsonl(path, index=False).get(i) for i in range(6)]
    sources.jsonl(path)
    store = forge(d, "jsonl", 1, "a" + suffix, _table_edit(change))
    src = sources.jsonl(path)
    assert src.index_counts == (1, 0)
    with pytest.raises(SourceError, match=store.top):
        got = [src.get(i) for i in range(len(src))]
        assert got == truth, f"delivered {got}"


def test_a_forged_parquet_entry_fails_naming_the_index(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"id": list(range(40))}), path, row_group_size=10)
    sources.parquet(path)

    def drop_last_group(store, entry):
        entry[2]["groups"].pop()

    store = forge(str(tmp_path), "parquet", 1, "t.parquet", drop_last_group)
    src = sources.parquet(path)
    assert src.index_counts == (1, 0) and len(src) == 30
    with pytest.raises(SourceError, match=store.top):
        src.get(0)


def test_a_forged_array_record_count_fails_naming_the_index(tmp_path):
    ar = pytest.importorskip("array_record.python.array_record_module")
    path = str(tmp_path / "r.array_record")
    writer = ar.ArrayRecordWriter(path, "group_size:1")
    for i in range(20):
        writer.write(b"%d" % i)
    writer.close()
    assert sources.array_record(path, index=False).index_counts == (0, 1)
    sources.array_record(path)

    def more(store, entry):
        entry[2]["records"] += 5

    store = forge(str(tmp_path), "array_record", 1, "r.array_record", more)
    src = sources.array_record(path)
    assert src.index_counts == (1, 0)
    with pytest.raises(SourceError, match=store.top):
        src.get(0)


def test_a_file_has_one_entry_however_its_path_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _lines("a.jsonl")
    assert sources.jsonl("a.jsonl").index_counts == (0, 1)
    assert sources.jsonl(str(tmp_path / "a.jsonl")).index_counts == (1, 0)
    assert sources.jsonl(f"file://{tmp_path}/a.jsonl").index_counts == (1, 0)
    store = IndexStore(str(tmp_path / "_zephon_index"), "jsonl", 1, False)
    assert list(store.load()) == ["a.jsonl"]


def test_ctrl_c_stops_a_build_at_once_and_leaves_no_process(shards, tmp_path):
    index = str(tmp_path / "idx")
    proc = start(["-m", "zephon", "index", shards, "--index", index, "--workers", "2",
                  "--save-every", "0.2"])
    try:
        deadline = time.monotonic() + 120
        top = os.path.join(index, "webdataset.zidx")
        while not os.path.exists(top) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the build ended before Ctrl-C"
        children = [int(p) for p in os.listdir("/proc")
                    if p.isdigit() and _parent(p) == proc.pid]
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        proc.wait(30)
        assert proc.returncode != 0
        assert wait_gone(children, 10.0) == []
    finally:
        kill_group(proc)
    files = IndexStore(index, "webdataset", 4, False).load()  # what was saved is intact
    assert 0 < len(files) <= 240


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_the_cli_indexes_array_record_files(tmp_path):
    ar = pytest.importorskip("array_record.python.array_record_module")
    for k in range(3):
        writer = ar.ArrayRecordWriter(str(tmp_path / f"r{k}.array_record"), "group_size:1")
        for i in range(10):
            writer.write(b"%d-%d" % (k, i))
        writer.close()
    out = subprocess.run([sys.executable, "-m", "zephon", "index", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "array_record: 3 files, 30 samples: 3 scanned" in out.stdout
    assert sources.array_record(str(tmp_path)).index_counts == (3, 0)
