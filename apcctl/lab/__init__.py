"""The research lab: what is not operator-facing (issue 35).

The tiny random models every test and the demo run (``tinymodel``), the chat-template and
drafter checks and the family matrix (``template_check``, ``drafter_check``, ``model_matrix``),
the model check (``model_check``), the trace simulator with its template study (``sim``) and the
benches that drive real servers (``bench``). The lab imports nothing of the operator CLI but its
shared core (``apcctl.core``), and the operator side nothing of the lab but the tiny model's
word corpus (the demo's agent traffic); the two meet in ``apcctl.commands`` (``apcctl bench``,
``apcctl model``, ``apcctl demo``). Inside the lab the layers point one way, in the order above
(``tests/test_layout.py`` checks both).
"""
