#!/bin/bash
# The GPU check of 2026-11-28 (one call): lessons 12-14's NCCL paths on a world of one (never run
# on a GPU), the capstone at GPT-2 size and lab 11, then labs 12, 13, 14 and 10 as GPU_PLAN says.
set -u
export PYTHONPATH=$PWD/.gpu_site$(python -c 'import requests, google.protobuf, typing_extensions, urllib3' 2>/dev/null || echo ":$PWD/.gpu_fallback")
export PATH=$PWD/.gpu_site/bin:$PATH
echo "PYTHONPATH=$PYTHONPATH" | tee $OUT/env.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a $OUT/env.txt
nproc | tee -a $OUT/env.txt
python -c "import sys, torch, torchft; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torchft.__file__)" 2>&1 | tee -a $OUT/env.txt
run() { name=$1; lim=$2; shift 2; echo "=== $name: $*"; start=$SECONDS; timeout $lim "$@" > $OUT/$name.log 2>&1; rc=$?; echo "$name rc=$rc $((SECONDS-start)) s" | tee -a $OUT/summary.txt; tail -4 $OUT/$name.log; }
run l12_nccl1 60 python 12_debugging/debugging.py --world-size 1 --debug-dir $OUT/dbg
sed 's/weights_only=True)/map_location="cpu", weights_only=True)/' 12_debugging/debugging.py > /tmp/debugging_cpu_load.py
run l12_nccl1_cpu_load 60 python /tmp/debugging_cpu_load.py --world-size 1 --debug-dir $OUT/dbg2
run l13_nccl1 60 python 13_pipeline_3d/pipeline_3d.py --world-size 1 --pp 1 --tp 1
run l14_nccl1 60 python 14_fault_tolerance/fault_tolerance.py --replicas 1 --steps 20
run l14_elastic_nccl1 60 python -m torch.distributed.run --nproc-per-node 1 14_fault_tolerance/elastic.py --steps 20 --ckpt-dir /tmp/el
run capstone_lab11 240 python run_lessons.py --gpu --only 11 --results $OUT/lab_results_11.json
tail -3 $OUT/capstone_lab11.log
run labs_12_13_14_10 200 python run_lessons.py --gpu --only 12 13 14 10 --results $OUT/lab_results_10_14.json
tail -8 $OUT/labs_12_13_14_10.log
ls -la $OUT/dbg $OUT/dbg2 2>&1 | head -20
