#!/usr/bin/env bash
# The H200 session of 2026-12-04 (first of the day), in calls that fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py
# requests opentelemetry-api uvloop pillow llguidance xgrammar, then the image's own packages
# deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock cuda_bindings
# cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 18: offline throughput with fp8 weights and an fp8 KV cache was never
#          measured; target >= 1.3x bf16): offline 1024 x (512 in, 256 out) through braid.LLM
#          with bf16, fp8 weights, and fp8 weights + fp8 KV, one after the other
#   part 2 (issue 23: the agent workload had no H200 run): 256 ReAct programs on the 8B
#          shapes (random bf16 weights, SmolLM2's tokenizer), lpm swept over rates until its
#          p99 passes 4x the unloaded latency, then fcfs / program / program+pins there
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1 or 2}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
off() { python benchmarks/gpu.py offline --skip-hf --repeats 1 "$@"; }
if [ "$part" = 1 ]; then
    { nproc; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; } >"$OUT/env.log" 2>&1
    TAIL=14 step 150 offline_bf16 off --out "$OUT/r/gpu_offline_bf16_fp8run_cuda.json"
    TAIL=14 step 170 offline_fp8 off --engine-arg quantization=fp8 \
        --out "$OUT/r/gpu_offline_fp8_cuda.json"
    TAIL=14 step 170 offline_fp8_kv off --engine-arg quantization=fp8 \
        --engine-arg kv_cache_dtype=fp8_e4m3 --out "$OUT/r/gpu_offline_fp8_kv_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 2 ]; then
    TAIL=20 step 560 agents python benchmarks/agents.py --gpu-config llama-3.1-8b \
        --tokenizer "$tok" --programs 256 --rates "${RATES:-4,8,16}" \
        --kv-tokens "${KV:-4096}" --out "$OUT/r/agents_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
