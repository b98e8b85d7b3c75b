#!/bin/bash
# quantized (new / old) and float32 alternated; data job paused
S=/work/main/bench/results/cpu-avx2/quantized-cpu-20261129/speed.py
pkill -STOP -f "redrafter-mlx distill"
while [ "$(cut -d' ' -f1 /proc/loadavg | cut -d. -f1)" -ge 1 ]; do sleep 10; done
echo "start $(date -u +%T) load $(cat /proc/loadavg)"
for r in 1 2; do
  for v in new old f32; do
    case $v in
      new) cd /work/main; d=quantized;;
      old) cd /tmp/old; d=quantized;;
      f32) cd /work/main; d=float32;;
    esac
    echo "$v $(MKL_NUM_THREADS=1 /work/main/.venv/bin/python $S $d 6 64)"
  done
done
echo "end $(date -u +%T)"
pkill -CONT -f "redrafter-mlx distill"
