#!/usr/bin/env bash
# The H200 session of 2026-12-02 (fourth of the day), in calls that each fit the device tool's
# 10-minute limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after
# `source .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl
# flashinfer-python==0.5.3 nvidia-ml-py requests opentelemetry-api uvloop pillow, then the
# image's own packages deleted: benchmarks/flashinfer_session.sh says which) and .gpu/tok
# (SmolLM2's tokenizer files, from the converted embedded model in braid's cache).
#   part 1 (a fresh machine, diagnosis): what the interpreter does with bytecode there, the
#          import times of the server's pre-spawn modules, torch + CUDA and the tokenizer; start
#          to ready of `braid serve` with the 8B config, fresh then second starts, now with the
#          scheduler's load split into phases (issue 20); the multimodal benchmark with both of
#          its braid runs recorded by the torch profiler (issue 15)
#   part 2: the GPU tests the changes touch (graphs captured while idle, the extend metadata's
#          alignment, the towers' attention backends); start-up again with decode graphs
#          between the powers of two captured while idle, and with bytecode written as an
#          installed package has it (the machine sets PYTHONDONTWRITEBYTECODE=1, so each start
#          there compiled the carried packages and braid from source) (issue 20)
#   part 3: part 2's failed GPU tests again (a tuple where torch wants a list of attention
#          backends; a test's running-request cap below its graph size), the multimodal
#          benchmark against transformers, then again recorded by the profiler
#          with the old 4-request warm-up, to see whether the timed run still compiles (issue 15)
#   part 4: the multimodal GPU tests and benchmark with the tower's gated MLP widened to a
#          multiple of 64 and its SwiGLU as one kernel (issue 15)
# The device tool brings back at most 8 files per call: each part tars $OUT.
set -u
part=${1:?part 1 to 4}
source "$(dirname "$0")/step.sh"
tok=.gpu/tok
cfg=(--config llama-3.1-8b --tokenizer "$tok")
if [ "$part" = 1 ]; then
    nvidia-smi -L; nproc
    {
        echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"
        python -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode)"
        touch .write_probe && echo "tree writable" && rm .write_probe
        python -c "import transformers, os; p=os.path.dirname(transformers.__file__); \
print(p, 'writable' if os.access(p, os.W_OK) else 'read-only', \
os.path.isdir(os.path.join(p, '__pycache__')))"
        for i in 1 2; do
            /usr/bin/time -f "pre-spawn imports %e s" python -c "from braid.runtime.server import \
cli; from braid.runtime.assets import ModelAssets; from braid.runtime.launch import \
spawn_runtime; from braid.runtime.tokenizer.manager import TokenizerManager"
            /usr/bin/time -f "torch + CUDA init %e s" python -c "import torch; torch.zeros(1).cuda()"
            /usr/bin/time -f "transformers tokenizer %e s" python -c "from transformers import \
AutoTokenizer; AutoTokenizer.from_pretrained('$tok')"
            /usr/bin/time -f "braid load_tokenizer %e s" python -c "from pathlib import Path; \
from braid.runtime.tokenizer.tokenizer import load_tokenizer; load_tokenizer(Path('$tok'))"
        done
        python -X importtime -c "from braid.runtime.server import cli; from braid.runtime.assets \
import ModelAssets; from braid.runtime.launch import spawn_runtime; from \
braid.runtime.tokenizer.manager import TokenizerManager" 2>&1 | sort -t'|' -k2 -n | tail -25
    } >"$OUT/env.log" 2>&1
    cat "$OUT/env.log" | head -30
    TAIL=16 step 240 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_cuda.json"
    TAIL=12 step 170 multimodal python benchmarks/multimodal.py --skip-hf --profile "$OUT/prof" \
        --out "$OUT/r/multimodal_profiled_cuda.json"
    for f in "$OUT"/prof/*/*.txt; do echo "== $f"; tail -6 "$f"; done
    (cd "$OUT" && tar czf logs.tgz ./*.log r prof)
elif [ "$part" = 2 ]; then
    unset PYTHONDONTWRITEBYTECODE
    python -m compileall -q -j 16 /tmp/site braid >/dev/null 2>&1
    {
        for i in 1 2; do
            /usr/bin/time -f "braid load_tokenizer, bytecode written %e s" python -c "from \
pathlib import Path; from braid.runtime.tokenizer.tokenizer import load_tokenizer; \
load_tokenizer(Path('$tok'))"
        done
    } >"$OUT/env2.log" 2>&1
    cat "$OUT/env2.log"
    TAIL=8 step 200 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_cuda_graph.py \
        tests/kernels/test_triton_backend.py tests/multimodal -p no:cacheprovider --maxfail 5
    TAIL=24 step 200 startup python benchmarks/startup.py "${cfg[@]}" --repeats 2 \
        --server-args "--load-format dummy" --out "$OUT/r/startup_8b_lazy_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
elif [ "$part" = 4 ]; then
    TAIL=8 step 150 pytest_mm python -m pytest -q -m gpu tests/multimodal -p no:cacheprovider \
        --maxfail 5
    TAIL=12 step 260 multimodal python benchmarks/multimodal.py \
        --out "$OUT/r/multimodal_widened_cuda.json"
    (cd "$OUT" && tar czf logs.tgz ./*.log r)
else
    TAIL=8 step 150 pytest_gpu python -m pytest -q -m gpu tests/runtime/test_cuda_graph.py \
        tests/multimodal -p no:cacheprovider --maxfail 5
    TAIL=25 step 260 multimodal python benchmarks/multimodal.py --out "$OUT/r/multimodal_cuda.json"
    TAIL=8 step 150 multimodal_prof python benchmarks/multimodal.py --skip-hf --warmup 4 \
        --profile "$OUT/prof" --out "$OUT/r/multimodal_profiled_warmup4_cuda.json"
    for f in "$OUT"/prof/*/*.txt; do echo "== $f"; tail -8 "$f"; done
    rm -f "$OUT"/prof/*/*.trace.json.gz
    (cd "$OUT" && tar czf logs.tgz ./*.log r prof)
fi
