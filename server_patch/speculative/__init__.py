"""Speculative decoding beside the lineage cache (issue 39): which drafter and target pairs the
lineage serves correctly, checked before the server starts (``support``)."""
