"""What is not a benchmark but serves them and the tests: the GPU day's runner (``gpu_suite``) and its pytest
plugin that writes each test's result as the test ends (``results_log``), the sm_90a
static compile check (``static_sm90``), the optional-import blocker (``without_optional/``), the simulated
SGLang fleet (``sim_sglang``: many cheap servers in one process, used by the scale benchmarks and the
rollout tests) and a receiving end of SGLang's weight-update wire for tests and benchmarks
(``weight_receiver``)."""
