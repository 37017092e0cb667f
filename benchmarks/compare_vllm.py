"""FlagServe vs vLLM's CPU build offline, alternating: flagserve/bench/vllm_compare.py (--help).

    python benchmarks/compare_vllm.py --vllm-python /tmp/vllm-venv/bin/python
"""

from flagserve.bench.vllm_compare import main
from flagserve.engine.cpu_runtime import reexec_with_cpu_runtime

if __name__ == "__main__":
    reexec_with_cpu_runtime()  # the FlagServe worker gets a served engine's threads and libraries
    main()
