#!/usr/bin/env bash
# On the lent GPU machine, the SNAC decoder alone (no vLLM, one small copy): after
# `bash bench/make_decoder_kit.sh` here, run(carry=[".gpu/deckit"]) with
#   bash bench/gpu_decoder_run.sh LIMIT_S [bench/decoder_speed.py arguments...]
# e.g. bash bench/gpu_decoder_run.sh 400 --read-sizes 8,32 --repeats 3 --chunk-frames 50
# (also after part 2's install, which leaves the same wheels in /tmp/site). The fleet bench's windows
# decoded as the GPU recipe runs the decoder (compiled, bfloat16), with the kernels' time
# (--device-time) and the fewest-frames grouping beside the fleet's (--pass-costs 0); then, in what is
# left of LIMIT_S, the same reads of 32 with --cudnn-benchmark. $OUT gets card.txt (the card, the host
# CPU, each run's exit status), dec.log / dec.json, dec-cudnn.log / dec-cudnn.json and kernels.tgz
# (the profiler's table for each variant). DECODER_FLAGS replaces "--device cuda --compile --bf16".
set -u
limit=$1
shift
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import snac, pydantic_settings" 2>/dev/null; then # the lent machine's image: the kit
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/deckit/*.whl
fi
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  lscpu | grep -i "model name"
} > "$OUT/card.txt"
read -r -a flags <<< "${DECODER_FLAGS:---device cuda --compile --bf16}"
decode() { # NAME SECONDS [more decoder_speed.py arguments]
  local name=$1 seconds=$2
  shift 2
  if [ "$seconds" -le 20 ]; then
    echo "$name: not run, ${seconds} s left" >> "$OUT/card.txt"
    return
  fi
  timeout "$seconds" python3 bench/decoder_speed.py "${flags[@]}" --windows --device-time --pass-costs 0 \
    "$@" --out "/tmp/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit status $? at ${SECONDS} s" >> "$OUT/card.txt"
  cp "/tmp/$name/decoder_windows.json" "$OUT/$name.json" 2>/dev/null
}
rm -rf /tmp/dec /tmp/dec-cudnn
decode dec $((limit * 6 / 10)) "$@"
decode dec-cudnn $((limit - SECONDS)) "$@" --read-sizes 32 --cudnn-benchmark
tar czf "$OUT/kernels.tgz" -C /tmp $(cd /tmp && ls -d dec dec-cudnn 2>/dev/null)
cat "$OUT/card.txt"
grep -h "^RESULT windows" "$OUT/dec.log" "$OUT/dec-cudnn.log" 2>/dev/null | grep "new audio-s/s\|device time\| / "
