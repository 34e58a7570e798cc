#!/usr/bin/env bash
# Issue 9 figures: benches of the exports run3.sh made (same commit's exporter), bandwidth probe per round.
set -x
source /work/venv/bin/activate
B=/tmp/b9
kvforge bench $B/sm-fp32 --compare hf,ort-genai --repeat 5 --json --plot $B/sm-fp32.png > $B/bench-sm-fp32.json
kvforge bench $B/sm-int4 --compare ort-genai --repeat 5 --json > $B/bench-sm-int4.json
kvforge bench $B/sm-int8 --compare ort-genai --repeat 3 --json > $B/bench-sm-int8.json
kvforge bench $B/sm-fp32 --batch 4 --repeat 3 --json > $B/bench-sm-fp32-b4.json
kvforge bench $B/sm-int4 --batch 4 --repeat 3 --json > $B/bench-sm-int4-b4.json
kvforge bench $B/qw-fp32 --compare ort-genai --repeat 3 --json > $B/bench-qw-fp32.json
kvforge bench $B/qw-int4 --compare ort-genai --repeat 3 --json > $B/bench-qw-int4.json
echo DONE
