"""Profiling and the bottleneck report: where a pipeline's time goes, as plots and a
diagnosis.

- :mod:`zephon.report.run`: :func:`profile` (run a pipeline with tracking on) and
  :func:`profile_script` (``python -m zephon profile script.py``);
- :mod:`zephon.report.diagnose`: the rule set that turns a report snapshot
  (``stats(report=True)``, :mod:`zephon.pipeline.stats`) into a paragraph;
- :mod:`zephon.report.html`: the self-contained HTML page with inline SVG plots.

It sits above the pipeline layer (it reads snapshots and runs pipelines) and nothing
below imports it.
"""

from zephon.report.diagnose import Diagnosis, diagnose
from zephon.report.html import render_html
from zephon.report.run import Profile, profile, profile_script

__all__ = ["Diagnosis", "Profile", "diagnose", "profile", "profile_script", "render_html"]
