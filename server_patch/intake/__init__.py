"""What the server accepts from an inference client, checked before mlx-vlm's handlers run.

Stock mlx-vlm 0.7.10 answers some bad requests with a 500 and a traceback (a 100k-deep JSON
body, an empty ``messages``, a lone surrogate, a broken inline image), dies on one (a
``logit_bias`` id past the vocabulary: a segfault), buffers any body whole, fetches any media
URL a client names (link-local metadata addresses included) and reads any local path. These
modules refuse such requests with a 4xx JSON answer, stop a row whose client is gone, and keep
``/metrics`` to aggregates. Every check walks any JSON a client may send without raising (a
tool schema's ``"type": ["integer", "null"]`` once made each qwen-code request a 500). None of
them imports mlx-vlm.
"""
