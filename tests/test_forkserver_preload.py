"""zephon.forkserver_context: workers forked from a fork server that imported the
named modules once and froze its heap; the stream is the same as under spawn, and the
server goes when the program does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zephon import ZephonConfigError, forkserver_context
from zephon.transport.supervisor import wait_gone

HERE = os.path.dirname(__file__)


def _run(mode: str) -> dict:
    done = subprocess.run([sys.executable, os.path.join(HERE, "_forkserver_run.py"), mode],
                          cwd=HERE, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_workers_fork_from_a_preloaded_frozen_server_and_the_stream_is_spawns():
    spawned, forked = _run("spawn"), _run("forkserver")
    strip = ("preloaded", "frozen", "ppid")
    assert [{k: v for k, v in r.items() if k not in strip} for r in forked["rows"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in spawned["rows"]]
    # under spawn the workers are the program's children and import nothing extra
    assert all(r["ppid"] == spawned["main"] and not r["preloaded"] for r in spawned["rows"])
    # under the context: children of the fork server, which imported the module and
    # froze its heap before forking them
    server = forked["server"]
    assert server is not None and server != forked["main"]
    assert all(r["ppid"] == server and r["preloaded"] and r["frozen"] > 0
               for r in forked["rows"])
    # the server's preload is fixed once it runs: asking for more says so
    assert len(forked["warned"]) == 1 and "email.mime.text" in forked["warned"][0]
    # and it went with the program (no worker held its alive pipe)
    assert wait_gone([server], 30.0) == []


@pytest.mark.parametrize("bad", ["no_such_module_zephon", "", 3, "no_such_pkg.sub"])
def test_a_module_that_cannot_be_found_is_refused(bad):
    with pytest.raises(ZephonConfigError):
        forkserver_context(bad)
