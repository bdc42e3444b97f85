"""bench/compare_workloads.py's image bar: the steady rate and the whole-epoch one.

A loader that reads far ahead (Grain) can show a steady rate above what its workers
decode; the epoch ratio compares epoch seconds, so it names the peer with the shortest
epoch, not the one with the highest steady rate."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("numpy")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import compare_workloads as cw  # the script under test


def _row(rate: float, epoch: float) -> dict:
    return {"items": 2560, "items_per_s": rate, "epoch_s": epoch}


def test_the_epoch_bar_follows_epoch_seconds_not_the_steady_rate():
    table = {("image", "zephon defaults"): _row(580.0, 6.0),
             ("image", "grain"): _row(2400.0, 9.0),  # read ahead: high steady, long epoch
             ("image", "tf.data"): _row(500.0, 8.0)}
    got = dict(cw.ratios(table))
    assert got["image_defaults_vs_best_peer(grain)"] == pytest.approx(580.0 / 2400.0)
    assert got["image_defaults_vs_best_peer_epoch(tf.data)"] == pytest.approx(8.0 / 6.0)


def test_no_epoch_bar_without_a_peer_row():
    assert cw._image_epoch_ratios({("image", "zephon defaults"): _row(580.0, 6.0)}) == []


def test_the_autotune_row_is_compared_with_tf_data_and_is_no_peer():
    table = {("image", "zephon defaults"): _row(580.0, 6.0),
             ("image", "zephon autotune"): _row(600.0, 5.0),
             ("image", "tf.data"): _row(500.0, 8.0)}
    got = dict(cw.ratios(table))
    assert got["image_autotune_vs_tfdata"] == pytest.approx(600.0 / 500.0)
    assert got["image_autotune_vs_tfdata_epoch"] == pytest.approx(8.0 / 5.0)
    assert got["image_defaults_vs_best_peer(tf.data)"] == pytest.approx(580.0 / 500.0)


def test_the_torchvision_rows_compare_with_each_other_and_are_no_pil_peer():
    table = {("image", "zephon defaults"): _row(580.0, 6.0),
             ("image", "grain"): _row(500.0, 9.0),
             ("image", "torch + torchvision"): _row(900.0, 3.0),  # another transform
             ("image", "zephon + torchvision"): _row(1200.0, 2.5)}
    got = dict(cw.ratios(table))
    assert got["image_torchvision_zephon_vs_torch"] == pytest.approx(1200.0 / 900.0)
    assert got["image_defaults_vs_best_peer(grain)"] == pytest.approx(580.0 / 500.0)
    assert got["image_defaults_vs_best_peer_epoch(grain)"] == pytest.approx(9.0 / 6.0)
    assert "image_defaults_vs_torch" not in got  # the PIL row is not set against it
