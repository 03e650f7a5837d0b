#!/usr/bin/env bash
# The input-pipeline figures of docs/benchmarks.md (seeds 000 and 004), one section per
# argument, on a CUDA machine (one H200 for the published figures):
#
#   bash benchmarks/input_pipeline.sh gpu-jpeg resnet50 mnist   # the GPU targets
#   bash benchmarks/input_pipeline.sh scaling                   # multiprocess scaling (CPU)
#
# OUT (default runs/input) receives each section's data_bench.jsonl/.png and logs; JPEG
# folders are generated once under JPEG (default /tmp/kasoku-jpeg). MNIST comes from
# MNIST (default .data/mnist).
set -euo pipefail
OUT=${OUT:-runs/input}
JPEG=${JPEG:-/tmp/kasoku-jpeg}
MNIST=${MNIST:-.data/mnist}
K=(python -m kasoku)
mkdir -p "$OUT"

jpeg_folder() {  # jpeg_folder WxH COUNT -> prints the folder, made once
  local dir="$JPEG/$1"
  if [ ! -f "$dir/.kasoku-make-jpeg.json" ] || ! grep -q '"complete": true' "$dir/.kasoku-make-jpeg.json"; then
    "${K[@]}" data make-jpeg --out "$dir" --count "$2" --resolution "$1" --classes 100 >&2
  fi
  echo "$dir"
}

for section in "$@"; do
  case $section in
    gpu-jpeg)  # gpu-jpeg alone, each decoder, 500x375 JPEGs cropped to 224 (target >= 20,000/s)
      dir=$(jpeg_folder 500x375 8192)
      for decoder in nvimgcodec torchvision; do
        KASOKU_GPU_JPEG_DECODER=$decoder "${K[@]}" data bench "$dir" --device cuda \
          --loader gpu-jpeg:8,gpu-jpeg:16,gpu-jpeg-procs:2,3,4,6,8 --batch-size 256 \
          --batches 10 --warmup 3 --out "$OUT/gpu-jpeg-$decoder"
      done ;;
    resnet50)  # imagenet-resnet50 (the ladder's top rung) fed by gpu-jpeg vs synthetic on-device (target >= 95%)
      dir=$(jpeg_folder 500x375 8192)
      "${K[@]}" data bench "$dir" --device cuda --loader gpu-jpeg-procs:6,gpu-jpeg:8,multiprocess:16 \
        --model imagenet-resnet50 --batch-size 256 --batches 20 --warmup 5 \
        --precision bf16 --channels-last --optimizer-impl fused --cudnn-benchmark --compile --cuda-graph \
        --out "$OUT/resnet50" ;;
    mnist)  # mnist-mlp bs 100 fed by the device loader vs synthetic (target < 5% waiting)
      for graph in "" "--cuda-graph"; do
        "${K[@]}" data bench mnist-mlp --data "$MNIST" --device cuda --loader device,serial \
          --model mnist-mlp --batch-size 100 --batches 300 --warmup 50 \
          --precision tf32 --optimizer-impl fused $graph --out "$OUT/mnist${graph:+-graph}"
      done ;;
    scaling)  # host loaders alone at three resolutions: serial vs 1..16 processes (seed 000)
      for res in 250x188 500x375 1000x750; do jpeg_folder $res 2048 >/dev/null; done
      "${K[@]}" data bench "$JPEG" --resolution 250x188,500x375,1000x750 --images 2048 \
        --device cpu --loader serial,multiprocess:1,2,4,8,16 --batch-size 32 --batches 8 \
        --warmup 2 --out "$OUT/scaling" ;;
    *) echo "unknown section $section (gpu-jpeg, resnet50, mnist, scaling)" >&2; exit 2 ;;
  esac
done
