#!/bin/sh
# cli_edges.sh: the tidalloc command at its edges: output that cannot be
# written (a full device: standard output, every CSV and the trace) fails the
# command with one line naming it, and a CSV path that is a device is written
# in place, never replaced; extra arguments to --version and --help are usage
# errors; a repeated --frames adds to the sweep; soak sizes its workload from
# the memory limit, not the device.
# usage: cli_edges.sh path/to/tidalloc
set -u

bin=${1:?usage: cli_edges.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
failures=0
TIDALLOC_CONF=backend:host
export TIDALLOC_CONF

. "$(dirname "$0")/lib/cli.sh"

# --- output that cannot be written -------------------------------------------
# A device that is always full: a node of its own in $dir where the system
# allows one (so that a command that replaced the path would replace only
# that), else the system's.
full=""
if mknod "$dir/full" c 1 7 2>/dev/null && [ -c "$dir/full" ]; then
  full="$dir/full"
elif [ -c /dev/full ]; then
  full=/dev/full
fi

# expect_lost DESCRIPTION NAME -- command...: the command (its stdout already
# redirected by the caller where that is what is tested) exits 1 with one
# line on stderr that names NAME, and $full is still the device.
expect_lost() {
  what=$1 name=$2
  shift 3
  # A node of its own for each case: one a failed case replaced is not
  # carried into the next.
  if [ "$full" = "$dir/full" ]; then
    rm -f "$full" && mknod "$full" c 1 7
  fi
  "$@" 2>"$dir/err"
  got=$?
  [ "$got" -eq 1 ] || fail "$what: exited $got, wanted 1; stderr: $(cat "$dir/err")"
  [ "$(wc -l <"$dir/err")" -eq 1 ] || fail "$what: stderr holds $(wc -l <"$dir/err") lines: $(cat "$dir/err")"
  grep -qF "$name" "$dir/err" || fail "$what: stderr does not name $name: $(cat "$dir/err")"
  [ -c "$full" ] || fail "$what: $full is no longer a device: $(ls -l "$full")"
}

if [ -n "$full" ]; then
  expect_lost "info to a full stdout" "standard output" -- sh -c '"$1" info >"$2"' sh "$bin" "$full"
  expect_lost "--version to a full stdout" "standard output" -- \
    sh -c '"$1" --version >"$2"' sh "$bin" "$full"
  printf '%s\n%s\n%s\n' 't_us,action,addr,size,stream' '1,alloc,4096,1024,0' '2,free,4096,1024,0' |
    gzip -c >"$dir/trace.csv.gz"
  expect_lost "replay to a full stdout" "standard output" -- \
    sh -c '"$1" replay "$3" >"$2"' sh "$bin" "$full" "$dir/trace.csv.gz"
  expect_lost "stream to a full stdout" "standard output" -- \
    sh -c '"$1" stream --frames 2 >"$2"' sh "$bin" "$full"
  for option in --csv --driver-csv --trace-csv --frames-csv; do
    expect_lost "stream $option to a full device" "$full" -- \
      sh -c '"$1" stream --frames 2 "$3" "$2" >/dev/null' sh "$bin" "$full" "$option"
  done
  expect_lost "soak --csv to a full device" "$full" -- \
    sh -c '"$1" soak --seconds 1 --seed 5 --threads 2 --max-gib 0.125 --quiet --csv "$2" >/dev/null' \
    sh "$bin" "$full"
  [ -e "$full.tmp" ] && fail "stream left $full.tmp behind"
else
  echo "cli_edges: no full device here (mknod refused, no /dev/full): lost output not tested"
fi

# A CSV to a path that is not a regular file (a link to standard output,
# here a pipe) gets its rows once, not a header and the rows again after every
# run, and the link is not replaced by a file. The link is one of its own, so
# that a command that replaced it would replace only that.
ln -s /proc/self/fd/1 "$dir/stdout"
{
  "$bin" stream --frames 2 3 --csv "$dir/stdout" 2>"$dir/err"
  echo $? >"$dir/rc"
} | cat >"$dir/out"
[ "$(cat "$dir/rc")" -eq 0 ] || fail "stream --csv to a link to stdout exited $(cat "$dir/rc"): $(cat "$dir/err")"
[ -L "$dir/stdout" ] || fail "stream --csv replaced the link it was given: $(ls -l "$dir/stdout")"
[ "$(grep -c '^frames,status,' "$dir/out")" -eq 1 ] ||
  fail "stream --csv to a link to stdout wrote the header $(grep -c '^frames,status,' "$dir/out") times"
[ "$(grep -Ec '^[23],ok,' "$dir/out")" -eq 2 ] ||
  fail "stream --csv to a link to stdout rows: $(grep -E '^[0-9]+,' "$dir/out")"

# --- arguments -----------------------------------------------------------------
expect_status 2 "--version extra" -- "$bin" --version extra
grep -q "extra" "$dir/err" || fail "--version extra does not name the argument: $(cat "$dir/err")"
[ -s "$dir/out" ] && fail "--version extra printed the version: $(cat "$dir/out")"
expect_status 2 "-V extra" -- "$bin" -V extra
expect_status 2 "--help extra" -- "$bin" --help extra
expect_status 2 "help micro extra" -- "$bin" help micro extra
expect_status 0 "--version" -- "$bin" --version

# A repeated --frames adds its counts: two runs, in the order given.
expect_status 0 "stream --frames 2 --frames 3" -- "$bin" stream --frames 2 --frames 3 --csv "$dir/s.csv"
[ "$(tail -n +2 "$dir/s.csv" | cut -d, -f1 | tr '\n' ' ')" = "2 3 " ] ||
  fail "stream --frames 2 --frames 3 ran '$(tail -n +2 "$dir/s.csv" | cut -d, -f1 | tr '\n' ' ')'"
expect_status 2 "stream --frames 2 --frames (empty)" -- "$bin" stream --frames 2 --frames
grep -q 'at least one frame count' "$dir/err" || fail "an empty second --frames: $(cat "$dir/err")"

# --- soak under a memory limit -------------------------------------------------
# The workload is sized from the limit (at most half of it live), so the run
# passes: its expected out-of-memory checks aside, nothing runs out.
expect_status 0 "soak under memory_limit:128MiB" -- \
  "$bin" soak --seconds 2 --seed 3 --threads 2 --quiet --conf memory_limit:128MiB
grep -q '^soak: PASS$' "$dir/out" || fail "soak under a limit: $(tail -8 "$dir/out")"
grep -q 'at most 64.00 MiB live' "$dir/out" ||
  fail "soak under memory_limit:128MiB is not sized from it: $(head -1 "$dir/out")"

if [ "$failures" -ne 0 ]; then
  echo "cli_edges: $failures failures" >&2
  exit 1
fi
echo "cli_edges: all checks passed"
