"""Offline A/B of engine settings in one process, alternating: flagserve/bench/ab.py (--help).

    python benchmarks/cpu_ab.py --model M.gguf --variant aten:FLAGSERVE_CPU_MATMUL=aten \
        --variant onednn:FLAGSERVE_CPU_MATMUL=onednn --reps 3
"""

from flagserve.bench.ab import main

if __name__ == "__main__":
    main()
