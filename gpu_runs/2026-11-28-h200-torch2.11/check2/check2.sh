#!/bin/bash
# GPU check 2 (2026-11-28): which end of lesson 14's train_replica stops NCCL's heartbeat monitor
# from warning at exit ('recvValue failed' with a C++ stack) when the replica's store closes first.
set -u
export PYTHONPATH=$PWD/.gpu_site$(python -c 'import requests, google.protobuf, typing_extensions, urllib3' 2>/dev/null || echo ":$PWD/.gpu_fallback")
L=14_fault_tolerance/fault_tolerance.py
END='    manager.shutdown(wait=False)  # (an exception ends the process, and its servers with it)'
mkdir -p /tmp/v && cp $L /tmp/v/v0.py
python - "$L" <<'PY'
import sys
src = open(sys.argv[1]).read()
end = '    manager.shutdown(wait=False)  # (an exception ends the process, and its servers with it)\n'
assert end in src
variants = {
    "v1": end + "    manager._pg.shutdown()\n",
    "v2": end + "    model = optimizer = manager = None\n    __import__('gc').collect()\n",
    "v4": "    model = optimizer = manager = None\n    __import__('gc').collect()\n",
}
for name, new in variants.items():
    open(f"/tmp/v/{name}.py", "w").write(src.replace(end, new))
PY
for v in v0 v1 v2 v4; do
  timeout 90 python /tmp/v/$v.py --replicas 1 --steps 5 > $OUT/$v.log 2>&1; rc=$?
  echo "$v rc=$rc recvValue=$(grep -c 'recvValue failed' $OUT/$v.log) should_dump=$(grep -c 'should dump' $OUT/$v.log) committed=$(grep -c '5 steps committed' $OUT/$v.log)"
done | tee $OUT/summary.txt
TORCH_NCCL_ENABLE_MONITORING=0 timeout 90 python /tmp/v/v0.py --replicas 1 --steps 5 > $OUT/v0_nomonitor.log 2>&1
echo "v0 monitoring off rc=$? recvValue=$(grep -c 'recvValue failed' $OUT/v0_nomonitor.log)" | tee -a $OUT/summary.txt
