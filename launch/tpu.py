r"""Creates, sets up, runs md4jax on, and deletes a Cloud TPU VM slice, through gcloud.

  python launch/tpu.py create --name=md4 --zone=us-west4-a --accelerator-type=v5litepod-16 --spot
  python launch/tpu.py status --name=md4 --zone=us-west4-a
  python launch/tpu.py setup  --name=md4 --zone=us-west4-a --repo=https://github.com/ME/md4jax --ref=main
  python launch/tpu.py setup  --name=md4 --zone=us-west4-a --copy        # ship this working tree
  python launch/tpu.py run    --name=md4 --zone=us-west4-a --run-name=owt -- \
      --config=configs/owt.py --workdir=/mnt/work/owt --config.mesh.fsdp=16 --config.mesh.data=1
  python launch/tpu.py logs   --name=md4 --zone=us-west4-a --follow
  python launch/tpu.py stop   --name=md4 --zone=us-west4-a
  python launch/tpu.py ssh    --name=md4 --zone=us-west4-a -- 'df -h /mnt/work'
  python launch/tpu.py delete --name=md4 --zone=us-west4-a

Every subcommand takes --project and --dry-run (print the gcloud commands, one a
line, instead of running them). --queued creates/describes/deletes a queued
resource of the same name instead of a plain TPU VM. Every worker of a slice
runs the same `python -m md4jax.main ...`; jax.distributed finds the others by
itself on a TPU VM. Standard library only, so it runs wherever gcloud does.
"""

import argparse
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOG_DIR = "~/md4jax_logs"  # On every worker: <run-name>.log, latest.log -> it, latest.pid.
REMOTE_TARBALL = "md4jax-src.tar.gz"  # --copy lands here, in the workers' home.

# The runtime (software version) Cloud TPU recommends for JAX, per TPU generation.
RUNTIMES = (
  ("v6e", "v2-alpha-tpuv6e"),
  ("v5litepod", "v2-alpha-tpuv5-lite"),
  ("v5e", "v2-alpha-tpuv5-lite"),
  ("v5p", "v2-alpha-tpuv5"),
)
OLDER_RUNTIME = "tpu-ubuntu2204-base"  # v4 and older.

# A Python for the venv: jax needs >= 3.11, the Ubuntu 22.04 runtimes ship 3.10.
# (No single quotes in remote scripts: shlex.quote then keeps --command readable.)
PICK_PYTHON = (
  'PY=python3.11 && { [ "$(python3 -c "import sys; print(sys.version_info >= (3, 11))")"'
  " != True ] || PY=python3; }"
)
RUNNING = 'ps -o args= -p "$(cat {pid} 2>/dev/null)" 2>/dev/null | grep -q md4jax.main'


def default_runtime(accelerator_type: str) -> str:
  """The runtime version for an accelerator type such as v5litepod-16 or v4-32."""
  for prefix, runtime in RUNTIMES:
    if accelerator_type.startswith(prefix):
      return runtime
  return OLDER_RUNTIME


def remote_path(path: str) -> str:
  """Shell-quotes a path for the worker's shell, keeping a leading ~/ expandable."""
  if path == "~":
    return path
  if path.startswith("~/"):
    return "~/" + shlex.quote(path[2:])
  return shlex.quote(path)


def _git(*args):
  """stdout of a git command in this checkout, or None."""
  try:
    out = subprocess.run(
      ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return out.stdout.strip() or None


def _gcloud(args, *words):
  cmd = ["gcloud", "compute", "tpus", *words, f"--zone={args.zone}"]
  return cmd + ([f"--project={args.project}"] if args.project else [])


def _ssh(args, worker, command=None):
  cmd = _gcloud(args, "tpu-vm", "ssh", args.name, f"--worker={worker}")
  return cmd + (["--command", command] if command is not None else [])


def _kind(args):
  return ("queued-resources",) if args.queued else ("tpu-vm",)


def _hint(args, *words):
  """The tpu.py command line for a follow-up step, for messages."""
  flags = [f"--name={args.name}", f"--zone={args.zone}"]
  flags += [f"--project={args.project}"] if args.project else []
  return shlex.join(["python", "launch/tpu.py", words[0], *flags, *words[1:]])


def create(args):
  runtime = args.runtime_version or default_runtime(args.accelerator_type)
  spot = ["--spot"] if args.spot else []
  if args.queued:
    # The queued resource and its node share the name, so ssh/scp use --name as is.
    return [
      _gcloud(
        args,
        "queued-resources",
        "create",
        args.name,
        f"--node-id={args.name}",
        f"--accelerator-type={args.accelerator_type}",
        f"--runtime-version={runtime}",
        *spot,
      )
    ]
  return [
    _gcloud(
      args,
      "tpu-vm",
      "create",
      args.name,
      f"--accelerator-type={args.accelerator_type}",
      f"--version={runtime}",
      *spot,
    )
  ]


def status(args):
  return [_gcloud(args, *_kind(args), "describe", args.name)]


def delete(args):
  if args.queued:  # --force deletes the node with the queued resource.
    return [_gcloud(args, "queued-resources", "delete", args.name, "--force", "--quiet")]
  return [_gcloud(args, "tpu-vm", "delete", args.name, "--quiet")]


def pack_working_tree(path: str) -> int:
  """Writes this checkout's tracked and untracked, not ignored, files to a .tar.gz."""
  listing = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
  if listing is None:
    sys.exit(f"tpu.py: --copy needs {ROOT} to be a git checkout (git ls-files lists what to send).")
  # Not a recursive copy of the folder: that would also ship .venv, workdirs and caches.
  names = sorted(n for n in set(listing.split("\0")) if n and (ROOT / n).is_file())
  with tarfile.open(path, "w:gz") as tar:
    for name in names:
      tar.add(ROOT / name, arcname=name)
  return len(names)


def setup(args):
  d = remote_path(args.remote_dir)
  commands = []
  if args.copy:
    tarball = os.path.join(tempfile.gettempdir(), f"md4jax-src-{args.name}.tar.gz")
    if not args.dry_run:
      print(f"tpu.py: packed {pack_working_tree(tarball)} files into {tarball}", file=sys.stderr)
    commands.append(
      _gcloud(args, "tpu-vm", "scp", tarball, f"{args.name}:{REMOTE_TARBALL}", "--worker=all")
    )
    steps = [f"mkdir -p {d}", f"tar -xzf ~/{REMOTE_TARBALL} -C {d}", f"cd {d}"]
  else:
    repo = args.repo or _git("remote", "get-url", "origin")
    if not repo:
      args.parser.error(f"setup needs --repo URL ({ROOT} has no 'origin' remote), or --copy.")
    ref = args.ref or _git("rev-parse", "HEAD") or "main"
    if (
      not args.ref and _git("rev-parse", "HEAD") and not _git("branch", "-r", "--contains", "HEAD")
    ):
      print(
        f"tpu.py: warning: HEAD ({ref[:12]}) is on no remote branch, so the workers cannot "
        "fetch it; push it, pass --ref, or use --copy.",
        file=sys.stderr,
      )
    ref = shlex.quote(ref)
    steps = [
      f"{{ [ -d {d}/.git ] || git clone -q {shlex.quote(repo)} {d}; }}",
      f"cd {d}",
      "git fetch -q --tags origin",
      # A branch name checks out origin's tip; a tag or commit checks out itself.
      f"{{ git checkout -q --detach origin/{ref} 2>/dev/null || git checkout -q --detach {ref}; }}",
    ]
  auto = args.python == "auto"
  py, py_venv = (
    ('"$PY"', '"$PY-venv"')
    if auto
    else (shlex.quote(args.python), shlex.quote(args.python + "-venv"))
  )
  steps += ([PICK_PYTHON] if auto else []) + [
    # Ubuntu's Python has no venv module until pythonX-venv is installed: install it only then.
    f"{{ [ -x .venv/bin/python ] || {py} -m venv .venv || {{ sudo apt-get -qq update && "
    # A fresh VM's unattended upgrades can hold the dpkg lock for minutes: wait for it.
    f"sudo DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600 install -y "
    f"{py} {py_venv} && "
    f"rm -rf .venv && {py} -m venv .venv; }}; }}",
    ". .venv/bin/activate",
    "pip install -q -U pip",
    " ".join(['pip install -q -e . "jax[tpu]"', *map(shlex.quote, args.pip)]),
    'echo "$(hostname): jax $(python -c "import jax; print(jax.__version__)") in $PWD"',
  ]
  commands.append(_ssh(args, "all", " && ".join(steps)))
  return commands


def run(args):
  if not args.trainer_args:
    args.parser.error(
      "run needs the trainer's flags after --, e.g. "
      "-- --config=configs/owt.py --workdir=/mnt/work/owt"
    )
  name = args.run_name or time.strftime("%Y%m%d-%H%M%S")
  logs, pid = remote_path(LOG_DIR), remote_path(f"{LOG_DIR}/latest.pid")
  log = remote_path(f"{LOG_DIR}/{name}.log")
  trainer = shlex.join(["python", "-m", "md4jax.main", *args.trainer_args])
  steps = [
    # A TPU takes one process at a time: a second run would only fail in its log.
    f'if {RUNNING.format(pid=pid)}; then echo "$(hostname): a run is still going'
    ' (tpu.py stop ends it)" >&2; exit 1; fi',
    f"mkdir -p {logs}",
    f"cd {remote_path(args.remote_dir)}",
    ". .venv/bin/activate",
    f"ln -sfn {shlex.quote(name + '.log')} {logs}/latest.log",
    # nohup and no open stdin/stdout: the run outlives the ssh session, which returns at once.
    f"{{ nohup {trainer} > {log} 2>&1 < /dev/null & }}",
    f"echo $! > {pid}",
    'echo "$(hostname): started pid $!"',
  ]
  print(
    f"tpu.py: logs in {LOG_DIR}/{name}.log on every worker; follow worker 0's with\n  "
    + _hint(args, "logs", "--follow"),
    file=sys.stderr,
  )
  return [_ssh(args, "all", " && ".join(steps))]


def logs(args):
  log = remote_path(f"{LOG_DIR}/{args.run_name}.log")
  return [_ssh(args, args.worker, f"tail -n {args.lines}{' -f' if args.follow else ''} {log}")]


def stop(args):
  pid = remote_path(f"{LOG_DIR}/latest.pid")
  # Only the pid tpu.py run recorded, and only while it still is md4jax.
  return [
    _ssh(
      args,
      "all",
      f'if {RUNNING.format(pid=pid)}; then kill "$(cat {pid})" && '
      'echo "$(hostname): stopped"; else echo "$(hostname): no run"; fi',
    )
  ]


def ssh(args):
  if args.trainer_args:
    return [
      _ssh(
        args,
        args.worker or "all",
        shlex.join(args.trainer_args) if len(args.trainer_args) > 1 else args.trainer_args[0],
      )
    ]
  return [_ssh(args, args.worker or "0")]


def build_parser():
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--name", required=True, help="TPU VM (node) name.")
  common.add_argument("--zone", required=True, help="e.g. us-west4-a (v5e), us-central2-b (v4).")
  common.add_argument("--project", help="Google Cloud project; default: gcloud's configured one.")
  common.add_argument("--dry-run", action="store_true", help="Print the gcloud commands only.")
  queued = argparse.ArgumentParser(add_help=False)
  queued.add_argument("--queued", action="store_true", help="A queued resource named --name.")
  remote = argparse.ArgumentParser(add_help=False)
  remote.add_argument("--remote-dir", default="~/md4jax", help="The checkout on every worker.")

  parser = argparse.ArgumentParser(
    prog="launch/tpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  p = sub.add_parser("create", parents=[common, queued], help="Create the slice.")
  p.add_argument(
    "--accelerator-type", required=True, help="e.g. v5litepod-16, v5p-16, v6e-8, v4-32."
  )
  p.add_argument(
    "--runtime-version",
    help="Default: " + ", ".join(f"{r} for {a}*" for a, r in RUNTIMES) + f", else {OLDER_RUNTIME}.",
  )
  p.add_argument("--spot", action="store_true", help="A spot VM: cheap, may be preempted.")
  p.set_defaults(handler=create)
  sub.add_parser("status", parents=[common, queued], help="Describe the slice.").set_defaults(
    handler=status
  )
  p = sub.add_parser("setup", parents=[common, remote], help="Install md4jax on every worker.")
  p.add_argument("--repo", help="git URL to clone; default: this checkout's origin.")
  p.add_argument("--ref", help="Branch, tag or commit; default: this checkout's HEAD commit.")
  p.add_argument("--copy", action="store_true", help="Send this working tree instead of cloning.")
  p.add_argument(
    "--python",
    default="auto",
    help="Python for the venv (>= 3.11); auto: python3 if new enough, else python3.11.",
  )
  p.add_argument("--pip", action="append", default=[], help="Extra requirement, e.g. datasets.")
  p.set_defaults(handler=setup)
  p = sub.add_parser(
    "run", parents=[common, remote], help="Start `md4jax.main -- ARGS` on all workers."
  )
  p.add_argument("--run-name", help="Log name; default: the time, YYYYmmdd-HHMMSS.")
  p.set_defaults(handler=run)
  p = sub.add_parser("logs", parents=[common], help="Tail a worker's log.")
  p.add_argument("--worker", default="0", help="Worker index, or all.")
  p.add_argument("--run-name", default="latest", help="Which run; default: the latest.")
  p.add_argument("-n", "--lines", type=int, default=100)
  p.add_argument("--follow", "-f", action="store_true")
  p.set_defaults(handler=logs)
  sub.add_parser("stop", parents=[common], help="Stop the latest run on all workers.").set_defaults(
    handler=stop
  )
  p = sub.add_parser("ssh", parents=[common], help="A shell on a worker, or `-- COMMAND` on all.")
  p.add_argument("--worker", help="Default: 0 for a shell, all for a command.")
  p.set_defaults(handler=ssh)
  sub.add_parser("delete", parents=[common, queued], help="Delete the slice.").set_defaults(
    handler=delete
  )
  return parser


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  # What follows `--` goes to md4jax.main (run) or the worker's shell (ssh), untouched.
  cut = argv.index("--") if "--" in argv else len(argv)
  parser = build_parser()
  args = parser.parse_args(argv[:cut])
  args.trainer_args, args.parser = argv[cut + 1 :], parser
  if args.trainer_args and args.command not in ("run", "ssh"):
    parser.error(f"{args.command} takes no arguments after --")
  for cmd in args.handler(args):
    if args.dry_run:
      print(shlex.join(cmd))
      continue
    print("+ " + shlex.join(cmd), file=sys.stderr)
    returncode = subprocess.run(cmd, check=False).returncode
    if returncode:
      sys.exit(returncode)
  if args.command == "create" and args.queued and not args.dry_run:
    print(
      "tpu.py: queued; the slice is ready when its state is ACTIVE:\n  "
      + _hint(args, "status", "--queued"),
      file=sys.stderr,
    )


if __name__ == "__main__":
  main()
