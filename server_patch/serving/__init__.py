"""What this server serves and to whom: the served models, and the origins and hosts it answers.

mlx-vlm 0.7.10 loads whatever model a request names and lets every web origin read every
answer; both made any web page a local user opened able to empty the cache and unload the
model. ``served`` keeps the model the server was started with; ``origins`` keeps browsers of
other sites (and DNS-rebound names) out of the inference routes.
"""
