"""FlagServe's and vLLM's OpenAI servers under the same client: flagserve/bench/vllm_compare_served.py.

    python benchmarks/compare_vllm_served.py --vllm-python /tmp/vllm-venv/bin/python
"""

from flagserve.bench.vllm_compare_served import main

if __name__ == "__main__":
    main()
