# cli.sh: sourced by the command-line tests (tests/cli_smoke.sh,
# tests/cli_edges.sh, tests/replay_bad_traces.sh), which set $dir (a scratch
# folder) and failures=0 first.
#   fail TEXT                              count a failure, saying TEXT
#   expect_status CODE DESCRIPTION -- command...
#                                          the command's exit status must be
#                                          CODE ("nonzero" for any failure); its
#                                          output lands in $dir/out and $dir/err

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

expect_status() {
  want=$1 what=$2
  shift 3
  "$@" >"$dir/out" 2>"$dir/err"
  got=$?
  if [ "$want" = nonzero ]; then
    [ "$got" -ne 0 ] || fail "$what: exited 0, wanted a failure"
  elif [ "$got" -ne "$want" ]; then
    fail "$what: exited $got, wanted $want; stderr: $(cat "$dir/err")"
  fi
}
