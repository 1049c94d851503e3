#!/usr/bin/env bash
# The H200 session of 2026-12-03 (fourth of the day), in one call that fits the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow llguidance
# xgrammar, then the image's own packages deleted: benchmarks/flashinfer_session.sh says which)
# and .gpu/tok (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Earlier sessions' parts are in this file's git history.
#   part 1 (issue 16, on a fresh machine): xgrammar is now the grammar backend on CUDA, built
#          while the weights load (its import brings transformers') with the compile pool's
#          workers started before the capture. Start to ready of `braid serve` with the 8B
#          config (the fresh start, then second starts), each followed at once by a first
#          JSON-schema request; the GPU tests of that path; then constrained decoding's
#          overhead against the same free decode with the defaults (xgrammar, jump-forward off
#          on CUDA): the regex and JSON-schema workloads at batch 1, 64, 256
#   part 2 (after part 1: the first constrained request right at ready took 1.0-3.7 s, the
#          compile pool's worker still importing xgrammar; and xgrammar's batch fill with
#          every CPU's thread took 36 us a row at 64, slower than one matcher at a time): the
#          workers now start as the scheduler's load begins. Start to ready with the first
#          request again; the GPU tests of that path; the libraries' batch calls with 1, 2, 4
#          and all threads; the workloads with one fill thread (BRAID_GRAMMAR_THREADS=1) and
#          with all, in one session
#   part 3 (the final tree, one fill thread the default): the workloads at 1, 64, 256 with
#          5 repeats; the GPU tests of the grammar path
#   part 4 (the fresh start paid the 1.1-1.3 s of xgrammar's import before the capture): the
#          import beside the capture instead (BRAID_GRAMMAR_BEFORE_CAPTURE=0) against before
#          it, alternating, each start with an empty Triton cache (a fresh machine's kernel
#          compiles), then second starts of each. The switch was removed once this run
#          had chosen: the compiler is now built beside the capture and waited for after
#          it (the ready line's "grammar"); the start with BRAID_GRAMMAR_BEFORE_CAPTURE=0
#          is today's code, =1 the previous commit's. The second starts' first run found
#          braid's own Triton cache empty (the fresh starts used their own), so it was a
#          fresh start too
# Logs: parts 1-4 in benchmarks/results/logs/h200_2026-12-03h, i, j and k.
# The device tool brings back at most 8 files per call: the part tars $OUT.
set -u
part=${1:?part 1, 2, 3 or 4}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
cfg=(--config llama-3.1-8b --tokenizer "$tok")
if [ "$part" = 1 ]; then
    { nproc; python -c "import os; print(len(os.sched_getaffinity(0)), 'CPUs usable')"; } \
        >"$OUT/env.log" 2>&1
    # Bytecode as an installed braid has it: the first start writes it, later ones read it.
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    unset PYTHONDONTWRITEBYTECODE
    TAIL=24 step 200 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --first-request --server-args "--load-format dummy" \
        --out "$OUT/r/startup_8b_xgrammar_cuda.json"
    TAIL=4 step 110 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_cuda_graph.py \
        tests/runtime/test_overlap.py tests/runtime/test_constrained.py \
        -k "grammar or constrained or overlap" -p no:cacheprovider
    TAIL=12 step 220 structured python benchmarks/structured_gpu.py --tokenizer "$tok" \
        --repeats 3 --workloads regex,json --batch-sizes 1,64,256 \
        --out "$OUT/r/structured_gpu_xgrammar_default_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 2 ]; then
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    unset PYTHONDONTWRITEBYTECODE
    TAIL=24 step 200 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --first-request --server-args "--load-format dummy" \
        --out "$OUT/r/startup_8b_xgrammar_early_cuda.json"
    TAIL=4 step 110 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_cuda_graph.py \
        tests/runtime/test_overlap.py tests/runtime/test_constrained.py \
        -k "grammar or constrained or overlap" -p no:cacheprovider
    TAIL=12 step 120 grammar_batch python benchmarks/grammar_batch.py --tokenizer "$tok" \
        --batches 64,256 --repeats 5 --threads 1,2,4,all \
        --out "$OUT/r/grammar_batch_threads_h200.json"
    sg() { python benchmarks/structured_gpu.py --tokenizer "$tok" --repeats 3 \
        --workloads regex,json "$@"; }
    BRAID_GRAMMAR_THREADS=1 TAIL=12 step 150 structured_1 sg --batch-sizes 1,64,256 \
        --out "$OUT/r/structured_gpu_xgrammar_1thread_cuda.json"
    TAIL=12 step 120 structured_all sg --batch-sizes 64,256 \
        --out "$OUT/r/structured_gpu_xgrammar_allthreads_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 3 ]; then
    TAIL=12 step 300 structured python benchmarks/structured_gpu.py --tokenizer "$tok" \
        --repeats 5 --workloads regex,json --batch-sizes 1,64,256 \
        --out "$OUT/r/structured_gpu_xgrammar_final_cuda.json"
    TAIL=4 step 110 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_cuda_graph.py \
        tests/runtime/test_overlap.py tests/runtime/test_constrained.py \
        -k "grammar or constrained or overlap" -p no:cacheprovider
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 4 ]; then
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    unset PYTHONDONTWRITEBYTECODE
    ab=(--ab-env BRAID_GRAMMAR_BEFORE_CAPTURE --first-request --server-args "--load-format dummy")
    TAIL=30 step 200 startup_fresh python benchmarks/startup.py "${cfg[@]}" "${ab[@]}" \
        --repeats 2 --fresh-triton --out "$OUT/r/startup_8b_grammar_ab_fresh_cuda.json"
    TAIL=16 step 100 startup_second python benchmarks/startup.py "${cfg[@]}" "${ab[@]}" \
        --repeats 1 --out "$OUT/r/startup_8b_grammar_ab_second_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
