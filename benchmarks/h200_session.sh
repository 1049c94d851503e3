#!/usr/bin/env bash
# The H200 session of 2026-12-02 (third of the day), in calls that each fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow, then the
# image's own packages deleted: benchmarks/flashinfer_session.sh says which) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
#   part 1 (a fresh machine): start to ready of `braid serve` with the 8B config, fresh then
#          second starts (issue 20); the extend-attention sweep (issue 21; its first run here
#          stopped at a bug in its own 16-request inputs, fixed, and ran again in part 3); the
#          multimodal benchmark with the uint8 pixel transport and the multimodal GPU tests
#          (issue 15)
#   part 2: serving, streamed vs offline at 64/256/1024 (512 in, 256 out), a Poisson rate
#          sweep (issue 20); prefill 8k with the new extend kernel at its built-in config;
#          mixed prefill+decode steps against plain at 256 prompts (issue 21)
#   part 3: the extend sweep, which writes braid/kernels/configs/extend_attention.json; prefill
#          8k with that config; offline 1024 plain vs mixed (issue 21)
#   part 4: the attention kernels' GPU tests, FlashInfer's build installed as AOT modules, then
#          its GPU tests, which load them without ninja (issue 21)
#   part 5: the runtime's GPU tests (with the tuned config; test_grammar_backends needs
#          xgrammar, which .whl does not carry); two client processes against one at 1024
#          streams, streamed and whole (issue 20)
# The device tool brings back at most 8 files per call: part 4 onwards tars $OUT.
set -u
part=${1:?part 1 to 5}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
cfg=(--config llama-3.1-8b --tokenizer "$tok")
if [ "$part" = 1 ]; then
    nvidia-smi -L; nproc
    TAIL=8 step 200 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_cuda.json"
    TAIL=12 step 170 tune_extend python benchmarks/tune_extend.py --write-config \
        --out "$OUT/r/tune_extend_cuda.json"
    TAIL=25 step 150 multimodal python benchmarks/multimodal.py --out "$OUT/r/multimodal_cuda.json"
    TAIL=8 step 60 pytest_mm python -m pytest -q -m gpu tests/multimodal -p no:cacheprovider
elif [ "$part" = 2 ]; then
    TAIL=16 step 230 serving python benchmarks/serving.py "${cfg[@]}" --load-format dummy \
        --concurrency 64,256,1024 --input-len 512 --output-len 256 --modes offline,stream \
        --repeats 1 --out "$OUT/r/serving_ab_cuda.json"
    TAIL=12 step 130 serving_rates python benchmarks/serving.py "${cfg[@]}" --load-format dummy \
        --concurrency 1024 --num-prompts 256 --input-len 512 --output-len 256 --modes stream \
        --request-rate 8,32,inf --repeats 1 --out "$OUT/r/serving_rates_cuda.json"
    TAIL=6 step 70 prefill python benchmarks/gpu.py prefill --skip-hf --repeats 2 \
        --out "$OUT/r/gpu_prefill_untuned_extend_cuda.json"
    for mode in plain mixed; do
        extra=(); [ "$mode" = mixed ] && extra=(--engine-arg enable_mixed_chunk=true)
        TAIL=6 step 80 "offline256_$mode" python benchmarks/gpu.py offline --skip-hf --repeats 1 \
            --num-prompts 256 "${extra[@]}" --out "$OUT/r/gpu_offline_256_${mode}_cuda.json"
    done
elif [ "$part" = 3 ]; then
    TAIL=14 step 200 tune_extend python benchmarks/tune_extend.py --write-config \
        --out "$OUT/r/tune_extend_cuda.json"
    mkdir -p "$OUT/configs" && cp braid/kernels/configs/*.json "$OUT/configs/"
    TAIL=6 step 30 prefill python benchmarks/gpu.py prefill --skip-hf --repeats 2 \
        --out "$OUT/r/gpu_prefill_tuned_extend_cuda.json"
    for mode in plain mixed; do
        extra=(); [ "$mode" = mixed ] && extra=(--engine-arg enable_mixed_chunk=true)
        TAIL=6 step 110 "offline1024_$mode" python benchmarks/gpu.py offline --skip-hf \
            --repeats 1 "${extra[@]}" --out "$OUT/r/gpu_offline_1024_${mode}_cuda.json"
    done
elif [ "$part" = 4 ]; then
    TAIL=6 step 90 pytest_attn python -m pytest -q -m gpu tests/kernels/test_attention.py \
        tests/kernels/test_triton_backend.py -p no:cacheprovider
    TAIL=8 step 110 fi_jit python benchmarks/attention_backends.py jit \
        --out "$OUT/r/flashinfer_jit_aot_cuda.json"
    TAIL=15 step 200 pytest_fi python -m pytest -q -m gpu \
        tests/kernels/test_flashinfer_backend.py -p no:cacheprovider --maxfail 5
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
else
    TAIL=25 step 300 pytest_runtime python -m pytest -q -m gpu tests/runtime -p no:cacheprovider \
        --maxfail 5 --ignore tests/runtime/test_grammar_backends.py
    TAIL=12 step 170 serving_2clients python benchmarks/serving.py "${cfg[@]}" \
        --load-format dummy --concurrency 1024 --input-len 512 --output-len 256 \
        --modes stream,whole --clients 2 --repeats 1 --out "$OUT/r/serving_2clients_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
