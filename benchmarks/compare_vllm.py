"""FlagServe vs vLLM's CPU build offline, alternating: flagserve/bench/vllm_compare.py (--help).

    python benchmarks/compare_vllm.py --vllm-python /tmp/vllm-venv/bin/python
"""

from flagserve.bench.vllm_compare import main

if __name__ == "__main__":
    main()
