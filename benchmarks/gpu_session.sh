#!/usr/bin/env bash
# A GPU session's checks for the GPU work, in three device calls of under 10 minutes each:
#
#   bash benchmarks/gpu_session.sh tests        # the suite that runs without Ray, Hydra, xgrammar
#   bash benchmarks/gpu_session.sh bench        # attention kernels, then batch-1 latency
#   bash benchmarks/gpu_session.sh throughput   # nano-vllm's workload, step by step and async
#
# The lent machine's image has torch, triton and transformers only (../shared/DESIGN.md), so
# the test part runs the engine, kernel and benchmark tests that need nothing else. Logs go
# to $OUT (the device tool's folder that comes back) or /tmp/flagserve-gpu. A dry run of
# `tests` here, in the project's venv with the packages the image lacks made unimportable
# (gpu_dry_run/sitecustomize.py; hydra-core's pytest plugin off):
#   PYTHONPATH=benchmarks/gpu_dry_run PYTEST_ADDOPTS="-p no:hydra_pytest" PYTHON=.venv/bin/python \
#     bash benchmarks/gpu_session.sh tests
set -uo pipefail
if [ "${1:-}" != tests ] && [ "${1:-}" != bench ] && [ "${1:-}" != throughput ]; then
  echo "usage: $0 tests|bench|throughput" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/flagserve-gpu}"
mkdir -p "$out"
py="${PYTHON:-python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$py" -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' \
  >> "$out/gpu.txt" 2>&1

# name, seconds, command...: the command's output in $out/<name>.log, its status in the
# summary. Each run has its own limit (exit 124 when it hits it): one that hangs must not take
# the device call's 10 minutes, and the rest of the call with it.
run() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

case "$1" in
  tests)
    run tests 540 "$py" -m pytest -q -p no:cacheprovider \
      tests/kernels tests/test_engine_api.py tests/test_hf_parity.py tests/test_cuda_graph_buckets.py \
      tests/test_sampling.py tests/test_sampling_inputs.py tests/test_scheduling.py \
      tests/test_prefix_cache.py tests/test_tiny_model.py tests/bench/test_throughput_shapes.py \
      tests/test_async_scheduling.py
    ;;
  bench)
    run attention 120 "$py" benchmarks/attention.py --dtype bfloat16
    run attention_graph 60 "$py" benchmarks/attention.py --dtype bfloat16 --cuda-graph --only decode
    run latency_qwen3 90 "$py" benchmarks/throughput.py --shape qwen3-0.6b --latency \
      --input-len 128 128 --output-len 256 256 --dtype bfloat16 --profile 16
    run latency_qwen3_async 60 "$py" benchmarks/throughput.py --shape qwen3-0.6b --latency \
      --input-len 128 128 --output-len 256 256 --dtype bfloat16 --async-scheduling
    run latency_qwen3_eager 60 "$py" benchmarks/throughput.py --shape qwen3-0.6b --latency \
      --input-len 128 128 --output-len 256 256 --dtype bfloat16 --enforce-eager
    run latency_llama3_8b 90 "$py" benchmarks/throughput.py --shape llama3-8b --latency \
      --input-len 128 128 --output-len 256 256 --dtype bfloat16
    ;;
  throughput)
    run nanovllm_qwen3 150 "$py" benchmarks/throughput.py --shape qwen3-0.6b --num-seqs 256 \
      --input-len 100 1024 --output-len 100 1024 --dtype bfloat16 --phases
    run nanovllm_qwen3_async 150 "$py" benchmarks/throughput.py --shape qwen3-0.6b --num-seqs 256 \
      --input-len 100 1024 --output-len 100 1024 --dtype bfloat16 --phases --async-scheduling
    run nanovllm_qwen3_async_eager 150 "$py" benchmarks/throughput.py --shape qwen3-0.6b \
      --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --dtype bfloat16 \
      --async-scheduling --enforce-eager
    ;;
esac
