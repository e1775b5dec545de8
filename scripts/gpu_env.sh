# Sourced by the scripts/gpu_*.sh runs on the GPU machine: repository root, wheels installed
# in /tmp/site, converted models cached in /tmp/kvc (both live while the machine stays warm).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=/tmp/site:$PWD/src KVSIEVE_CACHE_DIR=/tmp/kvc PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/kvc
