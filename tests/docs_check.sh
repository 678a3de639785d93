#!/bin/sh
# docs_check.sh: what the documentation promises about itself. README.md is a
# user's guide of at most 10,000 bytes that states the present (no
# commit hashes, run letters, times of day, footnote marks or traces the
# repository lacks), and its first screen (40 lines) holds what tidalloc is,
# the install and a quick start for C, PyTorch and the command; docs/design.md
# is at most 500 lines; no guide names a file outside the repository; every
# file of bench/results/<machine>/ (history/ aside) is named in the index,
# bench/results/README.md; the license is there. That the guides' code runs
# is tests/docs_run.sh's.
# usage: docs_check.sh [path/to/tidalloc] (the argument is not used)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

readme=$root/README.md
chars=$(wc -c <"$readme" | tr -d " ")
[ "$chars" -le 10000 ] || fail "README.md has $chars bytes, more than 10,000"
# A commit hash: 7 to 40 hex digits with a letter and a digit among them.
hashes=$(grep -oE '\b[0-9a-f]{7,40}\b' "$readme" | grep '[a-f]' | grep '[0-9]')
[ -z "$hashes" ] || fail "README.md names commits: $(echo $hashes)"
grep -nE '\brun [A-Z]\b|[0-9]{2}:[0-9]{2} UTC|shared traces' "$readme" &&
  fail "README.md names run letters, times of day or traces not in the repository"
grep -n '[§†‡]' "$readme" && fail "README.md has footnote marks"
# The first screen: what and why, install, quick start.
head -n 40 "$readme" >"${TMPDIR:-/tmp}/docs_check.$$"
for want in '## Install' 'make run' 'make test' 'pip install .' '## Quick start' \
  'cc examples/hello.c' 'python -m tidalloc run' 'tidalloc info'; do
  grep -qF -- "$want" "${TMPDIR:-/tmp}/docs_check.$$" ||
    fail "README.md's first 40 lines lack '$want'"
done
# ...with every block of it closed within those lines.
[ $(($(grep -c '^```' "${TMPDIR:-/tmp}/docs_check.$$") % 2)) -eq 0 ] ||
  fail "README.md's first 40 lines end inside a code block"
rm -f "${TMPDIR:-/tmp}/docs_check.$$"
outside=$(grep -ln '\.\./shared\|/work/' "$readme" "$root"/docs/*.md "$root"/bench/torch/*.py \
  "$root"/bench/torch/*.md 2>/dev/null)
[ -z "$outside" ] || fail "files outside the repository are named in: $(echo $outside)"

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
