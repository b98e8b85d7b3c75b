#!/bin/bash
# `generate -p "Say hi" -n 16 --no-draft` per dtype, alternated twice; the tokens/s the CLI reports.
for round in 1 2; do
  for dt in ${DTYPES:-float32 quantized float16}; do
    echo "round=$round $(MKL_NUM_THREADS=1 /work/main/.venv/bin/redrafter-mlx generate -p "Say hi" -n 16 --no-draft --dtype $dt 2>&1 | tail -1)"
  done
done
