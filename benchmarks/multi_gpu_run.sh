#!/usr/bin/env bash
# The multi-GPU command (issue 17), on a machine with two GPUs (nvidia-h200-x2), from the repo root:
#   bash benchmarks/multi_gpu_run.sh            (FUSELM_BENCH=0: the tests and the guard figure only)
# 1. the multi-GPU tests: each op on cuda:1 while cuda:0 is current, device_map over both GPUs (FusedKVCache
#    included), DTensors, DDP / FSDP2 / Trainer / accelerate FSDP2 fine-tuning through torchrun with NCCL;
# 2. the device guard's host cost; 3. LoRA throughput on 1 and 2 GPUs -> $out/multi-gpu-h200x2.json.
set -uo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels, e.g. liger-kernel for the comparison
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
timeout -s INT -k 30 "${FUSELM_TEST_TIMEOUT:-420}" python3 -m pytest -n 0 -q -rfE -p no:cacheprovider \
  tests/ops/test_devices.py tests/patching/test_device_map.py tests/generation/test_cache_devices.py \
  tests/ops/test_dtensor.py tests/test_examples.py 2>&1 | tee "$out/multi-gpu-tests.log" | tail -n 25
python3 benchmarks/device_guard_bench.py 2>&1 | tee "$out/device-guard.log"
if [ "${FUSELM_BENCH:-1}" = 1 ]; then
  for gpus in 1 2; do
    torchrun --nproc-per-node "$gpus" benchmarks/multi_gpu_bench.py --merge-into "$out/multi-gpu-h200x2.json" 2>&1 \
      | grep -v Warning | tee -a "$out/multi-gpu-bench.log"
  done
fi
