#!/usr/bin/env bash
# The H200 session of 2026-12-02 (third of the day), in calls that each fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow, then the
# image's own packages deleted: benchmarks/flashinfer_session.sh says which) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
#   part 1 (a fresh machine): start to ready of `braid serve` with the 8B config, fresh then
#          second starts (issue 20); the extend-attention sweep, whose chosen config is written
#          to braid/kernels/configs/ and copied to $OUT (issue 21); the multimodal benchmark
#          with the uint8 pixel transport and the multimodal GPU tests (issue 15)
#   part 2: serving, streamed vs offline at 64/256/1024 (512 in, 256 out), a Poisson rate
#          sweep, two client processes against one (issue 20); prefill 8k with the tuned
#          extend config; mixed prefill+decode steps against plain at 256 prompts (issue 21)
#   part 3: offline 1024 plain vs mixed, FlashInfer's AOT build and its GPU tests (issue 21)
set -u
part=${1:?part 1, 2 or 3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/r"
export PATH=/tmp/site/bin:$PATH
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
cfg=(--config llama-3.1-8b --tokenizer "$tok")
if [ "$part" = 1 ]; then
    nvidia-smi -L; nproc
    TAIL=8 step 200 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_cuda.json"
    TAIL=12 step 170 tune_extend python benchmarks/tune_extend.py --write-config \
        --out "$OUT/r/tune_extend_cuda.json"
    mkdir -p "$OUT/configs" /tmp/keep && cp braid/kernels/configs/*.json "$OUT/configs/" && \
        cp braid/kernels/configs/*.json /tmp/keep/
    TAIL=25 step 150 multimodal python benchmarks/multimodal.py --out "$OUT/r/multimodal_cuda.json"
    TAIL=8 step 60 pytest_mm python -m pytest -q -m gpu tests/multimodal -p no:cacheprovider
elif [ "$part" = 2 ]; then
    # the tuned config from part 1 when this machine ran it (kept in /tmp while warm)
    [ -f /tmp/keep/extend_attention.json ] && cp /tmp/keep/extend_attention.json braid/kernels/configs/
    TAIL=16 step 230 serving python benchmarks/serving.py "${cfg[@]}" --load-format dummy \
        --concurrency 64,256,1024 --input-len 512 --output-len 256 --modes offline,stream \
        --repeats 1 --out "$OUT/r/serving_ab_cuda.json"
    TAIL=12 step 130 serving_rates python benchmarks/serving.py "${cfg[@]}" --load-format dummy \
        --concurrency 1024 --num-prompts 256 --input-len 512 --output-len 256 --modes stream \
        --request-rate 8,32,inf --repeats 1 --out "$OUT/r/serving_rates_cuda.json"
    TAIL=6 step 70 prefill python benchmarks/gpu.py prefill --skip-hf --repeats 2 \
        --out "$OUT/r/gpu_prefill_tuned_cuda.json"
    for mode in plain mixed; do
        extra=(); [ "$mode" = mixed ] && extra=(--engine-arg enable_mixed_chunk=true)
        TAIL=6 step 80 "offline256_$mode" python benchmarks/gpu.py offline --skip-hf --repeats 1 \
            --num-prompts 256 "${extra[@]}" --out "$OUT/r/gpu_offline_256_${mode}_cuda.json"
    done
else
    [ -f /tmp/keep/extend_attention.json ] && cp /tmp/keep/extend_attention.json braid/kernels/configs/
    for mode in plain mixed; do
        extra=(); [ "$mode" = mixed ] && extra=(--engine-arg enable_mixed_chunk=true)
        TAIL=6 step 110 "offline1024_$mode" python benchmarks/gpu.py offline --skip-hf --repeats 1 \
            "${extra[@]}" --out "$OUT/r/gpu_offline_1024_${mode}_cuda.json"
    done
    TAIL=8 step 110 fi_jit python benchmarks/attention_backends.py jit \
        --out "$OUT/r/flashinfer_jit_cuda.json"
    TAIL=15 step 150 pytest_fi python -m pytest -q -m gpu tests/kernels/test_flashinfer_backend.py \
        -p no:cacheprovider --maxfail 5
fi
