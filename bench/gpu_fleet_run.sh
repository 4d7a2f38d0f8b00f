#!/usr/bin/env bash
# On the lent GPU machine, after .gpu/part2/install.sh (docs/benchmarks.md "Running it on the H200"):
#   bash bench/gpu_fleet_run.sh NAME LIMIT_S [bench/fleet_vs_vllm.py arguments...]
# e.g. bash bench/gpu_fleet_run.sh 4x400 520 --jobs 4 --sentences 400 --rounds 2
# The bench's GPU settings (two engines under MPS, the compiled bfloat16 decoder held to 8 GiB, windows
# of one length), the KV cache per engine by the card's memory (43 GiB on an H200, 25 on an H100 80GB),
# at most LIMIT_S seconds; $OUT gets NAME.log (the bench's output), NAME.json (results.json),
# NAME-logs.tgz (every fleet child's log) and NAME.gpu (the card, the KV setting, the exit status).
# PyAV (.gpu/part3) is installed when carried; the bench writes WAV files, which do not need it.
set -u
name=$1 limit=$2
shift 2
if ls .gpu/part3/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/part3/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  NARRATE_DECODER_COMPILE=1 NARRATE_AR_ADMIT_BATCH=16 NARRATE_CUDA_MPS=1 NARRATE_DECODER_GPU_MEMORY_GB=8 \
  NARRATE_DECODER_BF16=1 NARRATE_UNIFORM_WINDOWS=1
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$memory_mib" -gt 100000 ]; then kv=43; else kv=25; fi
export NARRATE_VLLM_KV_CACHE_MEMORY_GB=${NARRATE_VLLM_KV_CACHE_MEMORY_GB:-$kv}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; echo "KV cache per engine: $NARRATE_VLLM_KV_CACHE_MEMORY_GB GiB"; } > "$OUT/$name.gpu"
rm -rf /tmp/bench
timeout "$limit" python3 bench/fleet_vs_vllm.py --model orpheus-3b-dummy --device cuda \
  --max-num-seqs 512 --ar-workers 2 --gpu-memory-utilization 0.37 --raw-max-num-seqs 512 \
  --raw-gpu-memory-utilization 0.75 --assemblers 2 --stream-interval 7 --timeout 200 \
  --data-dir /tmp/nb --out /tmp/bench "$@" > "$OUT/$name.log" 2>&1
echo "exit status $?" >> "$OUT/$name.gpu"
cp /tmp/bench/results.json "$OUT/$name.json" 2>/dev/null
tar czf "$OUT/$name-logs.tgz" -C /tmp/bench --exclude results.json . 2>/dev/null
grep -E "^(RESULT|PHASE)" "$OUT/$name.log" | grep -v "steady state\|timeline"
