"""Imported last by a zephon fork server (see :mod:`zephon.transport.preload`).

Collects, then freezes every object alive: the cyclic garbage collector never visits
them again, so it never writes into their pages, in the server or in the workers
forked from it, and those pages stay shared between all of them.
"""

import gc

gc.collect()
gc.freeze()
