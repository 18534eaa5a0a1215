#!/usr/bin/env bash
# GPU smoke test: BSRConnector in a real vLLM on one GPU, tiny random-weight Llama made locally (no downloads).
# Prepared, not run on the CPU-only development machine. Needs a venv with vllm (CUDA build), lmcache==0.5.6 and
# transformers: PY=/path/to/venv/bin/python plugins/vllm_bsr/gpu_smoke.sh [WORKDIR]
# Pass: both generations agree, and the log shows "Retrieved ... tokens" from LMCache on the second one.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-python3}"
WD="${1:-$(mktemp -d /tmp/bsr-gpu-smoke.XXXXXX)}"
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
export PYTHONHASHSEED=0  # with vLLM importable, LMCache's chunk hashes are seeded unless this is set
export PYTHONPATH="$PWD/plugins:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
timeout "${SMOKE_TIMEOUT_S:-540}" "$PY" plugins/vllm_bsr/gpu_smoke.py "$WD" 2>&1 | tee "$WD/smoke.log"
grep -q '"equal": true' "$WD/smoke.log"
echo "gpu smoke passed ($WD)"
