#!/usr/bin/env bash
# One device session: install the carried wheels, then run the named steps, logging under $OUT.
#   bash bench/gpu_session.sh tests runtime piecewise server    (steps: see below)
set -u
export PYTHONPATH="$PWD:$PWD/examples" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-index --find-links .carry/wheels jsonschema hypothesis >"$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python -c "import torch;print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; date -u; } | tee "$OUT/device.txt"
for step in "$@"; do
  case "$step" in
    tests)     timeout 400 python -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" ;;
    runtime)   timeout 500 python bench/runtime_bench.py --out "$OUT/runtime_bench.md" 2>&1 | tail -40 ;;
    generate)  python -m compiler.cli compile plans/tiny-llama.yaml -o /tmp/tiny.json && python examples/generate.py --table /tmp/tiny.json --check 2>&1 | tee "$OUT/generate.log" | tail -5 ;;
    *)         echo "unknown step $step" ;;
  esac
done
