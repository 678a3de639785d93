# slack.sh: sourced by the memory tests (tests/stream_ratio.sh,
# tests/replay_traces.sh), which hold each run to its release slack.
#   default_slack BIN   the release_slack default that `BIN info` reports
#                       (name, default, current, ...), TIDALLOC_CONF aside;
#                       when there is none, FAIL on stderr and status 1,
#                       which the caller's `|| exit 1` ends the test with
#   slack_limit SLACK   the ratio a run at SLACK may reach: 1 + SLACK + 0.003,
#                       growth past the ceiling that wait_limit lets through
#                       and a page (at 0.017, 1.02: the goal for expandable
#                       segments)

default_slack() {
  _slack=$(env -u TIDALLOC_CONF "$1" info | awk '$1 == "release_slack" { print $2 }')
  case $_slack in
    0.* | 1*) echo "$_slack" ;;
    *) echo "FAIL: no release_slack default in \`tidalloc info\`: '$_slack'" >&2; exit 1 ;;
  esac
}

slack_limit() {
  awk -v s="$1" 'BEGIN { printf "%.4f", 1.003 + s }'
}
