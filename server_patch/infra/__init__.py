"""The HTTP plumbing every surface of the server shares, below them all (issue 35).

The admin token (``auth``), the ASGI gate in front of ``/admin`` and mlx-vlm's management
routes (``guard``), the traffic gate and its drain deadline (``traffic``, ``drain_deadline``),
in-process calls of the server's own chat route (``internal``) and the dependency a route
reaches the server's parts by (``deps``). They lived in ``admin/``, which made every package
that needed a middleware or the token import the admin HTTP surface, and the surface imports
them all back. Nothing here imports another ``server_patch`` package but the leaves
(``settings``, ``envconfig``, ``clock``, ``paths``, ``private_files``).
"""
