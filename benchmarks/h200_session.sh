#!/usr/bin/env bash
# The H200 session of 2026-12-05 (twelfth), in calls that fit the device tool's 10-minute
# limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after `source
# .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py requests
# pillow, then the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe
# filelock cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm).
# Earlier sessions' parts are in this file's git history (the eleventh's: dcf77a9).
#   part 1 (issue 18: int4 batch-1 decode at 1.44-1.49x bf16 on the H200 against 2.5x, fp8 at
#          1.37x against 1.7x; 1.81x int4 on the H100, where the packed float16-pairs GEMV was
#          within 6% of the float32 form): batch-1 decode bf16, int4 and fp8 with programmatic
#          dependent launch (braid/kernels/pdl.py: the quantized GEMVs and bf16's skinny
#          GEMMs), then all three without it (BRAID_PDL=0);
#          the one-row int4 sweep of both forms on the H200 (with the deeper pipelines the H100
#          never ran), its choices recorded and int4 decode again with them
#   part 2 (part 1 with PDL: bf16 -3%, int4 -5%, fp8 +4%; the sweep's packed choices took int4
#          from 324 to 366 tok/s): the decode comparison again, without PDL first, then with it
#          for every kind (BRAID_PDL=all), int4 at the recorded choices
#   part 3: part 2's short form, bf16 and int4 only
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
    # PDL (braid/kernels/pdl.py): the one-row GEMVs start while the kernel before them runs,
    # ask L2 for their weights, then wait. Their GPU tests (CUDA graphs included) run with it.
    TAIL=8 step 300 pytest_gpu python -m pytest -q -m gpu tests/kernels/test_quant_gemv.py \
        tests/kernels/test_pdl.py tests/kernels/test_elementwise.py \
        tests/kernels/test_skinny_gemm.py -p no:cacheprovider
    pack
    BRAID_PDL=all TAIL=14 step 220 quantization python benchmarks/quantization.py \
        --methods float,int4,fp8 \
        --batch-sizes 1 --repeats 2 --out "$OUT/r/quantization_pdl_p${part}_cuda.json"
    pack
    BRAID_PDL=0 TAIL=14 step 220 quantization_nopdl python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_nopdl_p${part}_cuda.json"
    pack
    BRAID_PDL=0 TAIL=40 step 200 quant_kernels python benchmarks/quant_kernels.py \
        --methods bf16,int4 --rows 1 --write-config \
        --out "$OUT/r/quant_kernels_int4_h200_p${part}_cuda.json"
    cp braid/kernels/configs/quant_gemv.json "$OUT/r/" 2>/dev/null
    pack
    TAIL=8 step 120 quantization_tuned python benchmarks/quantization.py --methods int4 \
        --batch-sizes 1 --repeats 2 --out "$OUT/r/quantization_int4_tuned_p${part}_cuda.json"
fi
if [ "$part" = 2 ]; then
    # Part 1 again the other way round, with the H200's int4 choices recorded: without PDL,
    # then with it for every kind (BRAID_PDL=all).
    BRAID_PDL=0 TAIL=14 step 160 quantization_nopdl python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_nopdl_p${part}_cuda.json"
    pack
    BRAID_PDL=all TAIL=14 step 160 quantization_pdl python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_pdl_p${part}_cuda.json"
fi
if [ "$part" = 3 ]; then
    # The short form of part 2 (the budget's last minutes): bf16 and int4 at the defaults (no
    # PDL for either, the H200's int4 choices), then int4 with PDL.
    TAIL=10 step 120 quantization_default python benchmarks/quantization.py \
        --methods float,int4 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_default_p${part}_cuda.json"
    pack
    BRAID_PDL=int4 TAIL=8 step 60 quantization_int4_pdl python benchmarks/quantization.py \
        --methods int4 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_int4_pdl_p${part}_cuda.json"
fi
kill "$smi"
pack
