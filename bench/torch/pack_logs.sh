#!/usr/bin/env bash
# pack_logs.sh DIR [KEEP...]: everything in DIR except the KEEP names (glob
# patterns of DIR's own entries) goes into DIR/logs.tar.gz and is removed, as
# the GPU sessions leave their output: a GPU machine sends back few files.
# tar's exit status 1 (a file changed while it was read, as a stray process
# may still write) leaves a whole archive; a worse one leaves DIR as it was.
#   bench/torch/pack_logs.sh out/kv summary.txt hf_generate.csv
dir=${1:?usage: pack_logs.sh DIR [KEEP...]}
shift
exclude=(--exclude=./logs.tar.gz.tmp)
keep=(! -name logs.tar.gz.tmp)
for name in "$@"; do
  exclude+=(--exclude="./$name")
  keep+=(! -name "$name")
done
tar -czf "$dir/logs.tar.gz.tmp" -C "$dir" "${exclude[@]}" .
(($? <= 1)) &&
  find "$dir" -mindepth 1 -maxdepth 1 "${keep[@]}" -exec rm -rf {} + &&
  mv "$dir/logs.tar.gz.tmp" "$dir/logs.tar.gz"
