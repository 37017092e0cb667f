"""The native CPU linear's packings of a model's layers, by rows per step: flagserve/bench/cpu_linear.py.

    python benchmarks/cpu_linear.py --model SmolLM2-135M-Instruct.Q4_1.gguf --storage q4_1
"""

from flagserve.bench.cpu_linear import main

if __name__ == "__main__":
    main()
