"""The core the CLI and the dashboard share: talking to servers and gateways, and controlling them.

``client`` (the admin HTTP client), ``hosts`` (is a URL this machine, a free port), ``render``
(human sizes, durations, tables), ``process`` (psutil readings of a local server), ``manage``
(the servers ``apcctl serve`` runs: their files and process verbs), ``restart`` (the rolling
restart engine and its ``Phase``), ``gateway`` (the smg gateway process and its worker API),
``fleet_state`` (what ``apcctl fleet up`` wrote) and ``roll`` (restarts through a fleet's gateway).

Arrows (``tests/test_layout.py``): ``tui`` imports nothing of ``apcctl`` but this package, and
this package imports no other ``apcctl`` module at run time (never ``apcctl.commands`` or ``tui``).
"""
