#!/usr/bin/env bash
# The one GPU command: GPU tests, kernel benchmarks, then (FUSELM_E2E=1) the generation benchmark and its LoRA/QLoRA
# step rows (FUSELM_E2E_ARGS, e.g. "--no-train", or "--no-generate --merge-into FILE", go to e2e.py),
# (FUSELM_TRAIN=1) the training benchmark, (FUSELM_LORA=1) the LoRA step's profile, (FUSELM_HOST=1) the patched
# LoRA/QLoRA steps' host view, (FUSELM_CKPT=1) the checkpointed LoRA step's, (FUSELM_TUNE=1, run before the generation
# benchmark) the decode projections' config sweep (FUSELM_TUNE_ARGS go to tune_decode.py, e.g. "--rows 32"; with
# FUSELM_RETABLE=1 its picks replace those keys in the GPU's tuning table for the rest of the run), (FUSELM_STEP=1)
# a captured decode step's kernels, (FUSELM_STREAM=1) the weight-stream sweep, (FUSELM_NCU=1) the decode kernels' hardware counters
# (benchmarks/ncu_decode.sh), (FUSELM_SDPA=1) the SDPA backend per memory layout of a prefill's q, k, v
# (sdpa_layout_probe.py), (FUSELM_TTFT=1) a prefill call's time by host and kernels (ttft_probe.py; FUSELM_TTFT_ARGS
# go to it, e.g. "--grow-to 8192") and
# (FUSELM_DECODE=1) the decode benchmark (FUSELM_DECODE_ARGS go to decode_bench.py, e.g.
# "--only attention --sweep-splits 1 2 3 4"), (FUSELM_ATTN_CONFIGS=1, run before it) decode attention with every config
# forced at B = 32's short rows and the tuning table off, so that its own timed picks land in autotune_picks (for
# tuning_table.py --update), and (FUSELM_GEMM=1) the prefill GEMMs' rate by M and by clocks
# (gemm_clock_probe.py) and (FUSELM_AB="VAR=a VAR=b", FUSELM_AB_GENERATE=1) the layer step (and generate) under
# each environment setting, alternating; prints a short table last.
# FUSELM_REQUIRE=H200 exits 3 at once on any GPU whose name lacks it.
#   bash benchmarks/gpu_run.sh [kernels...]     (on the GPU machine, from the repo root)
# Results go to $OUT (the device tool's return folder) or benchmarks/results/. The device tool brings back at most 8
# files: with $OUT set and more files than that in it, they go into $OUT/results.tgz as the script exits (on SIGINT or
# SIGTERM too, once the step in flight has ended: bash runs a trap between commands).
set -uo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
pack() {
  if [ -n "${OUT:-}" ] && [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && find . -maxdepth 1 -type f ! -name results.tgz -printf '%P\n' | tar czf results.tgz --remove-files -T -)
    echo "packed into $OUT/results.tgz: $(tar tzf "$OUT/results.tgz" | tr '\n' ' ')"
  fi
}
trap pack EXIT
trap 'exit 130' INT TERM
if [ -n "${FUSELM_REQUIRE:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$FUSELM_REQUIRE"; then
  echo "FUSELM_REQUIRE=$FUSELM_REQUIRE: this is $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  exit 3
fi
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels, e.g. liger-kernel for the comparison
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# torch.compile's anchor is compiled and tuned afresh each run: a cached choice from one earlier run
# (RoPE fwd once picked a 100 µs kernel where 4 fresh runs got 87 µs) would stand in for every later one
export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ "${FUSELM_TESTS:-}" != none ]; then
  # one xdist worker per 10 GiB of GPU memory (at most one per core): 16 workers on an 80 GB H100 ran out of memory
  # (session 19; the H200's 141 GB held them); an -n in FUSELM_TESTS comes later and wins
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  workers=$(( mib / 10240 )); workers=$(( workers < 1 ? 1 : workers > $(nproc) ? $(nproc) : workers ))
  # SIGINT on time-out, so pytest still prints which tests failed
  timeout -s INT -k 30 "${FUSELM_TEST_TIMEOUT:-300}" python3 -m pytest -n "$workers" ${FUSELM_TESTS:-tests -m gpu} -q -rfE \
    -p no:cacheprovider 2>&1 \
    | tee "$out/gpu-tests.log" | tail -n 25
fi
if [ "${FUSELM_KERNELS:-1}" = 1 ]; then
  only=${*:+--only $*}
  python3 benchmarks/kernel_bench.py --out "$out/kernels-h200.json" $only ${FUSELM_MERGE:+--merge-into $FUSELM_MERGE} 2>&1 | tee "$out/kernels.log"
fi
if [ "${FUSELM_TUNE:-0}" = 1 ]; then  # every decode projection config timed as the benchmark times it (tuning table)
  python3 benchmarks/tune_decode.py --out "$out/tune-decode-h200.json" ${FUSELM_TUNE_ARGS:-} 2>&1 \
    | tee "$out/tune-decode.log" | tail -n 20
  if [ "${FUSELM_RETABLE:-0}" = 1 ]; then  # its picks into this GPU's shipped table, for the runs below
    python3 benchmarks/tuning_table.py --update "$out/tune-decode-h200.json" && cp fuselm/ops/tuning/*.json "$out/"
  fi
fi
if [ "${FUSELM_E2E:-0}" = 1 ]; then
  python3 benchmarks/e2e.py --out "$out/e2e-h200.json" ${FUSELM_E2E_ARGS:-} 2>&1 | tee "$out/e2e.log"
fi
if [ "${FUSELM_TRAIN:-0}" = 1 ]; then
  python3 benchmarks/train_bench.py --out "$out/train-h200.json" 2>&1 | tee "$out/train.log"
fi
if [ "${FUSELM_LORA:-0}" = 1 ]; then  # one LoRA step profiled by kind of kernel: unpatched, before, after
  python3 benchmarks/lora_profile.py --out "$out/lora-profile-h200.json" 2>&1 | tee "$out/lora-profile.log"
fi
if [ "${FUSELM_HOST:-0}" = 1 ]; then  # the patched LoRA and QLoRA steps' host view, each alone in its process
  for kind in lora qlora; do
    python3 benchmarks/lora_profile.py --host --variants fuselm.patch $([ $kind = qlora ] && echo --qlora) \
      --out "$out/$kind-host-h200.json" 2>&1 | grep -v Warning | tee "$out/$kind-host.log"
  done
fi
if [ "${FUSELM_CKPT:-0}" = 1 ]; then  # the gradient-checkpointed LoRA step: GPU time by kind and the host view
  python3 benchmarks/lora_profile.py --host --checkpointing --variants ${FUSELM_CKPT_VARIANTS:-unpatched fuselm.patch} \
    --out "$out/lora-ckpt-host-h200.json" 2>&1 | grep -v Warning | tee "$out/lora-ckpt-host.log"
fi
if [ "${FUSELM_STEP:-0}" = 1 ]; then  # one captured decode step of fuselm.generate, kernel by kernel
  python3 benchmarks/step_profile.py --out "$out/step-profile-h200.json" 2>&1 | tee "$out/step-profile.log"
fi
if [ "${FUSELM_STREAM:-0}" = 1 ]; then  # the projections' weight stream alone (tiles, split-K, pointer loads vs TMA)
  python3 benchmarks/stream_bench.py --out "$out/stream-h200.json" 2>&1 | tee "$out/stream.log" | tail -n 12
fi
if [ "${FUSELM_NCU:-0}" = 1 ]; then  # hardware counters of the decode step's five kernels at B = 1 and 32
  bash benchmarks/ncu_decode.sh "$out"
fi
if [ "${FUSELM_SDPA:-0}" = 1 ]; then  # which SDPA backend a causal prefill gets per memory layout of q, k, v
  python3 benchmarks/sdpa_layout_probe.py --out "$out/sdpa-layout-h200.json" 2>&1 | tee "$out/sdpa-layout.log" | tail -n 20
fi
if [ "${FUSELM_TTFT:-0}" = 1 ]; then  # where a prefill call's time goes, in a fresh process (host lead, kernels)
  # FUSELM_TTFT_ARGS: one probe's arguments, or several probes' separated by ';' (e.g. "--host-parts; --batch 32
  # --prompt 512"), each run in its own process, the second and later writing ttft-probe-2-h200.json, ...
  IFS=';' read -ra probes <<< "${FUSELM_TTFT_ARGS:-}"
  [ ${#probes[@]} -gt 0 ] || probes=("")
  for i in "${!probes[@]}"; do
    suffix=$([ "$i" = 0 ] || echo "-$((i + 1))")
    python3 benchmarks/ttft_probe.py --out "$out/ttft-probe$suffix-h200.json" ${probes[$i]} 2>&1 \
      | tee "$out/ttft$suffix.log" | grep -E "event|impl|  fuselm|Error"
  done
fi
if [ "${FUSELM_ATTN_CONFIGS:-0}" = 1 ]; then
  FUSELM_TUNING_TABLE=0 python3 benchmarks/decode_bench.py --only attention --sweep-splits 1 --sweep-attention-configs \
    --out "$out/decode-attention-b32-configs-h200.json" 2>&1 | tee "$out/decode-attention-b32-configs.log" | tail -n 30
fi
if [ "${FUSELM_DECODE:-0}" = 1 ]; then
  python3 benchmarks/decode_bench.py --out "$out/decode-h200.json" ${FUSELM_DECODE_ARGS:-} 2>&1 | tee "$out/decode.log"
fi
if [ -n "${FUSELM_AB:-}" ]; then  # the layer step under each environment setting of FUSELM_AB, alternating, twice
  # (FUSELM_AB_RUNS times: 1 where device time is short)
  # e.g. FUSELM_AB="FUSELM_DEPENDENT_MAX_ROWS=8 FUSELM_DEPENDENT_MAX_ROWS=32 FUSELM_DEPENDENT_MAX_ROWS=8,qkv_rope=32"
  # (a limit for every op, then one op's: fuselm/ops/_common.py); FUSELM_AB_LAYER_ARGS go to decode_bench.py (e.g.
  # "--layer-shapes 32x1024": that shape alone, a third of the time); with FUSELM_AB_GENERATE=1 also
  # fuselm.generate at B = 1 and 32 (e2e.py; FUSELM_AB_GENERATE_ARGS go to it, e.g. "--batches 32"), each setting in
  # its own process
  for run in $(seq "${FUSELM_AB_RUNS:-2}"); do
    for setting in $FUSELM_AB; do
      tag=$(echo "$setting" | tr -c 'A-Za-z0-9_\n' '-' | tr 'A-Z' 'a-z')
      echo "== $setting, run $run"
      env "$setting" python3 benchmarks/decode_bench.py --only layer_step --impls fuselm ${FUSELM_AB_LAYER_ARGS:-} \
        --out "$out/ab-layer-$tag-$run-h200.json" 2>&1 | tee "$out/ab-layer-$tag-$run.log" | tail -n 4
      if [ "${FUSELM_AB_GENERATE:-0}" = 1 ]; then
        env "$setting" python3 benchmarks/e2e.py --no-train --impls fuselm.generate --prefills --prefill-idle-s 0 \
          ${FUSELM_AB_GENERATE_ARGS:-} --out "$out/ab-generate-$tag-$run-h200.json" 2>&1 | tee "$out/ab-generate-$tag-$run.log" | grep "generate"
      fi
    done
  done
fi
if [ "${FUSELM_GEMM:-0}" = 1 ]; then
  python3 benchmarks/gemm_clock_probe.py --out "$out/gemm-clock-probe-h200.json" 2>&1 | tee "$out/gemm-clock.log" | tail -n 8
fi
