"""``apcctl service``: a managed server run by launchd (macOS) or systemd (Linux).

``units`` builds the files (pure functions of a ``ServiceSpec``), ``runner`` is the one place
``launchctl``/``systemctl`` are called, ``record`` is what ``restart`` reads to go through the
supervisor, and ``ready`` is the readiness check that tells a ``Type=notify`` unit ``READY=1``.
"""
