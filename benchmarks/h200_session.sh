#!/usr/bin/env bash
# The H200 session of 2026-12-03 (first of the day), in calls that each fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow, then the
# image's own packages deleted: benchmarks/flashinfer_session.sh says which) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
# Before these, one diagnostic call on a fresh machine ran startup.py (fresh and second start),
# an in-process capture of the start sizes under cProfile (warm: ~0.1 s a size, against 0.4-5 s
# in `braid serve`, whose scheduler loads the tokenizer in a thread meanwhile), and the
# multimodal benchmark under the torch profiler (logs/h200_2026-12-03a/).
#   part 1 (a fresh machine): start to ready of `braid serve` with the 8B config, fresh then
#          second starts, with the scheduler process's short GIL slices (issue 20); the GIL
#          slice benchmark on CUDA; the GPU tests the changes touch (the tower in window order,
#          M-RoPE through the fused rotary kernel); the autotuner's choices of those starts
#   part 2: the multimodal benchmark against transformers (issue 15)
# The device tool brings back at most 8 files per call: each part tars $OUT.
set -u
part=${1:?part 1 or 2}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
cfg=(--config llama-3.1-8b --tokenizer "$tok")
if [ "$part" = 1 ]; then
    TAIL=30 step 240 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_gil_cuda.json"
    TAIL=4 step 60 gil python benchmarks/gil_slices.py --out "$OUT/r/gil_slices_cuda.json"
    TAIL=8 step 200 pytest_gpu python -m pytest -q -m gpu tests/multimodal \
        tests/kernels/test_elementwise.py tests/kernels/test_skinny_gemm.py -p no:cacheprovider \
        --maxfail 5
    # The autotuner's choices (skinny GEMM at batch 1 of the 8B shapes) from the starts above.
    root=${BRAID_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/braid}
    find "$root/triton" -name "*.autotune.json" | head -40 | xargs -r -I{} sh -c \
        'echo "== {}"; cat "{}"; echo' >"$OUT/autotune.log" 2>&1
    TAIL=6 step 60 choices python benchmarks/skinny_choices.py --cache "$root/triton" \
        --out "$OUT/r/skinny_gemm.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
else
    TAIL=8 step 280 multimodal python benchmarks/multimodal.py --out "$OUT/r/multimodal_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
