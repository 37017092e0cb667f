#!/usr/bin/env bash
# A GPU session's checks for the GPU work (issue 13), in one device call:
#
#   bash benchmarks/gpu_session.sh              # every run below, most important first
#   bash benchmarks/gpu_session.sh tests latency_qwen3   # only these (after a fix, say)
#
# Sized for the device tool's limits: 15 minutes of device time a session, a machine's start
# included, 10 minutes a call, 8 files back. The whole script ends within GPU_SESSION_SECONDS
# (default 400): each run gets its own limit, cut to what is left, and a run that would get
# under 20 s is skipped and says so. Give the call timeout_s = GPU_SESSION_SECONDS + 60; that
# leaves a session time to start a machine again and rerun what failed.
#
# What comes back: $OUT/summary.txt (each run's exit and seconds, the key figures) and
# $OUT/logs.tgz (every run's whole log and --json results), both rewritten after every run so a
# call cut off at its limit still returns what was done.
#
# The lent machine's image has torch, triton and transformers but no Ray, Hydra or xgrammar
# (../shared/DESIGN.md), so `tests` runs the engine, kernel and benchmark tests that need no
# Ray or Hydra, in parallel processes where pytest-xdist is installed (the image has it);
# the grammar tests run where the call carries the wheels of gpu_wheels.sh, else they skip:
#   bash benchmarks/gpu_wheels.sh     # here, once: .whl/ (about 8 MB), then carry: [".whl"]
# A dry run of `tests` here, in the project's venv with the packages the image lacks made
# unimportable (gpu_dry_run/):
#   PYTHONPATH=benchmarks/gpu_dry_run PYTEST_ADDOPTS="-p no:hydra_pytest" PYTHON=.venv/bin/python \
#     bash benchmarks/gpu_session.sh tests
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/flagserve-gpu}"
logs="$(mktemp -d /tmp/flagserve-gpu-logs.XXXXXX)"
mkdir -p "$out"
py="${PYTHON:-python3}"
budget="${GPU_SESSION_SECONDS:-400}"
summary="$out/summary.txt"
: > "$summary"

QWEN3=(benchmarks/throughput.py --shape qwen3-0.6b --dtype bfloat16)
LATENCY=(--latency --input-len 128 128 --output-len 256 256)
# nano-vllm's benchmark never decodes its (random-weight) tokens: neither do these runs.
NANOVLLM=(--num-seqs 256 --input-len 100 1024 --output-len 100 1024 --disable-detokenize)
TESTS=(tests/kernels tests/test_engine_api.py tests/test_hf_parity.py
       tests/test_cuda_graph_buckets.py tests/test_sampling.py tests/test_sampling_inputs.py
       tests/test_scheduling.py tests/test_prefix_cache.py tests/test_tiny_model.py
       tests/test_async_scheduling.py tests/test_disaggregation.py
       tests/test_disaggregation_gloo.py tests/test_shard_weights.py
       tests/test_structured_outputs.py tests/test_prompt_logprobs.py
       tests/kernels/test_triton_prefill_rows.py
       tests/bench/test_throughput_shapes.py)
# The runs in the order they are worth: batch-1 latency and nano-vllm's workload (the targets,
# with the engine's defaults: CUDA graphs and async scheduling), the suite, the kernels' table,
# the 8B shape, step by step (what async scheduling buys), batch-1 without graphs (what they
# buy, and a figure even if capture fails), then the tile sweeps.
ALL=(latency_qwen3 nanovllm_qwen3 nanovllm_qwen3_repeat tests attention decode_order latency_llama3_8b
     nanovllm_qwen3_sync nanovllm_qwen3_4k latency_qwen3_sync latency_qwen3_eager attention_graph
     decode_splits prefill_own_rows prefill_own_rows_lengths prefill_sweep attention_autotune
     attention_sweep)

# name -> "limit-seconds command..." (the command sees $logs/<name>.json for --json)
spec() {
  local json="--json $logs/$1.json"
  case "$1" in
    latency_qwen3) echo 90 "$py" "${QWEN3[@]}" "${LATENCY[@]}" --profile 16 $json ;;
    latency_qwen3_eager) echo 60 "$py" "${QWEN3[@]}" "${LATENCY[@]}" --enforce-eager $json ;;
    latency_qwen3_sync) echo 60 "$py" "${QWEN3[@]}" "${LATENCY[@]}" --no-async-scheduling $json ;;
    latency_llama3_8b) echo 90 "$py" benchmarks/throughput.py --shape llama3-8b --dtype bfloat16 \
      "${LATENCY[@]}" $json ;;
    nanovllm_qwen3) echo 150 "$py" "${QWEN3[@]}" "${NANOVLLM[@]}" --phases --profile 8 \
      --profile-prefill 4 $json ;;
    # A second sample on a warm machine (Triton's disk cache filled by the runs before): a
    # fresh machine's first run compiles kernel variants inside its timing.
    nanovllm_qwen3_repeat) echo 90 "$py" "${QWEN3[@]}" "${NANOVLLM[@]}" --phases $json ;;
    nanovllm_qwen3_sync) echo 150 "$py" "${QWEN3[@]}" "${NANOVLLM[@]}" --phases \
      --no-async-scheduling $json ;;
    # The CPU's step budget (the GPU's default is 16384, kv_budget.py): what the larger one buys.
    nanovllm_qwen3_4k) echo 150 "$py" "${QWEN3[@]}" "${NANOVLLM[@]}" --phases \
      --max-num-batched-tokens 4096 $json ;;
    attention) echo 120 "$py" benchmarks/attention.py --dtype bfloat16 ;;
    # Varied contexts launched in batch order vs longest first (what the engine passes).
    decode_order) echo 90 "$py" benchmarks/attention.py --dtype bfloat16 --only decode-order \
      --batches 32 80 128 256 --contexts 512 2048 8192 ;;
    # Every decode tile of the sweep space on a few shapes: what retuning DECODE_TILES needs.
    attention_sweep) echo 150 "$py" benchmarks/attention.py --dtype bfloat16 --only decode \
      --sweep-tiles --batches 1 8 64 256 --contexts 512 8192 ;;
    # Decode split counts at the batches that leave SMs idle: what the path choice
    # (SPLIT_WAVES, MIN_SPLIT_TOKENS: the batch-1 fixed cost) needs.
    # In CUDA graphs, as the engine runs decode: eager timings under ~50 us are launch noise.
    decode_splits) echo 90 "$py" benchmarks/attention.py --dtype bfloat16 --only decode \
      --cuda-graph --sweep-splits --batches 1 4 8 16 32 64 --contexts 512 2048 8192 ;;
    # Every prefill tile (BLOCK_M too, which autotune cannot vary) on a few shapes: what
    # retuning PREFILL_TILES needs.
    prefill_sweep) echo 240 "$py" benchmarks/attention.py --dtype bfloat16 --only prefill \
      --sweep-tiles --head-dims 128 256 --prefill-lens 512 4096 --extend-cached 2048 ;;
    # Whole prompts over their own K/V rows (pointers, TMA descriptors): every tile on the
    # descriptor path, to retune PREFILL_TILES for them.
    prefill_own_rows) echo 240 "$py" benchmarks/attention.py --dtype bfloat16 --only prefill \
      --sweep-tiles own-rows --head-dims 64 128 256 --prefill-lens 512 4096 --extend-cached ;;
    # The same at head_dim 128 over every prompt length of the table: each length's best tile
    # (the 512-token prompts' best differed from 4,096's), what a length-aware table needs.
    prefill_own_rows_lengths) echo 150 "$py" benchmarks/attention.py --dtype bfloat16 \
      --only prefill --sweep-tiles own-rows --head-dims 128 --extend-cached ;;
    attention_graph) echo 60 "$py" benchmarks/attention.py --dtype bfloat16 --cuda-graph \
      --only decode ;;
    # The prefill tiles triton.autotune picks (printed), against the table's in `attention`.
    attention_autotune) echo 120 env FLAGSERVE_TRITON_AUTOTUNE=1 TRITON_PRINT_AUTOTUNING=1 \
      "$py" benchmarks/attention.py --dtype bfloat16 --only prefill ;;
    tests) echo 300 "$py" -m pytest -q -p no:cacheprovider -rfE --durations=10 \
      $(parallel_args) "${TESTS[@]}" ;;
    *) return 1 ;;
  esac
}

parallel_args() {  # xdist by file (module fixtures build their models once); a hung test fails
  "$py" -c 'import xdist' 2>/dev/null && printf -- '-n 8 --dist loadfile '
  "$py" -c 'import pytest_timeout' 2>/dev/null && printf -- '--timeout 150 '
}

# The lines of a run's log worth reading in the summary.
figures() {
  grep -E "ms per token|output tok/s|start-up|roofline|outside the model|Triton kernel variants|^(decode|prefill|extend|prefill-own-rows) D=|own K/V rows|^decode order|passed|failed|FAILED|ERROR|Error" \
    "$logs/$1.log" | grep -v "^  " | tail -n 12 | sed 's/^/    /'
}

run() {
  local name="$1" left=$((budget - SECONDS)) line limit
  line="$(spec "$name")" || { echo "$name: unknown run (one of: ${ALL[*]})" | tee -a "$summary"; return; }
  limit="${line%% *}"
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped, ${left} s left of $budget" | tee -a "$summary"
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local start=$SECONDS
  # shellcheck disable=SC2086  # the spec is words by design
  timeout --kill-after=10 "$limit" ${line#* } > "$logs/$name.log" 2>&1
  local rc=$?
  {
    echo "$name: exit $rc in $((SECONDS - start)) s (limit $limit s)"
    figures "$name"
    [ "$rc" -ne 0 ] && tail -n 4 "$logs/$name.log" | sed 's/^/  ! /'
  } | tee -a "$summary"
  tar -czf "$out/logs.tgz" -C "$logs" .
}

# The packages the image lacks (xgrammar, pydantic), where gpu_wheels.sh put them in .whl/ and
# the call carried it: after the image's own on the path, so they add and never replace.
if ls .whl/*.whl > /dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/flagserve-site \
    .whl/*.whl > "$logs/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/flagserve-site"
  echo "wheels from .whl: exit $? ($(ls .whl | wc -l) files)" | tee -a "$summary"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$py" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__)' 2>&1
} | tee -a "$summary"
[ $# -eq 0 ] && set -- "${ALL[@]}"
for name in "$@"; do
  run "$name"
done
echo "done in $SECONDS s; logs in $out/logs.tgz" | tee -a "$summary"
