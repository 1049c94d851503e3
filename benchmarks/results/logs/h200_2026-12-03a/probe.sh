# Diagnostic GPU call (not part of braid): fresh start, capture probes, multimodal profile.
source benchmarks/step.sh
cfg=(--config llama-3.1-8b --tokenizer .gpu/tok)
TAIL=14 step 130 startup python benchmarks/startup.py "${cfg[@]}" --repeats 1 \
    --server-args "--load-format dummy" --out "$OUT/r/startup_fresh_cuda.json"
export TRITON_CACHE_DIR=/tmp/tc
TAIL=0 step 110 probe1 python .gpu/capture_probe.py
TAIL=0 step 80 probe2 python .gpu/capture_probe.py
unset TRITON_CACHE_DIR
TAIL=6 step 200 mm python benchmarks/multimodal.py --skip-hf --profile "$OUT/prof" \
    --out "$OUT/r/mm_profiled_cuda.json"
(cd "$OUT" && tar czf logs.tgz ./*.log r prof)
