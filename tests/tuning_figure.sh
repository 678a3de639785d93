#!/bin/sh
# tuning_figure.sh: docs/tuning.md's table of replays under memory limits is
# what scripts/replay_frontier.py prints today, with the tidalloc command
# given (ctest passes build/'s). The table follows the line
# "<!-- replay_frontier.py: ..." and ends at the first line that is not a row.
# usage: tuning_figure.sh path/to/tidalloc
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:?usage: tuning_figure.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

python3 "$root/scripts/replay_frontier.py" --tidalloc "$bin" >"$dir/printed" || {
  echo "FAIL: scripts/replay_frontier.py failed" >&2
  exit 1
}
awk '/^<!-- replay_frontier.py/ { on = 1; next } on && /^\|/ { print; next } on { exit }' \
  "$root/docs/tuning.md" >"$dir/shown"
if ! [ -s "$dir/shown" ]; then
  echo "FAIL: docs/tuning.md has no table after its <!-- replay_frontier.py --> line" >&2
  exit 1
fi
if ! diff -u "$dir/shown" "$dir/printed" >"$dir/diff"; then
  echo "FAIL: docs/tuning.md's table differs from scripts/replay_frontier.py's output" \
    "(- the doc, + the script; paste the script's table into the doc):" >&2
  cat "$dir/diff" >&2
  exit 1
fi
echo "tuning_figure: docs/tuning.md shows what scripts/replay_frontier.py prints"
