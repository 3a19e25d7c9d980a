"""A fleet: several patched servers behind one existing gateway (smg, the SGLang Model Gateway).

We do not route requests ourselves: ``smg launch`` fronts the servers as generic OpenAI workers,
and apcctl starts, inspects, restarts and stops the whole. Modules: ``gateway`` (the smg process
and its worker API), ``state`` (what ``apcctl fleet up`` wrote, so ``down`` and ``status`` find
it), ``config`` (the ``[fleet]`` table of the TOML config), ``lifecycle`` (up and down),
``status`` (the gateway's view beside each server's own), ``roll`` (rolling restart through the
gateway), ``traffic`` (the agent trace through a gateway, with usage kept) and ``bench`` (the
per-policy measurement of ``apcctl bench fleet``).
"""
