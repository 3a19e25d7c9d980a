"""Random model directories built offline, deterministic by seed, for tests, the demo and benches.

Why: the lineage cache must be exercised against the real mlx-vlm 0.7.10 model code without
downloading a checkpoint. ``build`` writes the random ``glm5_next`` directory every test and the
demo serve; ``families`` sizes other mlx-vlm families down for the conformance test, and
``servable`` turns one of those into a directory the real server can load.

The parts, each with one job: ``presets`` (model shapes), ``config`` (config.json and cache
bytes), ``corpus`` (word list and sentences, from ``data/``), ``vocab`` (the token list and which
tokens may be sampled), ``tokenizer`` (the WordPiece tokenizer), ``template`` (the chat templates,
from ``data/``), ``weights`` (random weights), ``fingerprint`` (the sha256 a disk cache is keyed
by), ``build`` (the directory, stamped and written atomically).
"""
