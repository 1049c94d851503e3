#!/usr/bin/env bash
# The H200 session of 2026-12-03 (fifth of the day), in calls that fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py
# requests opentelemetry-api uvloop pillow llguidance xgrammar, then the image's own packages
# deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock cuda_bindings
# cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 16: the JSON schema at batch 256 stayed at +3.2%, with the scheduler's
#          thread waiting ~1.1 ms a step for the mask thread): the GPU tests of the grammar
#          path; then the regex and JSON-schema workloads at 64 and 256 (5 repeats) with the
#          early fill on one thread, then shared by two (BRAID_GRAMMAR_FILL_SPLITS=2), each
#          run recording how long the scheduler waited to read each step back (near zero: the
#          host sets the pace). The switch was removed after this run: it gained nothing
#   part 2 (part 1: the scheduler waited 4-7 ms a step to read each step back at 256, so the
#          device set the pace, and two fill threads changed nothing): the regex and JSON
#          workloads at 1, 64 and 256, 5 repeats, the defaults
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1 or 2}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
sg() { python benchmarks/structured_gpu.py --tokenizer "$tok" --repeats 5 \
    --workloads regex,json --batch-sizes 64,256 "$@"; }
if [ "$part" = 1 ]; then
    { nproc; python -c "import os; print(len(os.sched_getaffinity(0)), 'CPUs usable')"; } \
        >"$OUT/env.log" 2>&1
    TAIL=4 step 130 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_cuda_graph.py \
        tests/runtime/test_overlap.py tests/runtime/test_constrained.py \
        -k "grammar or constrained or overlap" -p no:cacheprovider
    TAIL=8 step 170 structured_1 sg --out "$OUT/r/structured_gpu_splits1_a_cuda.json"
    BRAID_GRAMMAR_FILL_SPLITS=2 TAIL=8 step 170 structured_2 sg \
        --out "$OUT/r/structured_gpu_splits2_a_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 2 ]; then
    TAIL=12 step 300 structured sg --batch-sizes 1,64,256 \
        --out "$OUT/r/structured_gpu_readback_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
