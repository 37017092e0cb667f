"""The greedy LM head against the float32 head, by rows per step: flagserve/bench/greedy_head.py.

    python benchmarks/greedy_head.py --model SmolLM2-135M-Instruct.Q4_1.gguf
"""

from flagserve.bench.greedy_head import main

if __name__ == "__main__":
    main()
