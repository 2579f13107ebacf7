# One device run of the CUDA Q4_K lab (issue #18): time the tilings of both kernels, profile two with ncu.
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHAPES=${SHAPES:-gate/up,down,sliding q,sliding k/v}
NCU=${NCU:-mma,2,2,3,1,16 chain,2,2,3,1,16 mma,2,2,3,1,1}
timeout 400 python scripts/gpu/q4k_cuda_lab.py $OUT --shapes "$SHAPES" > $OUT/cuda_lab.log 2>&1
for c in $NCU; do
  timeout 60 ncu --clock-control none -k regex:"q4k_mma" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --print-details all python scripts/gpu/q4k_cuda_lab.py $OUT --ncu $c > $OUT/ncu_${c//,/_}.txt 2>&1
done
sed -n '/best tiling/,$p' $OUT/cuda_lab.log
grep -h -E "^  *(Duration|DRAM Throughput|Issue Slots Busy|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued|Stall (Long|Short|Wait|Math|MIO|Not Sel|Barrier|Dispatch|Tex|LG|Branch|No Inst|Selected))" $OUT/ncu_*.txt
grep -c "Error" $OUT/cuda_lab.log; grep -m3 "Error" $OUT/cuda_lab.log | cut -c1-600
