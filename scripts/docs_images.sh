#!/usr/bin/env bash
# Redraw the pictures of README.md's "Pictures" section into docs/render/.
#
#   scripts/docs_images.sh            the predicted pictures (needs Graphviz's dot/neato)
#   scripts/docs_images.sh measured   also train tiny_ddp_overlap on 2 CPU ranks for a trace,
#                                     fit the cost model to it and draw the measured step;
#                                     and trace tiny_pp2_interleaved for its measured grid
#   FORMATS="svg png" scripts/docs_images.sh    each picture in several formats
#
# Each line below is the exact command README.md shows next to its picture.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
D=docs/render
mkdir -p "$D" out
schedc() { "$PY" -m schedc "$@"; }

for f in ${FORMATS:-svg}; do
  # seed 000: one GPU vs eight, same global batch, one time scale
  schedc render schedules/gpt2_1gpu.sched schedules/gpt2_8gpu.sched --view timeline -o $D/seed000_timeline.$f
  schedc render schedules/gpt2_1gpu.sched schedules/gpt2_8gpu.sched -o $D/seed000_graph.$f
  # seed 003: DDP, bucket 1 hidden behind backward, bucket 2 exposed
  schedc render schedules/ddp_overlap.sched --view timeline -o $D/seed003_ddp_overlap_timeline.$f
  schedc render schedules/ddp_overlap.sched --view timeline --unfold --window mb3: -o $D/seed003_ddp_overlap_last_microstep.$f
  schedc render schedules/ddp_overlap.sched -o $D/seed003_ddp_overlap_graph.$f
  # seed 004: FSDP with prefetch, and without
  schedc render schedules/fsdp_prefetch.sched --view timeline -o $D/seed004_fsdp_prefetch_timeline.$f
  schedc render schedules/fsdp_prefetch.sched $D/fsdp_no_prefetch.sched --view timeline -o $D/seed004_fsdp_prefetch_vs_none.$f
  schedc render schedules/fsdp_prefetch.sched -o $D/seed004_fsdp_prefetch_graph.$f
  # HSDP: GPT-2 on 2 nodes x 8 GPUs, flat FSDP vs HSDP, inter-node links 8x slower
  schedc render schedules/gpt2_2x8_fsdp.sched schedules/gpt2_2x8_hsdp.sched --view timeline --bandwidth 100G --inter-bandwidth 12.5G --node-size 8 -o $D/hsdp_2x8_vs_fsdp_timeline.$f
  # pipeline stages: GPipe, 1F1B and ZB-H1 on one split and one time scale; interleaved 1F1B
  schedc render docs/render/pp4_gpipe.sched schedules/pipeline/tiny_pp4_1f1b.sched schedules/pipeline/tiny_pp_zb.sched -o $D/pipeline_gpipe_1f1b_zbh1.$f
  schedc render schedules/pipeline/tiny_pp2_interleaved.sched -o $D/pipeline_interleaved.$f
done

if [ "${1:-}" = "measured" ]; then
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m schedc run schedules/tiny_ddp_overlap.sched --steps 5 --trace out/t.json
  schedc calibrate out/t.json -o $D/cpu_params.json
  for f in ${FORMATS:-svg}; do
    schedc render schedules/tiny_ddp_overlap.sched --trace out/t.json -o $D/measured_tiny_ddp_overlap.$f
    schedc render schedules/tiny_ddp_overlap.sched --trace out/t.json --compare --cost $D/cpu_params.json --unfold -o $D/measured_vs_predicted_tiny_ddp_overlap.$f
  done
  # interleaved 1F1B on 2 ranks: its last step, the prediction at its measured costs above
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m schedc run schedules/pipeline/tiny_pp2_interleaved.sched --steps 3 --trace out/pp.json
  for f in ${FORMATS:-svg}; do
    schedc render schedules/pipeline/tiny_pp2_interleaved.sched --trace out/pp.json --compare -o $D/pipeline_interleaved_measured.$f
  done
fi
