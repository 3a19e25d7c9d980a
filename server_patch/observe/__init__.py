"""What the server counts about itself, below the code that does the counted work (issue 35).

``ledger``: the process's copy ledger (bytes copied, by site), which ``state`` and ``copyfree``
both add to; it lived in ``copyfree``, so ``state`` imported ``copyfree`` and ``copyfree``
``state``. ``outcomes``: how a request's record says it ended (the timing record writes it,
the admin answers parse it). Imports nothing of ``server_patch``.
"""
