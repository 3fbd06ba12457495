"""Device and packaging checks that are not benchmarks: the GPU day's runner (``gpu_suite``), the sm_90a
static compile check (``static_sm90``) and the optional-import blocker (``without_optional/``)."""
