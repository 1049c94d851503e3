#!/usr/bin/env bash
# The H200 session of 2026-12-05 (thirteenth), in calls that fit the device tool's 10-minute
# limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after `source
# .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py requests
# pillow, then the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe
# filelock cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm).
# Earlier sessions' parts are in this file's git history (the twelfth's: 2b5d675).
#   part 1 (issue 18: the int4 GEMV reads at 0.30-0.54 of the copy rate, fp8's tensor-core
#          gate_up at 0.88; int4 batch-1 decode 1.60-1.65x bf16 against 2.5x): the GEMVs' GPU
#          tests; the one-row sweep of int4 and fp8 with every split configuration also
#          launched splits first (GemvConfig.splits_first), int4's packed configurations also
#          in the second packed form (codes as float16 subnormals, the zero after: 13-22%
#          fewer instructions), its choices recorded; batch-1 decode of bf16, int4 and fp8
#          with them; the GEMVs under Nsight Compute (benchmarks/profile_gemv.py)
#   part 2: the int4 step kernel by kernel (gpu_step.py); batch-1 decode without PDL, then
#          with it for every kind (BRAID_PDL=all)
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
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ "$part" = 1 ]; then
    BRAID_PDL=0 TAIL=30 step 200 quant_kernels python benchmarks/quant_kernels.py \
        --methods bf16,int4,fp8 --rows 1 --write-config \
        --out "$OUT/r/quant_kernels_sf_p${part}_cuda.json"
    cp braid/kernels/configs/quant_gemv.json "$OUT/r/" 2>/dev/null
    pack
    TAIL=14 step 120 quantization python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_sf_p${part}_cuda.json"
    pack
    TAIL=6 step 90 pytest_gpu python -m pytest -q -m gpu tests/kernels/test_quant_gemv.py \
        -p no:cacheprovider
    pack
    # Nsight Compute with the clocks left alone (METHOD.md); the report stays on the machine.
    TAIL=16 step 120 ncu "$NCU" --clock-control none --profile-from-start off --set full \
        -f -o /tmp/gemv python benchmarks/profile_gemv.py
    "$NCU" -i /tmp/gemv.ncu-rep --page raw --csv >"$OUT/r/profile_gemv_raw.csv" 2>"$OUT/ncu_raw.log"
    TAIL=14 step 30 profile_summary python benchmarks/profile_gemv.py \
        --summarize "$OUT/r/profile_gemv_raw.csv" --out "$OUT/r/profile_gemv_cuda.json"
fi
if [ "$part" = 2 ]; then
    TAIL=40 step 80 gpu_step_int4 python benchmarks/gpu_step.py --method int4 \
        --out "$OUT/r/gpu_step_int4_p${part}_cuda.json"
    pack
    BRAID_PDL=0 TAIL=14 step 160 quantization_nopdl python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_nopdl_p${part}_cuda.json"
    pack
    BRAID_PDL=all TAIL=14 step 160 quantization_pdl python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_pdl_p${part}_cuda.json"
fi
kill "$smi"
pack
