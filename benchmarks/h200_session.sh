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
#   part 3 (issue 18: fp8 at batch 1 was 1.27x bf16, its GEMVs at 0.46-0.73 of the copy rate,
#          converting and multiplying each weight on the CUDA cores): the fp8 GEMV with its
#          products on the tensor cores (GemvConfig.dot) beside the CUDA-core one, each
#          checked and timed at one row (quant_kernels.py, bf16 beside it), the fastest per
#          shape written to braid/kernels/configs/quant_gemv.json; then batch-1 decode and
#          the 8k prefill through braid.LLM, bf16 and fp8 (quantization.py), with that table;
#          the GEMV GPU tests (with that table) between. Run twice: the first run's
#          tensor-core sums were off by ~1e-3 (Triton's sm_90 default precision for e4m3
#          products), fixed before the second (logs/h200_2026-12-03m/*_imprecise.log)
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1, 2 or 3}
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
elif [ "$part" = 3 ]; then
    TAIL=40 step 200 quant_kernels python benchmarks/quant_kernels.py --methods bf16,fp8 \
        --rows 1 --write-config --out "$OUT/r/quant_kernels_fp8_dot_cuda.json"
    cp braid/kernels/configs/quant_gemv.json "$OUT/r/" 2>/dev/null
    TAIL=6 step 120 pytest_gemv python -m pytest -q -m gpu tests/kernels/test_quant_gemv.py \
        -p no:cacheprovider
    TAIL=30 step 330 quantization python benchmarks/quantization.py --methods float,fp8 \
        --batch-sizes 1 --repeats 2 --out "$OUT/r/quantization_fp8_dot_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
