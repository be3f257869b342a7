"""Moved to `specdec.tuning.tree_cost` (timing belongs above the drafters). This name stays only until
distill/command.py imports `specdec.tuning.tree_cost`; delete it then."""

from specdec.tuning.tree_cost import cost_report, describe, measure_trees

__all__ = ["cost_report", "describe", "measure_trees"]
