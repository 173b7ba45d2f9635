#!/usr/bin/env bash
# Runs one md4jax process per GPU host over plain ssh, as one jax.distributed run.
#
#   launch/multinode.sh [--dry-run] HOSTS_FILE -- TRAINER_FLAGS...
#   HOSTS="gpu1 gpu2" launch/multinode.sh [--dry-run] -- TRAINER_FLAGS...
#
#   launch/multinode.sh hosts.txt -- --config=configs/owt.py --workdir=/shared/owt
#
# HOSTS_FILE holds one ssh destination (host, user@host or an ~/.ssh/config alias) a
# line; blank lines and # comments are skipped. The first host is process 0 and the
# coordinator. Host i runs, in DIR (a checkout with a .venv holding md4jax and
# "jax[cuda12]"):
#
#   python -m md4jax.main TRAINER_FLAGS --coordinator_address=COORDINATOR:PORT \
#       --num_processes=N --process_id=i
#
# Its output goes to LOG_DIR/process-<i>-<host>.log here; the script waits for every
# host and exits non-zero if any failed. Ctrl-C ends the local ssh clients; a remote
# process left behind stops when jax.distributed loses the others (or kill it by hand).
#
# Environment:
#   HOSTS        hosts, space-separated, instead of HOSTS_FILE
#   PORT         coordinator port on the first host (default 12355)
#   COORDINATOR  the first host's address as the others reach it (default: its name
#                without user@; set an IP if ssh aliases do not resolve between hosts)
#   DIR          the checkout on every host (default md4jax, i.e. ~/md4jax)
#   LOG_DIR      local folder for the logs (default logs/multinode-YYYYmmdd-HHMMSS)
#   SSH          ssh command (default: ssh -o BatchMode=yes)
#   DRY_RUN=1    print the ssh commands, one a host, and run nothing (as --dry-run)
# --workdir must be on a filesystem every host mounts at the same path.
set -euo pipefail

usage() {
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Like Python's shlex.quote: bare when safe, else single-quoted.
quote() {
  if [[ -n "$1" && "$1" != *[^A-Za-z0-9_@%+=:,./-]* ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\"\'\"\'}"
  fi
}

# quote, but a leading ~/ stays expandable on the remote host.
remote_path() {
  if [[ "$1" == "~/"* ]]; then printf '~/%s' "$(quote "${1#\~/}")"; else quote "$1"; fi
}

dry_run="${DRY_RUN:-0}"
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi

hosts=()
if [[ $# -gt 0 && "$1" != "--" ]]; then
  [[ -f "$1" ]] || { echo "multinode.sh: no hosts file $1" >&2; usage; }
  while read -r line || [[ -n "$line" ]]; do
    line="${line%%#*}"
    read -r -a words <<< "$line"
    hosts+=("${words[@]}")
  done < "$1"
  shift
elif [[ -n "${HOSTS:-}" ]]; then
  read -r -a hosts <<< "$HOSTS"
fi
[[ ${#hosts[@]} -gt 0 ]] || { echo "multinode.sh: give a HOSTS_FILE or HOSTS=\"h1 h2\"" >&2; usage; }
[[ "${1:-}" == "--" ]] || { echo "multinode.sh: put the trainer's flags after --" >&2; usage; }
shift
[[ $# -gt 0 ]] || { echo "multinode.sh: no trainer flags after -- (--config=... --workdir=...)" >&2; usage; }

port="${PORT:-12355}"
coordinator="${COORDINATOR:-${hosts[0]#*@}}"
dir="${DIR:-md4jax}"
log_dir="${LOG_DIR:-logs/multinode-$(date +%Y%m%d-%H%M%S)}"
read -r -a ssh <<< "${SSH:-ssh -o BatchMode=yes}"
n=${#hosts[@]}

trainer=""
for arg in "$@"; do trainer+=" $(quote "$arg")"; done

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap 'cleanup; exit 130' INT TERM

[[ "$dry_run" == 1 ]] || mkdir -p "$log_dir"
for i in "${!hosts[@]}"; do
  host="${hosts[$i]}"
  remote="cd $(remote_path "$dir") && . .venv/bin/activate && exec python -m md4jax.main${trainer}"
  remote+=" --coordinator_address=$(quote "$coordinator:$port") --num_processes=$n --process_id=$i"
  if [[ "$dry_run" == 1 ]]; then
    line=""
    for word in "${ssh[@]}" "$host" "$remote"; do line+="$(quote "$word") "; done
    echo "${line% }"
    continue
  fi
  log="$log_dir/process-$i-${host//[^A-Za-z0-9_.@-]/_}.log"
  # No stdin: a backgrounded ssh reading the terminal would stop the job.
  "${ssh[@]}" "$host" "$remote" > "$log" 2>&1 < /dev/null &
  pids+=("$!")
  echo "process $i on $host: $log" >&2
done
[[ "$dry_run" == 1 ]] && exit 0

echo "follow process 0: tail -f $(quote "$log_dir")/process-0-*.log" >&2
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "multinode.sh: process $i on ${hosts[$i]} failed; see $log_dir/process-$i-*.log" >&2
    failed=1
  fi
done
exit "$failed"
