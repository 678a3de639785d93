#!/bin/sh
# docs_check.sh: what the documentation promises about itself. README.md is a
# user's guide of at most 15,000 bytes that states the present (no
# commit hashes, run letters, times of day or traces the repository lacks),
# and its hello program is examples/hello.c verbatim; docs/design.md is at
# most 500 lines; every file of bench/results/<machine>/ (history/ aside) is
# named in the index, bench/results/README.md; the license is there.
# usage: docs_check.sh [path/to/tidalloc] (the argument is not used)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

readme=$root/README.md
# Counted in bytes: each of the footnote marks (§ † ‡) counts as two or three.
chars=$(wc -c <"$readme" | tr -d " ")
[ "$chars" -le 15000 ] || fail "README.md has $chars bytes, more than 15,000"
# A commit hash: 7 to 40 hex digits with a letter and a digit among them.
hashes=$(grep -oE '\b[0-9a-f]{7,40}\b' "$readme" | grep '[a-f]' | grep '[0-9]')
[ -z "$hashes" ] || fail "README.md names commits: $(echo $hashes)"
grep -nE '\brun [A-Z]\b|[0-9]{2}:[0-9]{2} UTC|shared traces' "$readme" &&
  fail "README.md names run letters, times of day or traces not in the repository"
python3 - "$readme" "$root/examples/hello.c" <<'PY' || fail "README.md's hello program is not examples/hello.c"
import sys
readme, hello = (open(p, encoding="utf-8").read() for p in sys.argv[1:])
sys.exit(0 if "```c\n" + hello.rstrip("\n") + "\n```" in readme else 1)
PY

lines=$(wc -l <"$root/docs/design.md")
[ "$lines" -le 500 ] || fail "docs/design.md has $lines lines, more than 500"

index=$root/bench/results/README.md
for dir in "$root"/bench/results/*/; do
  [ "$(basename "$dir")" = history ] && continue
  for f in "$dir"*; do
    name=$(basename "$f")
    grep -q "\`$name\`" "$index" ||
      fail "bench/results/$(basename "$dir")/$name is not in bench/results/README.md"
  done
done
[ -f "$root/bench/results/history/README.md" ] || fail "bench/results/history/README.md is missing"

[ -s "$root/LICENSE" ] || fail "there is no LICENSE"

if [ "$failures" -ne 0 ]; then
  echo "docs_check: $failures failures" >&2
  exit 1
fi
echo "docs_check: all checks passed"
