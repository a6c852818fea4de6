"""Continued pretraining (issue 17): stage logic for cycles that train the champion on new data.

`ledger`: the record of every raw file consumed by a committed cycle, and discovery of new files.
"""
