"""HTTP pieces shared by every server and client of the project (a base layer: imports nothing of ours above it).

- ``pool``: our HTTP/1.1 client (kept-alive connection pools) that carries the rollout calls;
- ``auth``: the one check of the run's key on our listeners;
- ``conn_guard``: the limits on idle and unauthenticated connections of our aiohttp listeners
  (the embedded engine, the agent endpoint, the metrics endpoint).
"""
