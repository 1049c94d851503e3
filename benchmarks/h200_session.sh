#!/usr/bin/env bash
# The H200 session of 2026-12-04 (third of the day), in calls that fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py
# requests opentelemetry-api uvloop pillow llguidance xgrammar flashinfer-python==0.5.3, then
# the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock
# cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 23: at 32 programs/s lpm's p99 had not passed 4x the unloaded latency; the
#          program policy lost to lpm on programs alike in length; pins now give way to the
#          queue's head; aging 30 s a level, not 2): agents.py with the heavy-tailed mix
#          (`--mix heavy`) until lpm's p99 passes 4x the unloaded p99, then the uniform mix
#          at 64 programs/s
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
    TAIL=12 step 240 agents_heavy ag --mix heavy --rates 32,64 \
        --out "$OUT/r/agents_heavy_cuda.json"
    if [ "${UNIFORM:-1}" = 1 ]; then
        TAIL=12 step 170 agents_uniform ag --mix uniform --rates 64 \
            --out "$OUT/r/agents_uniform_cuda.json"
    fi
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
