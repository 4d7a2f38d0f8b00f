#!/usr/bin/env bash
# The wheels bench/decoder_speed.py --windows imports that the lent GPU machine's image lacks (its
# python3 has torch, numpy, einops, httpx), taken from the GPU bundle's part 2 (docs/benchmarks.md
# "Running it on the H200": make-bundle.sh): ~4 MiB in .gpu/deckit, so the decoder alone needs one
# small copy and no vLLM:
#   run(carry=[".gpu/deckit"]): python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/deckit/*.whl &&
#     PYTHONPATH=/tmp/site:$PWD python3 bench/decoder_speed.py --device cuda --compile --bf16 --windows --out $OUT/dec
set -euo pipefail
top=$(git rev-parse --show-toplevel)
src=$top/.gpu/part2/whl dest=$top/.gpu/deckit
mkdir -p "$dest"
for name in snac pydantic- pydantic_core pydantic_settings annotated_types typing_inspection python_dotenv \
    redis google_re2 prometheus_client psutil dill; do
  cp "$src/$name"*.whl "$dest/"
done
du -sh "$dest"
