#!/usr/bin/env bash
# MiniLM FP16 served in NCHW (what `auto` picks for a graph without convolutions) against NHWC (what it picked
# before), beside FP32, on a GPU host after `make install` (docs/gpu.md): builds minilm_l6_v2 into REPO, copies
# its FP16 folder as minilm_fp16_nhwc with the runner parameter prefer_nhwc 1, serves the three with the product's
# defaults and runs perfclient at concurrency 32 (sequence 64), two rounds, each in both orders.
#   bench/gpu/minilm_layout.sh [REPO [OUT]]     (defaults: /tmp/mrepo, reports/gpu/minilm_layout)
set -u
cd "$(dirname "$0")/../.."
R=${1:-/tmp/mrepo}; out=${2:-reports/gpu/minilm_layout}
mkdir -p "$out"
.venv/bin/trtbuild engines --only minilm_l6_v2 --repository "$R" > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
grep -E "^minilm" "$out/build.log"
rm -rf "$R/minilm_l6_v2_int8" "$R/minilm_fp16_nhwc"; cp -r "$R/minilm_l6_v2_fp16" "$R/minilm_fp16_nhwc"
.venv/bin/python - "$R/minilm_fp16_nhwc/config.pbtxt" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read().replace('name: "minilm_l6_v2_fp16"', 'name: "minilm_fp16_nhwc"')
changed = re.sub(r'(key: "prefer_nhwc"\s*value \{\s*string_value: ")auto(")', r'\g<1>1\2', text)
assert changed != text, "no prefer_nhwc: auto parameter in the FP16 config"
open(path, "w").write(changed)
PY
.venv/bin/trtbuild serve --repository "$R" --background > "$out/serve.log" 2>&1 || { cat "$out/serve.log"; exit 1; }
P=(.venv/bin/perfclient -u localhost:8001 --concurrency 32 --shape input_ids:64 --shape attention_mask:64
   --measurement-interval 3000 --max-trials 5)
status=0
for r in 1 2; do
  "${P[@]}" -m minilm_l6_v2_fp32 -m minilm_l6_v2_fp16 -m minilm_fp16_nhwc > "$out/perf_${r}a.txt" 2>&1 || status=1
  "${P[@]}" -m minilm_fp16_nhwc -m minilm_l6_v2_fp16 -m minilm_l6_v2_fp32 > "$out/perf_${r}b.txt" 2>&1 || status=1
  grep -hE "^minilm.*concurrency" "$out/perf_${r}a.txt" "$out/perf_${r}b.txt"
done
.venv/bin/trtbuild stop
exit $status
