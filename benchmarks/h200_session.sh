#!/usr/bin/env bash
# The H200 session of 2026-12-04 (seventh of the day), in calls that fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py
# requests opentelemetry-api uvloop pillow llguidance xgrammar flashinfer-python==0.5.3, then
# the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock
# cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 23: the program policies with program identity in every setup, sessions or
#          not, and `program-srpt`, the program predicted to need the least work first):
#          agents.py, 256 programs on 4096 KV tokens, lpm, program and program-srpt, the
#          heavy-tailed mix at 32/s, then the uniform mix at 64/s
#   part 2 (one run per setup cannot tell 1.2x from 1.5x here): the heavy mix again, twice
#   part 3 (the issue asks for every setup in one run): the heavy mix with fcfs, lpm, program,
#          program + pins and program-srpt
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1 to 3}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
ag() { python benchmarks/agents.py --gpu-config llama-3.1-8b --tokenizer "$tok" \
    --programs 256 --kv-tokens 4096 --setups lpm,program,program-srpt "$@"; }
if [ "$part" = 1 ]; then
    { nproc; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; } >"$OUT/env.log" 2>&1
    TAIL=8 step 300 agents_heavy_srpt ag --mix heavy --rates 32 \
        --out "$OUT/r/agents_heavy_srpt_cuda.json"
    TAIL=8 step 240 agents_uniform_srpt ag --mix uniform --rates 64 \
        --out "$OUT/r/agents_uniform_srpt_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 3 ]; then
    TAIL=10 step 420 agents_heavy_all ag --mix heavy --rates 32 \
        --setups fcfs,lpm,program,program+pins,program-srpt --out "$OUT/r/agents_heavy_all_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 2 ]; then
    for i in 2 3; do
        TAIL=8 step 270 "agents_heavy_srpt_$i" ag --mix heavy --rates 32 \
            --out "$OUT/r/agents_heavy_srpt_${i}_cuda.json"
    done
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
if [ "$part" = 3 ]; then
    TAIL=10 step 420 agents_heavy_all ag --mix heavy --rates 32 \
        --setups fcfs,lpm,program,program+pins,program-srpt --out "$OUT/r/agents_heavy_all_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
