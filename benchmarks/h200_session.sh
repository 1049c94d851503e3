#!/usr/bin/env bash
# The H200 session of 2026-12-05 (fourteenth), in calls that fit the device tool's 10-minute
# limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after `source
# .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py requests
# pillow, then the image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe
# filelock cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm).
# Earlier sessions' parts are in this file's git history (the thirteenth's: 593006a).
#   part 1 (issue 18: int4 batch-1 decode 1.60-1.65x bf16 on the H200 against 2.5x; the
#          thirteenth session's splits-first grid and second packed form were measured on an
#          H100 only): the one-row sweep of int4 and fp8 with both, beside the read floor of
#          each method's bytes (a kernel that only reads them, quant_kernels.py's read_*), its
#          choices recorded for the H200; batch-1 decode of bf16, int4 and fp8 with them; the
#          GEMVs' GPU tests
#   part 2: the int4 and bf16 (float) steps kernel by kernel (gpu_step.py); issue 21 (offline
#          at 0.60 of the bound): decode's attention and GEMMs at batch 1024 one after the
#          other against two half-batches on two streams (overlap_probe.py)
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
    BRAID_PDL=0 TAIL=60 step 260 quant_kernels python benchmarks/quant_kernels.py \
        --methods bf16,int4,fp8,read_bf16,read_int4,read_fp8 --rows 1 --write-config \
        --out "$OUT/r/quant_kernels_floor_p${part}_cuda.json"
    cp braid/kernels/configs/quant_gemv.json "$OUT/r/" 2>/dev/null
    pack
    TAIL=14 step 130 quantization python benchmarks/quantization.py \
        --methods float,int4,fp8 --batch-sizes 1 --repeats 2 \
        --out "$OUT/r/quantization_p${part}_cuda.json"
    pack
    TAIL=6 step 100 pytest_gpu python -m pytest -q -m gpu tests/kernels/test_quant_gemv.py \
        -p no:cacheprovider
fi
if [ "$part" = 2 ]; then
    for method in int4 float; do
        TAIL=40 step 100 "gpu_step_$method" python benchmarks/gpu_step.py --method "$method" \
            --out "$OUT/r/gpu_step_${method}_p${part}_cuda.json"
        pack
    done
    TAIL=6 step 120 overlap_probe python benchmarks/overlap_probe.py \
        --out "$OUT/r/overlap_probe_p${part}_cuda.json"
fi
kill "$smi"
pack
