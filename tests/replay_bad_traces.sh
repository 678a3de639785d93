#!/bin/sh
# replay_bad_traces.sh: `tidalloc replay` on traces that must be refused, each
# with the file, the line and what is wrong in a printable message, and ended
# at once: /dev/zero, a NUL byte inside a line, over-long lines, malformed
# fields, decreasing timestamps, data after the gzip stream, escape bytes.
# Also what must still pass: empty lines, CRLF, two gzip members, plain text.
# (The large cases of issue 31, 1 GB of newlines and 80 M lines, are measured
# in bench/results/host/replay_bounds.md: too slow for the sanitizer builds.)
# usage: replay_bad_traces.sh path/to/tidalloc
set -u

bin=${1:?usage: replay_bad_traces.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
failures=0
header='t_us,action,addr,size,stream'

. "$(dirname "$0")/lib/cli.sh"

# refused NAME FILE NEEDLE...: replay of FILE fails, its one message names
# the needles, and has no byte outside printable ASCII.
refused() {
  name=$1 file=$2
  shift 2
  if "$bin" replay "$file" >"$dir/out" 2>"$dir/err"; then
    fail "$name: replay succeeded"
    return
  fi
  for needle in "$@"; do
    grep -qF -- "$needle" "$dir/err" || fail "$name: no '$needle' in: $(cat "$dir/err")"
  done
  if LC_ALL=C grep -q '[^ -~]' "$dir/err"; then
    fail "$name: the message has bytes outside printable ASCII: $(od -c "$dir/err" | head -5)"
  fi
  echo "PASS: $name: $(cat "$dir/err")"
}

gz() { gzip -c >"$dir/$1.csv.gz"; }

# /dev/zero: refused at its first line, not read to its (missing) end.
if command -v timeout >/dev/null 2>&1; then
  timeout 20 "$bin" replay /dev/zero >"$dir/out" 2>"$dir/err"
  [ $? -eq 1 ] || fail "/dev/zero: not refused at once: $(cat "$dir/err")"
  grep -qF '/dev/zero:1: a NUL byte at column 1' "$dir/err" || fail "/dev/zero: $(cat "$dir/err")"
fi

printf '%s\n1,alloc,1,100,0\000x\n2,alloc,2,100,0\n3,free,2,0,0\n' "$header" | gz nul
refused "a NUL byte" "$dir/nul.csv.gz" 'nul.csv.gz:2: a NUL byte at column 16'

awk -v h="$header" 'BEGIN { print h; s = "1,alloc,1,"; for (i = 0; i < 300; i++) s = s "9"; print s ",0" }' |
  gz long
refused "a line of 311 bytes" "$dir/long.csv.gz" 'long.csv.gz:2: the line is longer than 255 bytes'

printf '%s\n1,alloc,0x7f00,100,0\n' "$header" | gz hex
refused "a hexadecimal address" "$dir/hex.csv.gz" 'hex.csv.gz:2: malformed field 3 (addr)' \
  'addresses are written in decimal'

printf '%s\n1,alloc,4096,lots,0\n' "$header" | gz size
refused "a size that is no number" "$dir/size.csv.gz" 'size.csv.gz:2: malformed field 4 (size)' \
  "'lots' is not an unsigned decimal number"

printf '%s\n1,alloc,4096,100\n' "$header" | gz short
refused "four fields" "$dir/short.csv.gz" 'short.csv.gz:2: malformed line' '4 field(s)'

printf '%s\n1,grab,4096,100,0\n' "$header" | gz action
refused "an unknown action" "$dir/action.csv.gz" "field 2 (action): 'grab' is neither alloc nor free"

printf '%s\n1,alloc,4096,18446744073709551616,0\n' "$header" | gz overflow
refused "a size past 64 bits" "$dir/overflow.csv.gz" 'does not fit in 64 bits'

printf '%s\n5,alloc,4096,100,0\n3,free,4096,100,0\n' "$header" | gz back
refused "a timestamp that goes back" "$dir/back.csv.gz" \
  'back.csv.gz:3: t_us 3 is earlier than the 5 of line 2'

printf '%s\n1,alloc,4096,100,0\n2,free,4096,100,0\n' "$header" | gz junk
printf 'trailing junk\n' >>"$dir/junk.csv.gz"
refused "data after the gzip stream" "$dir/junk.csv.gz" 'data after the end of the gzip stream'

printf '%s\n1,alloc,\033[31mred,100,0\n' "$header" | gz escape
refused "an escape sequence" "$dir/escape.csv.gz" "'\\x1b[31mred'"

printf 'hello\n' | gz noheader
refused "no header" "$dir/noheader.csv.gz" "not a trace: the first line is 'hello'"

# What must pass: empty lines, CRLF, a last line without newline, two gzip
# members (as `cat a.gz b.gz` makes), and the same text not gzip'd.
printf '%s\r\n\n1,alloc,4096,100,0\r\n\n\n2,alloc,8192,50,3\n' "$header" | gzip -c >"$dir/ok.csv.gz"
printf '3,free,4096,0,0\n4,free,8192,50,3' | gzip -c >>"$dir/ok.csv.gz"
zcat "$dir/ok.csv.gz" >"$dir/ok.csv"
for f in ok.csv.gz ok.csv; do
  if "$bin" replay "$dir/$f" >"$dir/out" 2>"$dir/err"; then
    events=$(awk '$1 == "events" { print $2 }' "$dir/out")
    peak=$(awk '$1 == "peak_live_bytes" { print $2 }' "$dir/out")
    [ "$events" = 4 ] && [ "$peak" = 150 ] || fail "$f: events '$events', peak_live_bytes '$peak'"
    echo "PASS: $f"
  else
    fail "$f: refused: $(cat "$dir/err")"
  fi
done

exit "$failures"
