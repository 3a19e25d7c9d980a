"""A fleet: several patched servers behind one existing gateway (smg, the SGLang Model Gateway).

We do not route requests ourselves: ``smg launch`` fronts the servers as generic OpenAI workers,
and apcctl starts, inspects, restarts and stops the whole. Modules: ``config`` (the ``[fleet]``
table of the TOML config), ``lifecycle`` (up and down), ``status`` (the gateway's view beside each
server's own, and each server's state there for ``apcctl status``), ``traffic`` (a trace through a
gateway, with usage kept; a run's tenant travels as the ``user`` field), ``holdout`` (the e2e
tests' conversations as a trace) and ``bench`` (the per-policy measurement of ``apcctl bench
fleet``). What the dashboard shares lives in ``apcctl.core``: the gateway process and its worker
API (``gateway``), the fleet's files (``fleet_state``) and the rolling restart through the
gateway (``roll``).
"""
