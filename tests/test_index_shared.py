"""The shared index (zephon/io/index.py) as webdataset uses it, attacked as a user would.

Real tar shards, real processes (``python -m zephon index`` and rank processes from
tests/_index_ranks.py), a real S3 server (moto, tests/_s3_server.py): nothing of the index is
mocked. Every test that starts processes kills what is left of them (their whole process
group) when it ends, passed or failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid

import pytest
from _index_ranks import digest
from _procs import alive, wait_gone
from _s3_server import BUCKET, s3, storage_options  # noqa: F401 (s3: the fixture)
from _tars import tar_bytes, write_many

from zephon import sources
from zephon.io.errors import SourceError
from zephon.io.index import IndexStore
from zephon.pipeline.sources.webdataset import _INDEX_LAYOUT

RANKS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_index_ranks.py")
TIMEOUT = 120


# -- shards ---------------------------------------------------------------------------------

def shard_members(k: int, samples: int = 3, tag: str = "a") -> list:
    """Sample ``j`` of shard ``k``: ``.txt`` (12 bytes, the same size in every sample) and
    ``.cls`` (1 byte): two members of equal size are what a forged offset could swap."""
    out = []
    for j in range(samples):
        key = f"{tag}{k:04d}_{j:03d}"
        out += [(f"{key}.txt", f"{tag}{k:05d}{j:06d}".encode()[:12].ljust(12, b"_")),
                (f"{key}.cls", str(j % 10).encode())]
    return out


def write_shards(directory, n: int, samples: int = 3, tag: str = "a") -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for k in range(n):
        path = os.path.join(str(directory), f"shard-{k:04d}.tar")
        with open(path, "wb") as fh:
            fh.write(tar_bytes(shard_members(k, samples, tag)))
        paths.append(path)
    return paths


def store_of(directory) -> IndexStore:
    return IndexStore(os.path.join(str(directory), "_zephon_index"), "webdataset",
                      _INDEX_LAYOUT, True)


def top_of(directory) -> str:
    return os.path.join(str(directory), "_zephon_index", "webdataset.zidx")


def forge(store: IndexStore, name: str, edit) -> None:
    """Edit the member table of ``name``: the blob re-written under its new SHA-256 name, the
    entry pointed at it, the .zidx re-written with its checksum recomputed (the module's
    own writers: a forger who knows the format)."""
    entry = store.load()[name]
    table = store.get_blob(entry[3], name)
    edit(table)
    entry[3] = store.put_blob(table)
    store.save({name: entry})


def flip(path: str, at: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x01
    with open(path, "wb") as fh:
        fh.write(data)


# -- processes ------------------------------------------------------------------------------

def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it was started in a session of its own), and
    reap ``proc``; then remove the named semaphores the killed processes left in /dev/shm
    (multiprocessing's resource tracker, which unlinks them, died with the group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)
    before = getattr(proc, "shm_before", None)
    if before is not None:
        _remove_orphan_semaphores(before)


def _semaphores() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")} \
        if os.path.isdir("/dev/shm") else set()


def _remove_orphan_semaphores(before: set[str]) -> None:
    """Unlink the ``sem.mp-*`` entries that appeared since ``before`` and that no live
    process maps (a named semaphore in use is mapped: /proc/PID/maps names it)."""
    new = _semaphores() - before
    if not new:
        return
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/maps") as fh:
                    mapped.update(line.rsplit("/", 1)[-1].strip() for line in fh
                                  if "/dev/shm/sem.mp-" in line)
    for name in new - mapped:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))


def start(args: list, **kw) -> subprocess.Popen:
    before = _semaphores()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    proc.shm_before = before  # type: ignore[attr-defined]  # for kill_group
    return proc


def zephon_index(*args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``python -m zephon index ARGS`` to its end; its whole process group is killed after."""
    proc = start(["-m", "zephon", "index", *map(str, args)])
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def counted(result: subprocess.CompletedProcess) -> tuple[int, int]:
    """(scanned, already in the index) from the CLI's last line."""
    assert result.returncode == 0, result.stderr
    m = re.search(r"(\d+) scanned, (\d+) already in the index", result.stdout)
    assert m, result.stdout
    return int(m.group(1)), int(m.group(2))


def run_script(args: list, timeout: float = TIMEOUT, **kw) -> dict:
    proc = start([RANKS_SCRIPT, *map(str, args)], **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_ranks(specs: list[str], barrier) -> list[dict]:
    """One rank process per shard spec, started together (a barrier in the ranks: they build
    at once); each one's JSON report."""
    os.makedirs(barrier, exist_ok=True)
    procs = []
    try:
        for r, spec in enumerate(specs):
            procs.append(start([RANKS_SCRIPT, "rank", spec, "--barrier", str(barrier),
                                "--ranks", str(len(specs)), "--rank", str(r)]))
        deadline = time.monotonic() + TIMEOUT
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


# -- built once, read by all ----------------------------------------------------------------

def test_a_first_build_scans_every_shard_and_a_second_opens_none(tmp_path):
    paths = write_shards(tmp_path / "d", 12)
    d = str(tmp_path / "d")
    first = sources.webdataset(d + "/")
    assert first.index_counts == (0, 12)
    assert first.index_store.top == top_of(d)
    assert sorted(store_of(d).load()) == [os.path.basename(p) for p in paths]
    truth = digest(sources.webdataset(d + "/", index=False))
    assert digest(first) == truth

    # another process: opens nothing of the data but the .zidx to build; then, to read sample
    # i, its shard and its blob once; a second sample of that shard opens nothing more
    got = run_script(["opens", d + "/", "--read", "7,8,30"])
    assert got["counts"] == [12, 0]
    assert got["objects_read"] == 1
    assert got["build_opens"] == [top_of(d)]
    blob_dir = os.path.join(d, "_zephon_index", "webdataset") + os.sep
    r7, r8, r30 = got["reads"]
    assert r7["key"] == "a0002_001" and r30["key"] == "a0010_000"
    for read, shard in ((r7, paths[2]), (r30, paths[10])):
        assert [p for p in read["opens"] if p.endswith(".tar")] == [shard]
        blobs = [p for p in read["opens"] if p.startswith(blob_dir) and p.endswith(".zblob")]
        assert len(blobs) == 1 and len(read["opens"]) == 2, read["opens"]
        assert read["objects_read"] == 1
    assert r8["opens"] == [] and r8["objects_read"] == 0  # the same shard: already open


def test_eight_ranks_share_an_index_built_ahead_by_the_cli(tmp_path):
    d = str(tmp_path / "d")
    write_shards(d, 16)
    scanned, already = counted(zephon_index(d, "--workers", "2"))
    assert (scanned, already) == (16, 0)
    truth = digest(sources.webdataset(d + "/", index=False))
    reports = run_ranks([d + "/"] * 8, tmp_path / "barrier")
    assert len({r["pid"] for r in reports}) == 8
    for r in reports:
        assert r["counts"] == [16, 0]           # no rank scanned a shard
        assert r["objects_read"] == 1           # the .zidx, once
        assert r["build_opens"] == [top_of(d)]  # and opened no shard to build
        assert r["digest"] == truth             # and reads what index=False reads
    assert max(r["start"] for r in reports) - min(r["start"] for r in reports) < 5.0


def test_eight_ranks_building_at_once_with_no_index_merge_into_one(tmp_path):
    d = str(tmp_path / "d")
    paths = write_shards(d, 16)
    # every rank builds over its own shards of one directory: the index ends up complete only
    # if every concurrent writer's entries were merged, none lost to another's write
    subsets = [paths[r::8] for r in range(8)]
    truths = [digest(sources.webdataset(s, index=False)) for s in subsets]
    assert not os.path.exists(top_of(d))
    reports = run_ranks([",".join(s) for s in subsets], tmp_path / "barrier")
    for r, subset, truth in zip(reports, subsets, truths, strict=True):
        assert r["counts"] == [0, len(subset)]
        assert r["digest"] == truth
    files = store_of(d).load()  # intact: checksum and body (a torn write is refused)
    assert sorted(files) == [os.path.basename(p) for p in paths]
    for p in paths:
        assert files[os.path.basename(p)][:2] == [os.path.getsize(p),
                                                 f"mtime:{os.stat(p).st_mtime_ns}"]
    index_dir = os.path.join(d, "_zephon_index")
    left = [n for _, _, names in os.walk(index_dir) for n in names if n.startswith(".part-")]
    assert left == []
    again = sources.webdataset(d + "/")
    assert again.index_counts == (16, 0)
    assert digest(again) == digest(sources.webdataset(d + "/", index=False))


# -- changes --------------------------------------------------------------------------------

def test_a_changed_shard_is_the_only_one_rescanned_and_its_new_contents_read(tmp_path):
    d = str(tmp_path / "d")
    paths = write_shards(d, 8)
    assert sources.webdataset(d + "/").index_counts == (0, 8)
    with open(paths[2], "wb") as fh:  # rewritten: other samples, other size
        fh.write(tar_bytes(shard_members(2, samples=5, tag="new")))
    st = os.stat(paths[5])  # touched: the same bytes, another mtime
    os.utime(paths[5], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    src = sources.webdataset(d + "/")
    assert src.index_counts == (6, 2)
    assert len(src) == 7 * 3 + 5
    assert [src.get(i)["__key__"] for i in range(6, 11)] == [f"new0002_{j:03d}" for j in range(5)]
    assert src.get(6)["txt"] == b"new000020000"
    assert digest(src) == digest(sources.webdataset(d + "/", index=False))
    assert sources.webdataset(d + "/").index_counts == (8, 0)  # the index learnt both


def test_entries_naming_other_versions_are_rescanned_not_trusted(tmp_path):
    d = str(tmp_path / "d")
    paths = write_shards(d, 6)
    sources.webdataset(d + "/")
    store = store_of(d)
    files = store.load()
    n0, n1, n3 = (os.path.basename(paths[k]) for k in (0, 1, 3))
    other = files[n3]  # shard 3's facts and member table, put under other names
    store.save({n0: [files[n0][0], "mtime:12345", other[2], other[3]],   # another mtime
                n1: [files[n1][0] + 512, files[n1][1], other[2], other[3]]})  # another size
    src = sources.webdataset(d + "/")
    assert src.index_counts == (4, 2)
    assert digest(src) == digest(sources.webdataset(d + "/", index=False))
    assert [src.get(i)["__key__"] for i in (0, 3)] == ["a0000_000", "a0001_000"]
    assert store.load()[n0][:2] == [os.path.getsize(paths[0]),
                                    f"mtime:{os.stat(paths[0]).st_mtime_ns}"]


# -- refused when forged --------------------------------------------------------------------

@pytest.mark.parametrize("where", ["body", "checksum", "format line"])
def test_a_flipped_byte_of_the_zidx_is_refused_naming_it(tmp_path, where):
    d = str(tmp_path / "d")
    write_shards(d, 4)
    sources.webdataset(d + "/")
    top = top_of(d)
    head = open(top, "rb").read().index(b"\n")
    flip(top, {"body": head + 40, "checksum": head - 3, "format line": 2}[where])
    with pytest.raises(SourceError, match=re.escape(top) + r".*refused.*rebuild"):
        sources.webdataset(d + "/")
    with pytest.raises(SourceError, match=re.escape(top)):
        sources.webdataset(d + "/", index=str(tmp_path / "d" / "_zephon_index"))
    assert len(sources.webdataset(d + "/", index=False)) == 12  # no index: still readable


def test_the_advised_rebuild_repairs_a_refused_zidx(tmp_path):
    d = str(tmp_path / "d")
    write_shards(d, 4)
    sources.webdataset(d + "/")
    flip(top_of(d), 100)
    result = zephon_index(d, "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert sources.webdataset(d + "/").index_counts == (4, 0)


def _shift(table):  # the first member 100 bytes on: no tar header before it
    table["members"][0][0][1] += 100


def _shift1(table):  # the first member one byte on (its name and data start alike: 'a')
    table["members"][0][0][1] += 1


def _other_size(table):  # the .txt pointed at its sample's .cls (a member of another size)
    table["members"][0][0][1] = table["members"][0][1][1]


def _same_size(table):  # sample 0's members pointed at sample 1's (members of the same sizes)
    for mine, theirs in zip(table["members"][0], table["members"][1], strict=True):
        mine[1] = theirs[1]


def _second_member(table):  # sample 0's .cls pointed into the data of its .txt
    table["members"][0][1][1] = table["members"][0][0][1]


def _key(table):  # sample 0 renamed
    table["keys"][0] = "forged"


def _twice(table):  # sample 0 again in place of sample 1 (a sample delivered twice)
    table["keys"][1] = table["keys"][0]
    table["members"][1] = [list(m) for m in table["members"][0]]


def _count(table):  # one sample fewer than the .zidx entry says
    table["keys"].pop()
    table["members"].pop()


@pytest.mark.parametrize("edit", [
    _shift, _other_size, _shift1, _same_size, _second_member, _key, _twice, _count,
], ids=lambda f: f.__name__.strip("_"))
def test_an_entry_forged_with_its_checksum_recomputed_never_delivers_other_bytes(tmp_path,
                                                                                  edit):
    d = str(tmp_path / "d")
    paths = write_shards(d, 3)
    truth = sources.webdataset(d + "/", index=False)
    sources.webdataset(d + "/")
    forge(store_of(d), os.path.basename(paths[0]), edit)
    src = sources.webdataset(d + "/")  # the .zidx is intact: the build trusts it
    assert src.index_counts == (3, 0)
    with pytest.raises(SourceError, match=re.escape(top_of(d))):
        got = [src.get(0), src.get(1)]
        assert got == [truth.get(0), truth.get(1)], f"delivered {got}"
    assert src.get(3) == truth.get(3)  # the other shards are not affected


def test_an_altered_or_missing_blob_is_refused_naming_it(tmp_path):
    d = str(tmp_path / "d")
    paths = write_shards(d, 3)
    sources.webdataset(d + "/")
    files = store_of(d).load()
    blob = os.path.join(d, "_zephon_index", "webdataset",
                        files[os.path.basename(paths[1])][3] + ".zblob")
    flip(blob, 7)
    src = sources.webdataset(d + "/")
    assert src.index_counts == (3, 0)  # blobs are read when their shard is
    assert src.get(0)["__key__"] == "a0000_000"
    with pytest.raises(SourceError, match=re.escape(blob) + r".*" + re.escape(paths[1]) +
                       r".*refused"):
        src.get(3)
    os.unlink(blob)
    with pytest.raises(SourceError, match=re.escape(blob) + r".*missing"):
        sources.webdataset(d + "/").get(4)


def test_the_advised_rebuild_repairs_an_altered_blob(tmp_path):
    d = str(tmp_path / "d")
    paths = write_shards(d, 3)
    sources.webdataset(d + "/")
    entry = store_of(d).load()[os.path.basename(paths[1])]
    flip(os.path.join(d, "_zephon_index", "webdataset", entry[3] + ".zblob"), 7)
    assert zephon_index(d, "--workers", "1").returncode == 0
    assert sources.webdataset(d + "/").get(3)["__key__"] == "a0001_000"


# -- local writes ---------------------------------------------------------------------------

def _without_dac_override() -> None:
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that
    root, exec'ing, honours file modes like any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux capabilities")
def test_a_read_only_dataset_directory_still_builds(tmp_path):
    """index=None on a directory the rank cannot write: the build scans and reads; the index
    it could not write only costs the next build a scan."""
    d = str(tmp_path / "d")
    write_shards(d, 3)
    os.chmod(d, 0o555)
    try:
        kw = {"preexec_fn": _without_dac_override} if os.geteuid() == 0 else {}
        got = run_script(["opens", d + "/", "--read", "4"], **kw)
    finally:
        os.chmod(d, 0o755)
    assert got["counts"] == [0, 3]
    assert got["reads"][0]["key"] == "a0001_001"


def test_index_files_are_as_readable_as_the_umask_makes_files(tmp_path):
    d = str(tmp_path / "d")
    write_shards(d, 2)
    old = os.umask(0o022)
    try:
        sources.webdataset(d + "/")
    finally:
        os.umask(old)
    index_dir = os.path.join(d, "_zephon_index")
    modes = {os.path.relpath(os.path.join(r, n), index_dir): stat.S_IMODE(os.stat(
        os.path.join(r, n)).st_mode) for r, _, names in os.walk(index_dir) for n in names
        if not n.endswith(".lock")}
    assert modes and set(modes.values()) == {0o644}, modes


# -- a killed build -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def many(tmp_path_factory):
    return write_many(tmp_path_factory.mktemp("many"))


def _entries(store: IndexStore) -> int:
    with contextlib.suppress(SourceError):
        return len(store.load())
    return -1


def test_a_killed_build_resumes_where_it_was(many, tmp_path):
    index = str(tmp_path / "idx")
    store = IndexStore(index, "webdataset", _INDEX_LAYOUT, True)
    proc = start(["-m", "zephon", "index", many, "--index", index, "--workers", "2",
                  "--save-every", "0.2"])
    try:
        deadline, saved = time.monotonic() + TIMEOUT, 0
        while time.monotonic() < deadline and proc.poll() is None:
            saved = _entries(store) if os.path.exists(store.top) else 0
            if saved > 0:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the build ended before it could be killed"
        assert 0 < saved < 240
        os.killpg(proc.pid, signal.SIGKILL)  # the node dies: the build and its workers
        proc.wait(10)
    finally:
        kill_group(proc)
    kept = store.load()  # what was saved is intact
    assert 0 < len(kept) < 240
    scanned, already = counted(zephon_index(many, "--index", index, "--workers", "2",
                                            "--save-every", "0.2"))
    assert scanned + already == 240
    assert already >= len(kept) and scanned < 240
    assert len(store.load()) == 240
    src = sources.webdataset(many + "/", index=index)
    assert src.index_counts == (240, 0)
    plain = sources.webdataset(many + "/", index=False)
    assert len(src) == len(plain) == 240 * 400
    picks = [k * 400 + j for k in range(240) for j in (0, 399)]
    assert digest(src, picks) == digest(plain, picks)


def test_a_build_does_not_delete_the_blobs_of_another_build_in_progress(many, tmp_path):
    index = str(tmp_path / "idx")
    shards = [os.path.join(many, f"shard-{k:04d}.tar") for k in range(240)]
    blobs = os.path.join(index, "webdataset")
    # two builds over different files of one index (the module docstring: both end up in it)
    slow = start(["-m", "zephon", "index", *shards[8:], "--index", index, "--workers", "1",
                  "--save-every", "3600"])
    try:
        deadline = time.monotonic() + TIMEOUT
        while slow.poll() is None and time.monotonic() < deadline and not (
                os.path.isdir(blobs) and any(n.endswith(".zblob") for n in os.listdir(blobs))):
            time.sleep(0.02)
        if slow.poll() is not None:
            pytest.skip("the slow build ended before it wrote a blob could be seen")
        assert counted(zephon_index(*shards[:8], "--index", index, "--workers", "1")) == (8, 0)
        if slow.poll() is not None:
            pytest.skip("the slow build ended before the quick one: no race to see")
        _, err = slow.communicate(timeout=TIMEOUT)
        assert slow.returncode == 0, err
    finally:
        kill_group(slow)
    src = sources.webdataset(shards, index=index)
    assert src.index_counts == (240, 0)
    picks = [k * 400 for k in range(240)]
    assert digest(src, picks) == digest(sources.webdataset(shards, index=False), picks)


def test_the_workers_of_a_killed_build_exit(many, tmp_path):
    index = str(tmp_path / "idx")
    proc = start(["-m", "zephon", "index", many, "--index", index, "--workers", "2",
                  "--save-every", "0.2"])
    workers: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        top = os.path.join(index, "webdataset.zidx")
        while not os.path.exists(top) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the build ended before it could be killed"
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
                if int(fields[1]) == proc.pid and b"spawn_main" in cmd:
                    workers.append(int(entry))
        assert workers
        os.kill(proc.pid, signal.SIGKILL)  # the build alone (an OOM kill, a kill -9)
        proc.wait(10)
        assert wait_gone(workers, 5.0) == []
    finally:
        kill_group(proc)
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- remote (moto S3) -----------------------------------------------------------------------

@pytest.fixture
def remote(request):
    """The module's moto S3 server and a request-recording proxy in front of it."""
    for mod in ("moto", "s3fs", "boto3"):
        pytest.importorskip(mod)
    from _s3_server import FaultProxy

    server = request.getfixturevalue("s3")
    proxy = FaultProxy(server.port)
    yield server, proxy
    proxy.close()


def _gets(proxy, suffix: str) -> list[str]:
    with proxy.lock:
        return [p for m, p in proxy.requests if m == "GET" and p.endswith(suffix)]


def test_a_remote_corpus_indexed_by_the_cli_builds_from_one_object(remote):
    server, proxy = remote
    prefix = f"idx-{uuid.uuid4().hex[:8]}/corpus"
    for k in range(5):
        server.put(f"{prefix}/shard-{k:04d}.tar", tar_bytes(shard_members(k)))
    so = storage_options(server.endpoint)
    url = f"s3://{BUCKET}/{prefix}/"
    scanned, already = counted(zephon_index(url, "--kind", "webdataset", "--workers", "1",
                                            "--storage-options", json.dumps(so)))
    assert (scanned, already) == (5, 0)
    where = prefix.replace("/corpus", "/_zephon_index/corpus")  # beside the data's prefix
    keys = [o["Key"] for o in server.client.list_objects_v2(
        Bucket=BUCKET, Prefix=f"{where}/")["Contents"]]
    assert f"{where}/webdataset.zidx" in keys
    assert sum(k.endswith(".zblob") for k in keys) == 5

    truth = sources.webdataset(url, storage_options=so, index=False)
    via = storage_options(proxy.endpoint)
    src = sources.webdataset(url, storage_options=via)
    assert src.index_counts == (5, 0)
    assert src.index_store.top == f"s3://{BUCKET}/{where}/webdataset.zidx"
    assert src.index_store.objects_read == 1
    assert _gets(proxy, ".tar") == [] and len(_gets(proxy, ".zidx")) == 1
    with proxy.lock:
        proxy.requests.clear()
    assert src.get(7) == truth.get(7)  # shard 2: its blob and its bytes, nothing else
    assert _gets(proxy, ".tar") == [f"/{BUCKET}/{prefix}/shard-0002.tar"]
    assert len(_gets(proxy, ".zblob")) == 1 and src.index_store.objects_read == 2
    assert digest(src) == digest(truth)

    server.put(f"{prefix}/shard-0002.tar", tar_bytes(shard_members(2, 4, tag="new")))
    with proxy.lock:
        proxy.requests.clear()
    src = sources.webdataset(url, storage_options=via)
    assert src.index_counts == (4, 1)  # the new ETag is not the indexed one: rescanned
    assert _gets(proxy, ".tar") == [f"/{BUCKET}/{prefix}/shard-0002.tar"]
    assert [src.get(i)["__key__"] for i in range(6, 10)] == [f"new0002_{j:03d}"
                                                             for j in range(4)]
    assert digest(src) == digest(sources.webdataset(url, storage_options=so, index=False))


def test_the_cli_tells_the_kind_of_a_remote_prefix(remote):
    server, _ = remote
    prefix = f"idx-{uuid.uuid4().hex[:8]}/corpus"
    for k in range(2):
        server.put(f"{prefix}/shard-{k:04d}.tar", tar_bytes(shard_members(k)))
    so = json.dumps(storage_options(server.endpoint))
    result = zephon_index(f"s3://{BUCKET}/{prefix}/", "--workers", "1", "--storage-options", so)
    assert result.returncode == 0, result.stderr


def test_the_cli_writes_the_index_where_sources_look_for_it(remote):
    server, _ = remote
    bucket = f"idx-{uuid.uuid4().hex[:8]}"  # a bucket of its own: the index lands at its root
    server.client.create_bucket(Bucket=bucket)
    for k in range(2):
        server.client.put_object(Bucket=bucket, Key=f"corpus/shard-{k:04d}.tar",
                                 Body=tar_bytes(shard_members(k)))
    so = storage_options(server.endpoint)
    counted(zephon_index(f"s3://{bucket}/corpus", "--kind", "webdataset", "--workers", "1",
                         "--storage-options", json.dumps(so)))
    src = sources.webdataset(f"s3://{bucket}/corpus/", storage_options=so)
    assert src.index_counts == (2, 0)
