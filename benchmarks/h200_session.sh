#!/usr/bin/env bash
# The H200 session of 2026-12-05 (eleventh), in calls that fit the device tool's 10-minute
# limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after `source
# .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py requests
# pillow, then the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe
# filelock cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm).
# Earlier sessions' parts are in this file's git history (the tenth's: 69e2e8d).
#   part 1 (issue 18: int4 batch-1 decode at 1.44-1.49x bf16 against 2.5x; the float32 int4
#          GEMV issues 4.4 instructions a weight on sm_90, the new float16-pairs form
#          (GemvConfig.packed, int4_gemv_f16x2) 2.6 by `benchmarks/sass_counts.py`): the GEMV
#          GPU tests (the PTX packing and the fused norm / activation against the reference),
#          the one-row sweep of both forms with the fastest recorded, the packed form against
#          the float32 one and the fused prologues against separate kernels (kernel_timings),
#          then batch-1 decode float against int4 (now with the norms and the activation fused
#          into the packed GEMVs: layers.fusion._quantized_one_row) through braid.LLM
#   part 2 (part 1 ran on an H100: the packed form within +-6% of the float32 form at each
#          shape's best, so the GEMVs are not bound by issuing instructions; the fused norm and
#          activation 2-4 us slower than the separate kernels, so the runtime no longer fuses
#          them; int4 decode 290.6 tok/s against the previous code's 304.9): batch-1 decode float
#          and int4 with the H100's recorded configurations (packed for qkv, o, down), and the
#          previous code's int4, in one run
set -u
part=${1:?part 1 or 2}
source "$(dirname "$0")/step.sh"
# The GPU's clocks, power and throttle reasons each second into $OUT/clocks.log ($smi: kill it).
clocks() {
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
clocks_throttle_reasons.active --format=csv -l 1 >"$OUT/clocks.log" 2>&1 &
    smi=$!
}
# The logs and JSON so far, packed after every step (a call cut short still brings them back).
pack() { (cd "$OUT" && tar czf logs.tgz ./*.log r); }
{ nproc; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; } >"$OUT/env.log" 2>&1
clocks
if [ "$part" = 1 ]; then
    TAIL=8 step 120 pytest_gemv python -m pytest -q -m gpu tests/kernels/test_quant_gemv.py \
        -p no:cacheprovider
    # The CPU tests of the packed form, its prologues and the fused int4 layer, on CUDA.
    TAIL=6 step 120 pytest_packed python -m pytest -q tests/kernels/test_quant_gemv.py \
        -k "pairs or fused or prologue" -p no:cacheprovider
    pack
fi
if [ "$part" = 1 ]; then
    TAIL=40 step 220 quant_kernels python benchmarks/quant_kernels.py --methods bf16,int4 \
        --rows 1 --write-config --out "$OUT/r/quant_kernels_int4_packed_p${part}_cuda.json"
    cp braid/kernels/configs/quant_gemv.json "$OUT/r/" 2>/dev/null
    pack
fi
TAIL=12 step 240 quantization python benchmarks/quantization.py --methods float,int4 \
    --batch-sizes 1 --repeats 2 --out "$OUT/r/quantization_int4_packed_p${part}_cuda.json"
pack
# The same batch-1 int4 decode with the previous commit's code (69e2e8d: float32 GEMVs, no
# fused norms), carried in .gpu/prev (`git archive 69e2e8d braid benchmarks/...`): the
# baseline in the same run.
if [ -d .gpu/prev ]; then
    PYTHONPATH=$PWD/.gpu/prev:${PYTHONPATH:-} TAIL=6 step 150 quantization_prev \
        python .gpu/prev/benchmarks/quantization.py --methods int4 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_int4_prev_p${part}_cuda.json"
    pack
fi
if [ "$part" = 1 ]; then
    TAIL=14 step 150 int4_kernels python benchmarks/kernel_timings.py --kernels int4_gemv \
        --out "$OUT/r/kernels_int4_p${part}_cuda.json"
fi
kill "$smi"
pack
