"""What the client changed in its prompt: the first divergence against what it sent before.

Most turns that should have been warm and were cold are the client's doing, not the cache's: a
date injected into the system prompt, a reminder block that moved, a tool list re-ordered, a
reply re-rendered (thinking dropped, whitespace, its stop token), a history rebuilt on resume.
The live oracle (``lineage.shadow``) cannot say so: it loses those tokens too. This package
keeps a few recent sequences per namespace (``ring``), finds the nearest earlier one and where
a prompt parts from it, names the segment there and the cause (``causes``), with a short
decoded diff (``detector``). Plain Python + numpy, no mlx: the simulator can use it too.

What it finds holds prompt text: it goes to ``/admin`` and the journal only, never to a client.
"""

from server_patch.drift.causes import Cause, Divergence, classify
from server_patch.drift.detector import DriftDetector, DriftSettings
from server_patch.drift.ring import RecentPrompts, Seen

__all__ = ["Cause", "Divergence", "DriftDetector", "DriftSettings", "RecentPrompts", "Seen", "classify"]
