"""Trace replay: run recorded or generated agent traffic against cache policies with sized state.

Modules: ``trace`` (JSONL format), ``sizes`` (bytes from a model config), ``tracegen`` (agent
traffic), ``policies`` (lineage and the baselines), ``replay`` (the loop), ``report`` (tables).
"""
