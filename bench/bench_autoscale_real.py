"""Real runs on this machine: the server-count policy against each fixed split, lengths growing over the run
(tools/autoscale_compare.py, docs/autoscale.md). ``python -m bench.bench_autoscale_real --seeds 1,2,3``"""
from tools.autoscale_compare import main

if __name__ == "__main__":
    main()
