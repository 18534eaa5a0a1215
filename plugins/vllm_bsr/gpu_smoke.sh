#!/usr/bin/env bash
# GPU smoke test: BSRConnector in a real vLLM on one GPU, tiny random-weight Llama made locally (no downloads).
# For the CPU build, scripts/test-vllm runs the full real-vLLM stage instead. Needs a venv with vllm (CUDA build),
# lmcache==0.5.6 and transformers: PY=/path/to/venv/bin/python plugins/vllm_bsr/gpu_smoke.sh [WORKDIR]
# Pass (exit 0) only when the second request's prefix was loaded: one complete load of the chunk-aligned prefix in
# the expected windows (bsr's event file), vLLM's cached-token count equal to it, LMCache's "Retrieved" line per
# window in the log, no pinning lookup, and both generations equal.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-python3}"
WD="${1:-$(mktemp -d "${TMPDIR:-/tmp}/bsr-gpu-smoke.XXXXXX")}"
mkdir -p "$WD/lmcache-disk"
cat > "$WD/lmcache.yaml" <<YAML
chunk_size: 256
local_cpu: false
max_local_cpu_size: 2.0
local_disk: "file://$WD/lmcache-disk/"
max_local_disk_size: 4.0
YAML
export LMCACHE_CONFIG_FILE="$WD/lmcache.yaml"
export LMCACHE_TRACK_USAGE=false
export LMCACHE_LOG_LEVEL=INFO  # LMCache's "Stored/Retrieved N tokens" lines
export BSR_VLLM_EVENTS="$WD/events.jsonl"
rm -f "$BSR_VLLM_EVENTS"
export PYTHONHASHSEED=0  # with vLLM importable, LMCache's chunk hashes are seeded unless this is set
export PYTHONPATH="$PWD/plugins:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
rc=0
timeout "${SMOKE_TIMEOUT_S:-540}" "$PY" plugins/vllm_bsr/gpu_smoke.py "$WD" > "$WD/smoke.log" 2>&1 || rc=$?
tail -n 5 "$WD/smoke.log"
if [ "$rc" -ne 0 ]; then
  echo "gpu smoke FAILED (exit $rc; log: $WD/smoke.log)" >&2
  exit 1
fi
# 2048 prefix tokens in windows of 2 chunks of 256: LMCache logs one complete retrieve of 512 per window.
n=$(grep -c 'Retrieved 512 out of 512 required tokens' "$WD/smoke.log" || true)
if [ "$n" -ne 4 ]; then
  echo "gpu smoke FAILED: LMCache's log shows $n complete 512-token window retrieves, expected 4 ($WD/smoke.log)" >&2
  exit 1
fi
echo "gpu smoke passed ($WD)"
