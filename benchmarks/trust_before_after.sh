#!/usr/bin/env bash
# Before/after of a change, interleaved, in two checkouts that each have a .venv with ddlcore
# installed from that checkout (pip install -e .): init time, and 4 KB / 64 MB allreduce at
# np = 2 on the default path and over TCP; the flight recorder off beside the after-runs.
#   bash benchmarks/trust_before_after.sh /path/to/before /path/to/after > results.txt
# (the before checkout needs benchmarks/init_time.py copied in if it predates it)
set -u
before=$1 after=$2
run() {  # tree label cmd...
  local tree=$1 label=$2; shift 2
  ( cd "$tree" && . .venv/bin/activate && echo "## $label [$tree]: $*" && env "$@" 2>&1 )
}
for round in 1 2 3; do
  for tree in "$before" "$after"; do
    run "$tree" "init default" python benchmarks/init_time.py --np 2,4 --cycles 20
    run "$tree" "init tcp" python benchmarks/init_time.py --np 2,4 --cycles 20 --transport tcp
    run "$tree" "4K default" ddlrun -np 2 python benchmarks/allreduce_loop.py 4096 20000
    run "$tree" "64M default" ddlrun -np 2 python benchmarks/allreduce_loop.py 67108864 40
    run "$tree" "4K tcp" ddlrun -np 2 --transport tcp python benchmarks/allreduce_loop.py 4096 5000
    run "$tree" "64M tcp" ddlrun -np 2 --transport tcp python benchmarks/allreduce_loop.py 67108864 10
  done
  run "$after" "4K default, recorder off" DDL_FLIGHT_RECORDER_ENTRIES=0 \
      ddlrun -np 2 python benchmarks/allreduce_loop.py 4096 20000
done
