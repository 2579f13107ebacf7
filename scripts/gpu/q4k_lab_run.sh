# One device run of the Q4_K lab (issue #18): time the candidates, profile two with ncu, keep one kernel's IR.
export PYTHONPATH=src PYTHONUNBUFFERED=1
ONLY=${ONLY:-adopted,asm,asm_b,asm_pf,asm_sbm,asm_pf_sbm,pf_sbm,load_pf,load_pf_sbm}
SHAPES=${SHAPES:-gate/up,down,sliding q,sliding k/v}
NCU=${NCU:-asm_pf_sbm,128,4,1 asm,128,8,2}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 420 python scripts/gpu/q4k_lab.py $OUT --only "$ONLY" --shapes "$SHAPES" 2>&1 | tee $OUT/lab.log
for c in $NCU; do
  timeout 60 ncu --clock-control none -k regex:"q4k_lab|_quant_matmul" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --print-details all python scripts/gpu/q4k_lab.py $OUT --ncu $c > $OUT/ncu_${c//,/_}.txt 2>&1
done
c=${NCU%% *}
TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=/tmp/dump TRITON_ALWAYS_COMPILE=1 timeout 60 python scripts/gpu/q4k_lab.py $OUT --ncu $c >/dev/null 2>&1
tar czf $OUT/dump.tgz -C /tmp dump 2>/dev/null
grep -h -E "^  *(Duration|DRAM Throughput|Issue Slots Busy|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued|Executed Instructions) " $OUT/ncu_*.txt
