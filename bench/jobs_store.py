"""What the jobs checkpoint store costs: subjects/s of a stored run, first result of a resume.

    PYTHONPATH=$PWD python bench/jobs_store.py               # n = 10^6, serial backend
    PYTHONPATH=$PWD python bench/jobs_store.py --n 100000    # a quicker run

One run, in order, with a no-op callable on the serial backend (``RunPolicy(
subject_timeout_sec=None)``) and a fresh ``checkpoint_dir`` under ``--dir``:

- ``off``: the run without a store (``resume=False``, no ``checkpoint_dir``): the
  baseline, what the run loop itself costs;
- ``cold``: every subject computed and stored: subjects/s, and the ratio to ``off``;
- ``resume``: the same run again, every subject served from the store: the time from
  ``iter(run(...))`` to the first result, the time to the last, and the driver's peak
  RSS growth over the whole bench (``ru_maxrss``);
- the store's files after the run (how many, how many bytes).

Each phase also reports the process's CPU seconds (``time.process_time``: every thread
of the driver, the store's commit thread included) and subjects per CPU second: on a
shared machine the wall clock measures the neighbours as much as the run, the CPU time
much less so (it still leaves out the time the run waits for the disk: its fsyncs).

Targets (the issue): ``cold`` >= 20,000 subjects/s, the resume's first result <= 0.5 s.
Figures are one run on one (shared, noisy) machine; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

from zephon.jobs import RunPolicy, run


def noop(subject):
    return subject


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_run(subjects, policy) -> tuple[float, float, int, float]:
    """(seconds to the first result, seconds to the last, results, CPU seconds) of one
    run."""
    cpu = time.process_time()
    start = time.perf_counter()
    first, count = None, 0
    for r in run(noop, subjects, policy, progress=False):
        if first is None:
            first = time.perf_counter() - start
        assert r.ok, r.error
        count += 1
    return first or 0.0, time.perf_counter() - start, count, time.process_time() - cpu


def store_files(root: str) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            files += 1
            size += os.lstat(os.path.join(dirpath, name)).st_size
    return files, size


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=float, default=1e6, help="subjects (default 10^6)")
    parser.add_argument("--dir", default=None, help="where the store goes (default: a "
                        "temporary directory, removed afterwards)")
    args = parser.parse_args(argv)
    n = int(args.n)
    subjects = [f"S{i:08d}" for i in range(n)]
    base = tempfile.mkdtemp(prefix="zephon-bench-jobs-", dir=args.dir)
    ckpt = os.path.join(base, "ckpt")
    rss0 = _peak_mib()
    try:
        _, off_s, _, off_cpu = timed_run(subjects, RunPolicy(subject_timeout_sec=None,
                                                             resume=False))
        stored = RunPolicy(subject_timeout_sec=None, checkpoint_dir=ckpt)
        _, cold_s, count, cold_cpu = timed_run(subjects, stored)
        assert count == n
        first_s, resume_s, count, resume_cpu = timed_run(subjects, stored)
        assert count == n
        files, size = store_files(ckpt)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"n = {n:,} no-op subjects, serial backend")
    def cpu(seconds: float) -> str:
        return f"  cpu {seconds:6.2f} s {n / max(seconds, 1e-9):10,.0f} subjects/cpu-s"

    print(f"off (no store):   {off_s:8.2f} s  {n / off_s:12,.0f} subjects/s" + cpu(off_cpu))
    print(f"cold (stored):    {cold_s:8.2f} s  {n / cold_s:12,.0f} subjects/s" + cpu(cold_cpu)
          + f"  (off/cold = {off_s / cold_s:.2f})")
    print(f"resume (cached):  {resume_s:8.2f} s  {n / resume_s:12,.0f} subjects/s" +
          cpu(resume_cpu) + f"  first result after {first_s * 1e3:.1f} ms")
    print(f"store: {files:,} file(s), {size / 2**20:,.1f} MiB; driver peak RSS growth "
          f"{_peak_mib() - rss0:,.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
