#!/usr/bin/env bash
# The H200 session of 2026-12-04 (sixth of the day), in calls that fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py
# requests opentelemetry-api uvloop pillow llguidance xgrammar flashinfer-python==0.5.3, then
# the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock
# cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 18, offline fp8 + fp8 KV at 0.99-1.16x bf16, target 1.3x: where the time
#          goes): offline 1024 x (512 in, 256 out) and the same prompts with 1 token out
#          (prefill alone), bf16 and fp8 weights + fp8 KV, one engine after the other
#   part 2 (the same with `_scaled_mm`'s fast accumulation, BRAID_FP8_FAST_ACCUM=1, as vLLM's
#          and SGLang's fp8 GEMMs run): fp8 + fp8 KV at 256 and 1 tokens out, fp8 alone at 256
#   part 3 (part 1 gave fp8 + fp8 KV 1.28x bf16, earlier sessions 0.99-1.16x: the spread):
#          bf16 and fp8 + fp8 KV offline, twice each, alternating (run twice)
#   part 4 (fp8 slowed 25% over parts 1-3 on the warm machine, bf16 3-4%: the clocks): the GPU's
#          SM clock, power, temperature and throttle reasons sampled each second while
#          fp8 + fp8 KV runs three times and bf16 once
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1 to 4}
source "$(dirname "$0")/step.sh"
off() { python benchmarks/gpu.py offline --skip-hf --repeats 1 "$@"; }
fp8=(--engine-arg quantization=fp8)
fp8kv=(--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3)
if [ "$part" = 1 ]; then
    { nproc; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; } >"$OUT/env.log" 2>&1
    TAIL=6 step 140 offline_bf16 off --out "$OUT/r/offline_bf16_cuda.json"
    TAIL=6 step 110 prefill_bf16 off --output-len 1 --out "$OUT/r/prefill_bf16_cuda.json"
    TAIL=6 step 140 offline_fp8kv off "${fp8kv[@]}" --out "$OUT/r/offline_fp8kv_cuda.json"
    TAIL=6 step 110 prefill_fp8kv off "${fp8kv[@]}" --output-len 1 \
        --out "$OUT/r/prefill_fp8kv_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 2 ]; then
    export BRAID_FP8_FAST_ACCUM=1
    TAIL=6 step 140 offline_fp8kv_fast off "${fp8kv[@]}" \
        --out "$OUT/r/offline_fp8kv_fast_cuda.json"
    TAIL=6 step 110 prefill_fp8kv_fast off "${fp8kv[@]}" --output-len 1 \
        --out "$OUT/r/prefill_fp8kv_fast_cuda.json"
    TAIL=6 step 140 offline_fp8_fast off "${fp8[@]}" --out "$OUT/r/offline_fp8_fast_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 3 ]; then
    for i in 1 2; do
        TAIL=4 step 140 "offline_bf16_$i" off --out "$OUT/r/offline_bf16_${i}_cuda.json"
        TAIL=4 step 140 "offline_fp8kv_$i" off "${fp8kv[@]}" \
            --out "$OUT/r/offline_fp8kv_${i}_cuda.json"
    done
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 4 ]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
clocks_throttle_reasons.active --format=csv -l 1 >"$OUT/clocks.log" 2>&1 &
    smi=$!
    for i in 1 2 3; do
        TAIL=4 step 140 "offline_fp8kv_$i" off "${fp8kv[@]}" \
            --out "$OUT/r/offline_fp8kv_${i}_cuda.json"
    done
    TAIL=4 step 140 offline_bf16 off --out "$OUT/r/offline_bf16_cuda.json"
    kill "$smi"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
