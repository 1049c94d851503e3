#!/usr/bin/env bash
# The H200 session of 2026-12-04 (fourth of the day), in calls that fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py
# requests opentelemetry-api uvloop pillow llguidance xgrammar flashinfer-python==0.5.3, then
# the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock
# cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 23: the third session's run ended, at its step limit, while program + pins
#          ran): agents.py, heavy-tailed mix, 256 programs at 32/s (where lpm's p99 passed 4x
#          the unloaded p99 then), all four setups; then the uniform mix at 64/s, as far as
#          the call's time allows
#   part 2 (pins cost the program policy on the H200 in part 1: 1.52x -> 1.25x heavy, 0.91x ->
#          0.60x uniform; pins are now made only where they pay, `scheduler/pin_cost.py`):
#          both mixes again, lpm, program and program + pins
#   part 3 (how far one run is from the next; and a pool where the rule keeps pins): the heavy
#          mix at 32/s again on 4096 KV tokens, then on 16384 (there C > p x r: pins are made)
#   part 4 (the rule is now asked only while requests wait): part 2 again
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1 or 2}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
off() { python benchmarks/gpu.py offline --skip-hf --repeats 1 "$@"; }
if [ "$part" = 1 ]; then
    { nproc; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; } >"$OUT/env.log" 2>&1
    ag() { python benchmarks/agents.py --gpu-config llama-3.1-8b --tokenizer "$tok" \
        --programs 256 --kv-tokens 4096 "$@"; }
    TAIL=14 step 380 agents_heavy ag --mix heavy --rates 32 \
        --out "$OUT/r/agents_heavy_cuda.json"
    TAIL=14 step "${UNIFORM_S:-150}" agents_uniform ag --mix uniform --rates 64 \
        --setups lpm,program,program+pins --out "$OUT/r/agents_uniform_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 2 ] || [ "$part" = 4 ]; then
    v=paying; [ "$part" = 4 ] && v=queued
    ag() { python benchmarks/agents.py --gpu-config llama-3.1-8b --tokenizer "$tok" \
        --programs 256 --kv-tokens 4096 --setups lpm,program,program+pins "$@"; }
    TAIL=8 step 260 "agents_heavy_$v" ag --mix heavy --rates 32 \
        --out "$OUT/r/agents_heavy_${v}_cuda.json"
    TAIL=8 step 200 "agents_uniform_$v" ag --mix uniform --rates 64 \
        --out "$OUT/r/agents_uniform_${v}_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 3 ]; then
    ag() { python benchmarks/agents.py --gpu-config llama-3.1-8b --tokenizer "$tok" \
        --programs 256 --setups lpm,program,program+pins --mix heavy --rates 32 "$@"; }
    TAIL=8 step 250 agents_heavy_again ag --kv-tokens 4096 \
        --out "$OUT/r/agents_heavy_again_cuda.json"
    TAIL=8 step 250 agents_heavy_16k ag --kv-tokens 16384 \
        --out "$OUT/r/agents_heavy_16k_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
