"""The advisor and its report, together: what a run measured (:mod:`.profile`), the rules that turn it into
changes with predicted speed-ups (:mod:`.rules`), and the terminal table and HTML page that show both
(:mod:`.report`), and the Chrome trace of a run (:mod:`.trace`). No Lightning imports.
"""

from lightning_ciuic.advice.profile import RANK_FIELDS, RunProfile
from lightning_ciuic.advice.rules import Advice, Finding, advise, check, compression_speedups

__all__ = ["RANK_FIELDS", "Advice", "Finding", "RunProfile", "advise", "check", "compression_speedups"]
