#!/bin/sh
# cli_smoke.sh: runs the built tidalloc command end to end: info, micro's CSV
# shape, replay of small traces whose peaks are computed by hand, soak's
# options and CSV row, stream's two CSVs, and the failures that must exit non-zero (corrupt,
# malformed or inconsistent traces, bad options).
# usage: cli_smoke.sh path/to/tidalloc
set -u

bin=${1:?usage: cli_smoke.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
failures=0

. "$(dirname "$0")/lib/cli.sh"

# key_of NAME: the value of `NAME value` in $dir/out.
key_of() {
  awk -v k="$1" '$1 == k { print $2 }' "$dir/out"
}

expect_key() {
  got=$(key_of "$1")
  [ "$got" = "$2" ] || fail "$3: $1 is '$got', wanted '$2'"
}

header='t_us,action,addr,size,stream'
write_trace() { # write_trace NAME: stdin (CSV) -> $dir/NAME.csv.gz
  gzip -c >"$dir/$1.csv.gz"
}

# --- top level ---------------------------------------------------------------
expect_status 0 "--version" -- "$bin" --version
grep -q '^tidalloc [0-9]' "$dir/out" || fail "--version printed '$(cat "$dir/out")'"
expect_status 0 "--help" -- "$bin" --help
grep -q 'replay' "$dir/out" || fail "--help does not list replay"
expect_status 0 "help micro" -- "$bin" help micro
grep -q 'usage: tidalloc micro' "$dir/out" || fail "help micro printed no usage"
expect_status 2 "unknown command" -- "$bin" frobnicate
expect_status 2 "no command" -- "$bin"

# --- info --------------------------------------------------------------------
expect_status 0 "info on the host backend" -- "$bin" info --conf backend:host
grep -q '^backend: host' "$dir/out" || fail "info does not say backend: host"
grep -q 'host_capacity' "$dir/out" || fail "info does not list the host_capacity option"
grep -Eq '^ +backend +host +auto +code ' "$dir/out" ||
  fail "info does not show backend host (default auto) from code"
TIDALLOC_CONF=expandable_segments:false "$bin" info --conf backend:host >"$dir/out" 2>&1 ||
  fail "info with TIDALLOC_CONF failed"
grep -Eq '^ +expandable_segments +[^ ]+ +[^ ]+ +environment ' "$dir/out" ||
  fail "info does not show expandable_segments as set by the environment"
expect_status nonzero "info with a bad option" -- "$bin" info --conf no_such_key:1
grep -q 'no_such_key' "$dir/err" || fail "info with a bad option does not name it"
# A bad value: one message on stderr with one "configuration", and no table.
expect_status 1 "info --conf backend:gpu" -- "$bin" info --conf backend:gpu
[ -s "$dir/out" ] && fail "info with a bad value printed on stdout: $(head -3 "$dir/out")"
[ "$(wc -l <"$dir/err")" -eq 1 ] || fail "info with a bad value printed $(wc -l <"$dir/err") lines"
grep -q 'gpu' "$dir/err" || fail "info with a bad value does not name it: $(cat "$dir/err")"
grep -q 'configuration.*configuration' "$dir/err" &&
  fail "info with a bad value repeats itself: $(cat "$dir/err")"

# --- micro -------------------------------------------------------------------
expect_status 0 "micro --csv" -- "$bin" micro --csv --ops 20 --repeat 3 --conf backend:host
first=$(head -n 1 "$dir/out")
[ "$first" = "workload,size,threads,allocator,ns_per_op" ] || fail "micro header is '$first'"
allocators=$(tail -n +2 "$dir/out" | cut -d, -f4 | sort -u | wc -l)
rows=$(tail -n +2 "$dir/out" | wc -l)
# 5 pair sizes + mixed, on 1 and 8 threads, for each allocator.
[ "$rows" -eq $((12 * allocators)) ] || fail "micro printed $rows rows for $allocators allocators"
for a in tidalloc glibc; do
  grep -q ",$a," "$dir/out" || fail "micro has no $a rows"
done
bad_rows=$(tail -n +2 "$dir/out" | awk -F, '
  !($1 == "pair" && $2 ~ /^(512|4096|1048576|8388608|67108864)$/) && !($1 == "mixed" && $2 == "mixed") { n++; next }
  !($3 == 1 || $3 == 8) || !($5 + 0 > 0) { n++ }
  END { print n + 0 }')
[ "$bad_rows" -eq 0 ] || fail "micro printed $bad_rows rows with bad fields"
expect_status 2 "micro --repeat 0" -- "$bin" micro --repeat 0
expect_status 0 "micro --sizes" -- "$bin" micro --csv --sizes 512,mixed --only tidalloc \
  --threads 1 --ops 20 --repeat 1 --conf backend:host
[ "$(tail -n +2 "$dir/out" | cut -d, -f1,2 | tr '\n' ' ')" = "pair,512 mixed,mixed " ] ||
  fail "micro --sizes 512,mixed printed: $(cat "$dir/out")"
expect_status 2 "micro --sizes 0" -- "$bin" micro --sizes 0
# Calibrated (no --ops), it says up front how long it takes, and with stderr
# not a terminal it still shows progress, a line at a time.
expect_status 0 "micro with its estimate" -- "$bin" micro --csv --sizes 512 --only tidalloc \
  --threads 1 --repeat 1 --conf backend:host
grep -Eq 'measurements, roughly [0-9]+-[0-9]+ s' "$dir/err" ||
  fail "micro does not say how long it takes: $(cat "$dir/err")"
grep -q '100% (1 of 1 measurements' "$dir/err" ||
  fail "micro shows no progress when stderr is not a terminal: $(cat "$dir/err")"
# Its help names mimalloc exactly when the build has it (--only accepts it).
"$bin" micro --help >"$dir/out" 2>&1
if "$bin" micro --only mimalloc --sizes 512 --threads 1 --ops 1 --repeat 1 >/dev/null 2>&1; then
  grep -q 'next to glibc and mimalloc' "$dir/out" || fail "micro's help omits its mimalloc"
else
  grep -q 'this build has no mimalloc' "$dir/out" || fail "micro's help promises a mimalloc"
fi

# --- replay: peaks computed by hand -----------------------------------------
# alloc 1 MiB, alloc 2 MiB, free the first, alloc 512 KiB: 3 MiB live at most.
printf '%s\n%s\n%s\n%s\n%s\n' "$header" \
  '1,alloc,4096,1048576,0' \
  '2,alloc,8192,2097152,0' \
  '3,free,4096,1048576,0' \
  '4,alloc,4096,524288,0' | write_trace simple
expect_status 0 "replay simple" -- "$bin" replay "$dir/simple.csv.gz"
expect_key events 4 "replay simple"
expect_key peak_live_bytes 3145728 "replay simple"
expect_key peak_allocated_bytes 3145728 "replay simple"
reserved=$(key_of peak_reserved_bytes)
[ "${reserved:-0}" -ge 3145728 ] || fail "replay simple: peak_reserved_bytes '$reserved' < 3 MiB"
ratio=$(key_of reserved_over_live)
expected_ratio=$(awk -v r="${reserved:-0}" 'BEGIN { printf "%.4f", r / 3145728 }')
[ "$ratio" = "$expected_ratio" ] || fail "replay simple: reserved_over_live $ratio != $expected_ratio"

# Two streams, an address reused after its free, the same size freed with 0.
printf '%s\n%s\n%s\n%s\n%s\n%s\n%s\n' "$header" \
  '1,alloc,100,1000,0' \
  '2,alloc,200,5000,7' \
  '3,free,100,0,0' \
  '4,alloc,100,3000,7' \
  '5,alloc,300,512,0' \
  '6,free,200,5000,7' | write_trace streams
expect_status 0 "replay streams" -- "$bin" replay "$dir/streams.csv.gz"
expect_key streams 2 "replay streams"
expect_key peak_live_bytes 8512 "replay streams"
expect_key unknown_frees 0 "replay streams"
# Nothing in it makes the allocator wait, and the host backend saw no wait either.
expect_key stream_waits 0 "replay streams"
expect_key stream_synchronizations 0 "replay streams"

expect_status 0 "replay --csv" -- "$bin" replay --csv "$dir/simple.csv.gz"
[ "$(head -n 1 "$dir/out")" = \
  "trace,events,peak_live_bytes,peak_allocated_bytes,peak_reserved_bytes,reserved_over_live,seconds,mappings,unmappings" ] ||
  fail "replay --csv header is '$(head -n 1 "$dir/out")'"
[ "$(tail -n +2 "$dir/out" | cut -d, -f1-3)" = "simple.csv.gz,4,3145728" ] ||
  fail "replay --csv row is '$(tail -n +2 "$dir/out")'"
# Its mappings: at least one (the trace holds 3 MiB at once), as the key lines say.
csv_maps=$(tail -n +2 "$dir/out" | cut -d, -f8)
"$bin" replay "$dir/simple.csv.gz" >"$dir/out" 2>"$dir/err"
[ "${csv_maps:-0}" -ge 1 ] && [ "$csv_maps" = "$(key_of mappings)" ] ||
  fail "replay --csv mappings '$csv_maps', key lines '$(key_of mappings)'"

# A graph pool of 8 MiB beside it: reserved counts the pool, allocated does not
# (the peaks are reset after the pool's capture), and the trace's figures stay.
expect_status 0 "replay --graph-pool-mib" -- "$bin" replay "$dir/simple.csv.gz" --graph-pool-mib 8
expect_key peak_live_bytes 3145728 "replay --graph-pool-mib"
expect_key peak_allocated_bytes 3145728 "replay --graph-pool-mib"
pooled=$(key_of peak_reserved_bytes)
[ "${pooled:-0}" -ge $((reserved + 8388608)) ] ||
  fail "replay --graph-pool-mib 8: peak_reserved_bytes '$pooled', without the pool '$reserved'"
for bad in 0 -1 lots 4194305; do
  expect_status 2 "replay --graph-pool-mib $bad" -- "$bin" replay "$dir/simple.csv.gz" --graph-pool-mib "$bad"
done
expect_status nonzero "replay --graph-pool-mib on the CUDA backend without a capture" -- \
  "$bin" replay "$dir/simple.csv.gz" --graph-pool-mib 8 --conf backend:cuda

# --- replay: what must fail --------------------------------------------------
head -c 60 "$dir/simple.csv.gz" >"$dir/truncated.csv.gz"
expect_status nonzero "replay of a truncated gzip file" -- "$bin" replay "$dir/truncated.csv.gz"
printf 'not a gzip file at all, just some text of a broken download\n' >"$dir/garbage.csv.gz"
dd if=/dev/urandom bs=1 count=200 2>/dev/null >>"$dir/garbage.csv.gz"
expect_status nonzero "replay of a corrupt file" -- "$bin" replay "$dir/garbage.csv.gz"
printf '%s\n%s\n%s\n' "$header" '1,alloc,4096,1048576,0' '2,alloc,8192,lots,0' | write_trace malformed
expect_status nonzero "replay of a malformed line" -- "$bin" replay "$dir/malformed.csv.gz"
grep -q 'malformed' "$dir/err" || fail "replay of a malformed line does not say so"
printf '%s\n%s\n%s\n' "$header" '1,alloc,4096,1048576,0' '2,free,999,512,0' | write_trace unknown
expect_status nonzero "replay of a free of an unknown address" -- "$bin" replay "$dir/unknown.csv.gz"
expect_key unknown_frees 1 "replay unknown free"
printf 't_us,what,addr\n1,alloc,4096\n' | write_trace noheader
expect_status nonzero "replay without the header" -- "$bin" replay "$dir/noheader.csv.gz"
expect_status nonzero "replay of a missing file" -- "$bin" replay "$dir/missing.csv.gz"
# An allocation larger than the emulated device.
printf '%s\n%s\n' "$header" '1,alloc,4096,1099511627776,0' | write_trace huge
expect_status nonzero "replay of an allocation that cannot fit" -- \
  "$bin" replay "$dir/huge.csv.gz" --conf host_capacity:64MiB
grep -q 'allocating 1099511627776 bytes failed' "$dir/err" ||
  fail "replay of an impossible allocation does not report it: $(cat "$dir/err")"
expect_status nonzero "replay with a bad --conf" -- "$bin" replay "$dir/simple.csv.gz" --conf bogus
expect_status 2 "replay without a file" -- "$bin" replay

# --- soak: options and the CSV row (the workload itself is the soak test) ----
expect_status 0 "soak --help" -- "$bin" soak --help
grep -q 'usage: tidalloc soak' "$dir/out" || fail "soak --help printed no usage"
expect_status 2 "soak with an unknown option" -- "$bin" soak --bogus
expect_status 2 "soak with 0 threads" -- "$bin" soak --threads 0
expect_status 2 "soak with a bad --max-gib" -- "$bin" soak --max-gib lots
expect_status 2 "soak --seconds without a value" -- "$bin" soak --seconds
expect_status 0 "soak for 1 s" -- env TIDALLOC_CONF=backend:host \
  "$bin" soak --seconds 1 --seed 7 --threads 2 --max-gib 0.25 --quiet --csv "$dir/soak.csv"
grep -q '^soak: PASS$' "$dir/out" || fail "soak for 1 s did not print PASS: $(tail -3 "$dir/out")"
[ "$(wc -l <"$dir/soak.csv")" -eq 2 ] || fail "soak's CSV does not hold a header and one row"
head -n 1 "$dir/soak.csv" | grep -q '^backend,device,seed,threads,' || fail "soak's CSV header"
tail -n 1 "$dir/soak.csv" | grep -Eq '^host,"[^"]*",7,2,4,0\.250,.*,pass$' ||
  fail "soak's CSV row is '$(tail -n 1 "$dir/soak.csv")'"

# --- stream: the benchmark's CSV and the driver's work beside it -----------
expect_status 0 "stream of 4 frames" -- env TIDALLOC_CONF=backend:host \
  "$bin" stream --frames 4 --label 'a,b' --csv "$dir/stream.csv" --driver-csv "$dir/driver.csv"
[ "$(head -n 1 "$dir/stream.csv")" = \
  "frames,status,requested_height,requested_width,effective_height,effective_width,backend,dtype,seconds,peak_allocated_gib,peak_reserved_gib,error" ] ||
  fail "stream --csv header is '$(head -n 1 "$dir/stream.csv")'"
[ "$(head -n 1 "$dir/driver.csv")" = \
  "frames,status,backend,seconds,reserved_over_allocated,pages_mapped,pages_unmapped,mappings,unmappings,max_running_ratio,max_running_ratio_frame,median_frame_ms,p90_frame_ms,max_frame_ms,stream_waits,median_alloc_ms,median_issue_ms,mapping_s" ] ||
  fail "stream --driver-csv header is '$(head -n 1 "$dir/driver.csv")'"
# One row each; the label with a comma quoted; mappings at least one, as the table says.
[ "$(wc -l <"$dir/driver.csv")" -eq 2 ] || fail "stream --driver-csv does not hold one row"
tail -n 1 "$dir/driver.csv" | grep -Eq '^4,ok,"a,b",[0-9.]+,1\.[0-9]+,[1-9][0-9]*,[0-9]+,[1-9][0-9]*,[0-9]+,1\.[0-9]+,[1-4],[0-9.]+,[0-9.]+,[0-9.]+,[0-9]+,[0-9.]+,[0-9.]+,([1-9][0-9]*\.[0-9]+|0\.[0-9]*[1-9][0-9]*)$' ||
  fail "stream --driver-csv row is '$(tail -n 1 "$dir/driver.csv")'"
table_maps=$(awk '$1 == 4 && $2 == "ok" { print $(NF - 1) }' "$dir/out")
[ "$table_maps" = "$(tail -n 1 "$dir/driver.csv" | awk -F, '{ print $(NF - 10) }')" ] ||
  fail "stream: the table's maps '$table_maps' differ from --driver-csv's"

# --frames-csv: a row per one-frame step (16 frames: the 8 scale frames in one batch, then 8).
"$bin" stream --frames 16 --sync-frames --frames-csv "$dir/frames.csv" >/dev/null 2>&1 ||
  fail "stream --frames-csv failed"
[ "$(head -n 1 "$dir/frames.csv")" = \
  "backend,frames,frame,frame_ms,issue_ms,alloc_ms,mappings,unmappings,stream_waits,allocated_gib,reserved_gib,mapping_ms" ] ||
  fail "stream --frames-csv header is '$(head -n 1 "$dir/frames.csv")'"
[ "$(tail -n +2 "$dir/frames.csv" | cut -d, -f3 | tr '\n' ' ')" = "9 10 11 12 13 14 15 16 " ] ||
  fail "stream --frames-csv frames are '$(tail -n +2 "$dir/frames.csv" | cut -d, -f3 | tr '\n' ' ')'"

# With no options: a sweep that fits the default emulated device, every row ok.
expect_status 0 "stream with no options" -- env TIDALLOC_CONF=backend:host "$bin" stream
[ "$(awk '$2 == "ok"' "$dir/out" | wc -l)" -ge 1 ] || fail "stream with no options ran nothing"
awk '$2 == "oom"' "$dir/out" | grep -q . && fail "stream with no options ran out of memory"
# A frame count that runs out of memory fails the command, and its message
# names the emulated device's size, not PyTorch's remedies or a limit not set.
expect_status 1 "stream out of memory" -- env TIDALLOC_CONF=backend:host \
  "$bin" stream --frames 16 --conf host_capacity:4GiB
grep -q '^ *16 *oom' "$dir/out" || fail "stream out of memory has no oom row: $(cat "$dir/out")"
grep -q 'host_capacity' "$dir/out" || fail "stream's out-of-memory message does not name host_capacity"
grep -q '(nil)' "$dir/out" && fail "stream's out-of-memory message prints the stream as (nil)"
grep -q 'memory limit none.*the memory limit of' "$dir/out" &&
  fail "stream's out-of-memory message blames a memory limit it says is not set"
grep -q 'ran out of memory' "$dir/err" || fail "stream out of memory does not say so on stderr"
# Bad frame counts: one message for all of them.
expect_status 2 "stream --frames 0" -- "$bin" stream --frames 0
zero=$(sed "s/'0'/N/" "$dir/err")
expect_status 2 "stream --frames -5" -- "$bin" stream --frames -5
[ "$(sed "s/'-5'/N/" "$dir/err")" = "$zero" ] ||
  fail "stream --frames -5 says '$(cat "$dir/err")', --frames 0 '$zero'"
# An output that cannot be written fails before any run.
expect_status 1 "stream --csv to an unwritable path" -- env TIDALLOC_CONF=backend:host \
  "$bin" stream --frames 1024 --csv "$dir/no/such/dir/stream.csv"
grep -q 'no/such/dir/stream.csv' "$dir/err" || fail "stream --csv unwritable: $(cat "$dir/err")"
[ -s "$dir/out" ] && fail "stream --csv unwritable ran the benchmark first: $(cat "$dir/out")"
# The backend column fits its longest label: the header and the row line up.
expect_status 0 "stream --mode grow" -- env TIDALLOC_CONF=backend:host \
  "$bin" stream --frames 2 --mode grow
[ "$(awk 'NR <= 2 { print length($0) }' "$dir/out" | sort -u | wc -l)" -eq 1 ] ||
  fail "stream's table columns do not line up: $(head -2 "$dir/out")"

if [ "$failures" -ne 0 ]; then
  echo "cli_smoke: $failures failures" >&2
  exit 1
fi
echo "cli_smoke: all checks passed"
