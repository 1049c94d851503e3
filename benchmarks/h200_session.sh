#!/usr/bin/env bash
# The H200 session of 2026-12-03 (second of the day), in calls that each fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow, then the
# image's own packages deleted: benchmarks/flashinfer_session.sh says which) and .gpu: tok/
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache) and
# tokwait.patch (`git diff` of the change under test in part 1, reverted in a copy for the A/B).
# The day's first session (logs/h200_2026-12-03a and b) found the start sizes' capture taking
# 10 s in `braid serve` against 1.9 s in-process; short GIL slices did not change it.
#   part 1 (a fresh machine): bytecode compiled as pip's install does; start to ready of
#          `braid serve` with the 8B config: the fresh start (skinny GEMM choices from the
#          table), then second starts alternating the scheduler's tokenizer waited for before
#          capture (this tree) and loaded beside it (the copy with tokwait.patch reverted);
#          the GPU tests the changes touch
#   part 2: where the tokenizer's load goes, start to ready with bytecode; the multimodal
#          benchmark against transformers (issue 15)
#   part 3: start to ready again once the scheduler reads its grammar vocabulary without
#          transformers; the GPU tests of that path
# The device tool brings back at most 8 files per call: each part tars $OUT.
set -u
part=${1:?part 1, 2 or 3}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
cfg=(--config llama-3.1-8b --tokenizer "$tok")
if [ "$part" = 1 ]; then
    # An installed braid has bytecode (pip compiles at install); the machine sets
    # PYTHONDONTWRITEBYTECODE, so every start would otherwise compile braid and the carried
    # packages from source.
    rm -rf /tmp/old && mkdir /tmp/old && cp -r braid benchmarks tests /tmp/old/ \
        && (cd /tmp/old && patch -s -R -p1 <"$OLDPWD/.gpu/tokwait.patch")
    TAIL=2 step 120 compile python -m compileall -q -j 0 braid /tmp/old/braid /tmp/site
    new() { python benchmarks/startup.py "${cfg[@]}" --repeats 1 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_$1_cuda.json"; }
    old() { (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old python benchmarks/startup.py \
        --config llama-3.1-8b --tokenizer "$OLDPWD/$tok" --repeats 1 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_$1_cuda.json"); }
    TAIL=12 step 150 new1 new fresh
    TAIL=12 step 100 old1 old alongside1
    TAIL=12 step 100 new2 new waited2
    TAIL=12 step 100 old2 old alongside2
    TAIL=8 step 260 pytest_gpu python -m pytest -q -m gpu tests/multimodal \
        tests/kernels/test_elementwise.py tests/kernels/test_skinny_gemm.py \
        tests/runtime/test_overlap.py tests/runtime/test_cuda_graph.py -p no:cacheprovider --maxfail 5
    # The autotuner's choices (skinny GEMM at batch 1 of the 8B shapes) from the starts above:
    # empty where the table named every case.
    root=${BRAID_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/braid}
    TAIL=6 step 60 choices python benchmarks/skinny_choices.py --cache "$root/triton" \
        --out "$OUT/r/skinny_gemm.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 2 ]; then
    # Why the tokenizer takes 10+ s here (part 1: the scheduler waited 7-11 s for it): the time
    # to import transformers and load the tokenizer, without bytecode (as the machine runs
    # Python) and with it (PYTHONPYCACHEPREFIX: written by the first run, read by the second),
    # then start to ready with bytecode, as on an installed system.
    tokload=(-X importtime -c "import time; t = time.perf_counter()
from transformers import PreTrainedTokenizerFast
PreTrainedTokenizerFast.from_pretrained('$tok')
print('tokenizer loaded in', round(time.perf_counter() - t, 2), 's')")
    { python -c "import os, transformers; d = os.path.dirname(transformers.__file__)
print(d, 'has __pycache__:', os.path.isdir(os.path.join(d, '__pycache__')))"
      env | grep '^PYTHON'; } >"$OUT/env.log" 2>&1
    TAIL=1 step 60 tok_plain python "${tokload[@]}"
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    unset PYTHONDONTWRITEBYTECODE
    TAIL=1 step 60 tok_bytecode1 python "${tokload[@]}"
    TAIL=1 step 60 tok_bytecode2 python "${tokload[@]}"
    TAIL=24 step 200 startup_bytecode python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_bytecode_cuda.json"
    TAIL=8 step 280 multimodal python benchmarks/multimodal.py --out "$OUT/r/multimodal_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 3 ]; then
    # After part 2: the scheduler's grammar vocabulary read without transformers. Start to
    # ready with bytecode (a fresh machine: the first start writes it, the later ones are
    # second starts), and the GPU tests of the constrained rows and the wait before capture.
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    unset PYTHONDONTWRITEBYTECODE
    TAIL=24 step 200 startup_vocab python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_vocab_cuda.json"
    TAIL=4 step 100 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_overlap.py \
        tests/runtime/test_cuda_graph.py tests/runtime/test_constrained.py -k "tokenizer or constrained" \
        -p no:cacheprovider
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
fi
