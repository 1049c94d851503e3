#!/usr/bin/env bash
# The H200 session of 2026-12-03 (third of the day), in one call that fits the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow, then the
# image's own packages deleted: benchmarks/flashinfer_session.sh says which) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 16): constrained decoding's overhead against the same free decode, with the
#          masks of a step run ahead filled in the mask thread: the regex and JSON-schema
#          workloads at batch 1, 64, 256 (llguidance, the default); at 256 the same with the
#          mask thread off (A/B in one session) and with xgrammar; the GPU tests of the
#          overlap schedule and constrained rows; the grammar libraries' batch calls on this
#          machine's CPUs
#   part 2 (after part 1: the JSON workload's free runs slowed from 2.1 to 9.5 s as the
#          prefix cache filled, and its constrained runs were dominated by jump-forward's
#          extends): with the radix cache's eviction no longer walking the tree, and
#          llguidance advancing one grammar at a time, the workloads again, jump-forward off
#          (what the masks alone cost: the regex forces nothing either way) for llguidance
#          and xgrammar; then the JSON workload at batch 64 with jump-forward on, its
#          extends alone and carrying the running requests' decode rows (mixed chunks)
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1 or 2}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
if [ "$part" = 1 ]; then
    { nproc; python -c "import os; print(len(os.sched_getaffinity(0)), 'CPUs usable')"; } \
        >"$OUT/env.log" 2>&1
    sg() { python benchmarks/structured_gpu.py --tokenizer "$tok" --repeats 4 \
        --workloads regex,json "$@"; }
    TAIL=12 step 200 structured sg --out "$OUT/r/structured_gpu_maskthread_cuda.json"
    TAIL=6 step 90 structured_nothread sg --batch-sizes 256 \
        --engine-arg disable_grammar_mask_thread=true \
        --out "$OUT/r/structured_gpu_nothread_cuda.json"
    TAIL=6 step 100 structured_xgrammar sg --batch-sizes 64,256 \
        --engine-arg grammar_backend=xgrammar --out "$OUT/r/structured_gpu_xgrammar_thread_cuda.json"
    TAIL=4 step 110 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_overlap.py \
        tests/runtime/test_constrained.py -p no:cacheprovider
    TAIL=8 step 60 grammar_batch python benchmarks/grammar_batch.py --tokenizer "$tok" \
        --repeats 5 --out "$OUT/r/grammar_batch_h200.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 2 ]; then
    sg() { python benchmarks/structured_gpu.py --tokenizer "$tok" --repeats 3 "$@"; }
    TAIL=12 step 170 structured sg --workloads regex,json --batch-sizes 1,64,256 \
        --engine-arg disable_jump_forward=true --out "$OUT/r/structured_gpu_nojump_cuda.json"
    TAIL=8 step 120 structured_xgrammar sg --workloads regex,json --batch-sizes 64,256 \
        --engine-arg disable_jump_forward=true --engine-arg grammar_backend=xgrammar \
        --out "$OUT/r/structured_gpu_nojump_xgrammar_cuda.json"
    TAIL=6 step 60 structured_jump sg --workloads json --batch-sizes 64 \
        --out "$OUT/r/structured_gpu_json_jump_cuda.json"
    TAIL=6 step 60 structured_jump_mixed sg --workloads json --batch-sizes 64 \
        --engine-arg enable_mixed_chunk=true --out "$OUT/r/structured_gpu_json_jump_mixed_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
