#!/usr/bin/env bash
# Nsight Compute over benchmarks/ncu_decode.py (one decode step's five fused kernels at B = 1 and 32), then its summary.
#   bash benchmarks/ncu_decode.sh [OUT_DIR] [ncu_decode.py args...]     (on the GPU machine, from the repo root)
# Writes OUT_DIR/ncu-decode-raw.csv (every metric, one row per kernel) and ncu-decode.log (the summary); the report
# stays in /tmp/ncu-decode.ncu-rep. Clocks are left alone (--clock-control none), as the device notes ask. Should ncu
# refuse the extra metrics (a name its version lacks), the run is made again with the sections alone.
set -uo pipefail
out=${1:-benchmarks/results}
report=/tmp/ncu-decode
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
          --section WarpStateStats)
extra=(--metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,dram__bytes_read.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed")
profile() {
  ncu --clock-control none --profile-from-start off "${sections[@]}" "$@" --export "$report" --force-overwrite \
    python3 benchmarks/ncu_decode.py "${args[@]}" 2>&1 | tail -n 15
}
args=("${@:2}")
if ! profile "${extra[@]}"; then
  echo "ncu with the extra metrics failed; again with the sections alone"
  profile
fi
ncu --import "$report.ncu-rep" --csv --page raw > "$out/ncu-decode-raw.csv"
python3 benchmarks/ncu_decode.py --summary "$out/ncu-decode-raw.csv" "${args[@]}" 2>&1 | tee "$out/ncu-decode.log"
