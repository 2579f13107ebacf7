export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 380 python scripts/gpu/q4k_lab.py $OUT --shapes gate/up,down 2>&1 | tee $OUT/lab.log
for c in adopted,0,0,0 fact,128,8,3 fact_a,128,8,3 int8,128,8,3; do
  timeout 60 ncu --clock-control none -k regex:"q4k_lab|_quant_matmul" --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python scripts/gpu/q4k_lab.py $OUT --ncu $c > $OUT/ncu_${c%%,*}.txt 2>&1
done
grep -h -E "Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc Active|No Eligible|Warp Cycles Per Issued|Stall" $OUT/ncu_*.txt | head -60
