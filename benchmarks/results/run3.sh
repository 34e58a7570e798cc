#!/usr/bin/env bash
# Issue 9 figures, one run on this machine (after the export optimizer change). Peers' builds timed in the same run.
set -x
source /work/venv/bin/activate
B=/tmp/b9
rm -rf ~/.cache/kvforge/bench/genai-*
kvforge export /tmp/sm/model -o $B/sm-fp32 --force --json > $B/export-sm-fp32.json
kvforge export /tmp/sm/model -o $B/sm-int4 --force --quantize int4 --json > $B/export-sm-int4.json
kvforge export /tmp/sm/model -o $B/sm-int8 --force --quantize int8 --json > $B/export-sm-int8.json
kvforge bench $B/sm-fp32 --compare hf,ort-genai --repeat 5 --json --plot $B/sm-fp32.png > $B/bench-sm-fp32.json
kvforge bench $B/sm-int4 --compare ort-genai --repeat 5 --json > $B/bench-sm-int4.json
kvforge bench $B/sm-int8 --compare ort-genai --repeat 3 --json > $B/bench-sm-int8.json
kvforge bench $B/sm-fp32 --batch 4 --repeat 3 --json > $B/bench-sm-fp32-b4.json
kvforge bench $B/sm-int4 --batch 4 --repeat 3 --json > $B/bench-sm-int4-b4.json
[ -f $B/qwen/config.json ] || python -c "from kvforge.models.recipes import materialize; materialize('qwen2-0.5b-shape', '$B/qwen', force=True)"
kvforge export $B/qwen -o $B/qw-fp32 --force --json > $B/export-qw-fp32.json
kvforge export $B/qwen -o $B/qw-int4 --force --quantize int4 --json > $B/export-qw-int4.json
kvforge bench $B/qw-fp32 --compare ort-genai --repeat 3 --json > $B/bench-qw-fp32.json
kvforge bench $B/qw-int4 --compare ort-genai --repeat 3 --json > $B/bench-qw-int4.json
echo DONE
