"""Elastic inference servers (``docs/elastic.md``): the launcher's supervisor that keeps a run's
servers at their target (``supervisor``), the run directory's server files (``members``), rank 0's
side (``pool_watch``, ``rejoin``, ``empty_pool``), the one liveness check (``liveness``) and the
port-owner check (``port_owner``). Below ``areal_fast.launch``, which drives it: a launcher is passed
in, never imported."""
