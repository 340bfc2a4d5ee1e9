#!/usr/bin/env bash
# Nsight Compute on the small-M GEMV, one launch per case (the 4th of a warm process, weights
# rotated past L2 by gpu_ncu_one.py; clocks left alone), for the goal table's bound at
# M = 9..16 (bench/GPU_NOTES.md, run 82). On the device machine, with the package importable:
#
#   OUT=DIR bash bench/probes/gpu_ncu_bound.sh "8192 8192 4 128 1" "8192 8192 4 128 16" ...
#
# Each case is K N BITS GROUP M (group 0: per channel); one text report each in $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
# Stall reasons (cycles per issued instruction), pipe use and counts, next to the sections.
STALLS=long_scoreboard,wait,short_scoreboard,math_pipe_throttle,not_selected,mio_throttle,lg_throttle,barrier,selected,dispatch_stall,no_instruction
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
METRICS+=,smsp__inst_executed.sum,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
METRICS+=,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
METRICS+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for s in ${STALLS//,/ }; do METRICS+=",smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
for c in "$@"; do
  read -r k n bits g m <<<"$c"
  f="$OUT/ncu_${k}x${n}_int${bits}_g${g}_m${m}.txt"
  "$NCU" --clock-control none --kernel-name regex:gemv_tc --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section InstructionStats --section Occupancy --section MemoryWorkloadAnalysis --metrics "$METRICS" \
    python3 bench/probes/gpu_ncu_one.py "$k" "$n" "$bits" "$g" "$m" >"$f" 2>&1 || { tail -20 "$f"; exit 1; }
  echo "== $c"
  grep -E "gpu__time_duration|dram__throughput|issue_active|inst_executed|pipe_tensor|stalled_|Achieved Occupancy|Registers Per Thread|Warp Cycles Per Issued" "$f" || true
done
