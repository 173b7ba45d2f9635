"""launch/: tpu.py's gcloud commands, multinode.sh's ssh commands, slurm.sbatch's srun.

Fake gcloud / ssh / srun / scontrol executables first on PATH record their argv
(one JSON list a line, named by FAKE_LOG). With FAKE_EXEC=1 they also run the
remote command locally under a sandbox HOME, whose checkout holds a fake venv
whose `python` records how md4jax.main was called: so the quoting of the
remote scripts, and setup's idempotence, are tested by running them.
"""

import importlib.util
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TPU = ROOT / "launch" / "tpu.py"
MULTINODE = ROOT / "launch" / "multinode.sh"
SLURM = ROOT / "launch" / "slurm.sbatch"

FAKE_TOOL = r"""#!{python}
import json, os, shutil, subprocess, sys
tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
  f.write(json.dumps([tool] + args) + "\n")
# Like sshd: the remote command runs in the user's home.
run_remote = lambda command: sys.exit(
    subprocess.run(["bash", "-c", command], cwd=os.environ["HOME"]).returncode)
if tool == "gcloud" and os.environ.get("FAKE_EXEC"):
  if "scp" in args:  # gcloud ... scp SRC NAME:DEST: DEST is relative to the worker's home.
    src, dest = args[args.index("scp") + 1:args.index("scp") + 3]
    shutil.copy(src, os.path.join(os.environ["HOME"], dest.split(":", 1)[1]))
  if "--command" in args:
    run_remote(args[args.index("--command") + 1])
elif tool == "ssh":
  if os.environ.get("FAKE_FAIL_HOST") in args:
    sys.exit(3)
  if os.environ.get("FAKE_EXEC"):
    run_remote(args[-1])
elif tool == "scontrol":  # scontrol show hostnames NODELIST
  print("\n".join(os.environ["FAKE_NODES"].split()))
elif tool == "srun":  # Runs the task command once per task, as srun would on each node.
  command = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
  codes = [subprocess.run(command, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID="0"))
           .returncode for i in range(int(os.environ["SLURM_NTASKS"]))]
  sys.exit(max(codes))
elif tool == "fakepy" and args[:2] == ["-m", "venv"]:  # Makes a fake venv.
  shutil.copytree(os.environ["FAKE_VENV"], args[2], symlinks=True, dirs_exist_ok=True)
  bin_dir = os.path.abspath(os.path.join(args[2], "bin"))
  with open(os.path.join(bin_dir, "activate"), "w") as f:
    f.write(f'export PATH="{{bin_dir}}:$PATH"\n')
"""

# The venv's python: records md4jax.main's arguments, prints like a trainer, may sleep.
FAKE_PYTHON = r"""#!{python}
import json, os, sys, time
if sys.argv[1:2] == ["-c"]:
  print("0.0.fake")
  sys.exit(0)
with open(os.environ["FAKE_PY_LOG"], "a") as f:
  f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(),
                      "local_device_ids": os.environ.get("JAX_LOCAL_DEVICE_IDS")}}) + "\n")
print("fake md4jax training", flush=True)
time.sleep(float(os.environ.get("FAKE_PY_SLEEP", "0")))
"""

FAKE_PIP = r"""#!{python}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
  f.write(json.dumps(["pip"] + sys.argv[1:]) + "\n")
"""


def _write_exe(path, text):
  path.write_text(text.format(python=f"{sys.executable} -S"))  # -S: no site-packages, fast.
  path.chmod(0o755)


def make_venv(checkout: pathlib.Path):
  """checkout/.venv with bin/activate putting the fake python and pip first on PATH."""
  bin_dir = checkout / ".venv" / "bin"
  bin_dir.mkdir(parents=True)
  _write_exe(bin_dir / "python", FAKE_PYTHON)
  _write_exe(bin_dir / "pip", FAKE_PIP)
  (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')


@pytest.fixture
def fake(tmp_path):
  """Fake tools on PATH and a sandbox HOME; .env for subprocesses, .calls() what they got."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("gcloud", "ssh", "srun", "scontrol", "fakepy"):
    _write_exe(bin_dir / tool, FAKE_TOOL)
  venv_template = tmp_path / "venv_template"
  make_venv(venv_template)
  home = tmp_path / "home"
  home.mkdir()

  class Fake:
    log, py_log = tmp_path / "calls.jsonl", tmp_path / "python.jsonl"
    env = dict(
      os.environ,
      PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
      HOME=str(home),
      TMPDIR=str(tmp_path),
      FAKE_LOG=str(tmp_path / "calls.jsonl"),
      FAKE_PY_LOG=str(tmp_path / "python.jsonl"),
      FAKE_VENV=str(venv_template / ".venv"),
    )

    def calls(self, tool=None):
      lines = self.log.read_text().splitlines() if self.log.exists() else []
      return [c for c in map(json.loads, lines) if tool is None or c[0] == tool]

    def trainer_calls(self):
      lines = self.py_log.read_text().splitlines() if self.py_log.exists() else []
      return [json.loads(line) for line in lines]

  fake_ = Fake()
  fake_.home, fake_.tmp = home, tmp_path
  return fake_


def tpu(fake, *args, script=TPU, cwd=ROOT, **env):
  # -S: without site-packages, which also shows tpu.py needs the standard library only.
  return subprocess.run(
    [sys.executable, "-S", str(script), *args],
    cwd=cwd,
    capture_output=True,
    text=True,
    env=dict(fake.env, **env),
    timeout=60,
  )


def lines(stdout):
  return [shlex.split(line) for line in stdout.splitlines()]


COMMON = ["--name=md4", "--zone=us-west4-a"]
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "md4"]
TRAINER = [
  "--config=configs/owt.py",
  "--workdir=/mnt/work/my owt",
  "--config.mesh.fsdp=16",
  "--config.mesh.data=1",
]

# tpu.py arguments -> the gcloud commands they run (those with a --command: their head).
CASES = {
  "create_spot": (
    ["create", *COMMON, "--accelerator-type=v5litepod-16", "--spot"],
    [
      [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "create",
        "md4",
        "--accelerator-type=v5litepod-16",
        "--version=v2-alpha-tpuv5-lite",
        "--spot",
        "--zone=us-west4-a",
      ]
    ],
  ),
  "create_queued": (
    ["create", *COMMON, "--accelerator-type=v4-32", "--queued", "--project=p1"],
    [
      [
        "gcloud",
        "compute",
        "tpus",
        "queued-resources",
        "create",
        "md4",
        "--node-id=md4",
        "--accelerator-type=v4-32",
        "--runtime-version=tpu-ubuntu2204-base",
        "--zone=us-west4-a",
        "--project=p1",
      ]
    ],
  ),
  "create_runtime": (
    ["create", *COMMON, "--accelerator-type=v5p-16", "--runtime-version=mine"],
    [
      [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "create",
        "md4",
        "--accelerator-type=v5p-16",
        "--version=mine",
        "--zone=us-west4-a",
      ]
    ],
  ),
  "status": (
    ["status", *COMMON],
    [["gcloud", "compute", "tpus", "tpu-vm", "describe", "md4", "--zone=us-west4-a"]],
  ),
  "setup": (
    ["setup", *COMMON, "--repo=https://example.com/md4jax.git", "--ref=main"],
    [[*SSH, "--worker=all", "--zone=us-west4-a", "--command"]],
  ),
  "run": (
    ["run", *COMMON, "--run-name=owt", "--", *TRAINER],
    [[*SSH, "--worker=all", "--zone=us-west4-a", "--command"]],
  ),
  "logs": (
    ["logs", *COMMON, "-n", "20"],
    [[*SSH, "--worker=0", "--zone=us-west4-a", "--command", "tail -n 20 ~/md4jax_logs/latest.log"]],
  ),
  "logs_follow": (
    ["logs", *COMMON, "--follow", "--worker=all", "--run-name=owt"],
    [
      [
        *SSH,
        "--worker=all",
        "--zone=us-west4-a",
        "--command",
        "tail -n 100 -f ~/md4jax_logs/owt.log",
      ]
    ],
  ),
  "ssh_command": (
    ["ssh", *COMMON, "--", "df", "-h"],
    [[*SSH, "--worker=all", "--zone=us-west4-a", "--command", "df -h"]],
  ),
  "delete": (
    ["delete", *COMMON],
    [["gcloud", "compute", "tpus", "tpu-vm", "delete", "md4", "--quiet", "--zone=us-west4-a"]],
  ),
  "delete_queued": (
    ["delete", *COMMON, "--queued"],
    [
      [
        "gcloud",
        "compute",
        "tpus",
        "queued-resources",
        "delete",
        "md4",
        "--force",
        "--quiet",
        "--zone=us-west4-a",
      ]
    ],
  ),
}


def _matches(commands, expected):
  return len(commands) == len(expected) and all(
    c[: len(e)] == e and (len(c) == len(e) or e[-1] == "--command" and len(c) == len(e) + 1)
    for c, e in zip(commands, expected)
  )


@pytest.mark.parametrize("case", CASES)
def test_tpu_dry_run_prints_the_commands_that_a_real_run_passes_to_gcloud(fake, case):
  args, expected = CASES[case]
  dry = (
    tpu(fake, *args, "--dry-run")
    if "--" not in args
    else tpu(fake, *args[: args.index("--")], "--dry-run", *args[args.index("--") :])
  )
  assert dry.returncode == 0, dry.stderr
  printed = lines(dry.stdout)
  assert _matches(printed, expected), printed
  assert not fake.calls()  # --dry-run never calls gcloud.
  real = tpu(fake, *args)
  assert real.returncode == 0, real.stderr
  assert fake.calls() == printed  # Exactly the printed argument lists, in order.


def test_tpu_default_runtimes():
  spec = importlib.util.spec_from_file_location("launch_tpu", TPU)
  tpu_lib = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tpu_lib)
  assert tpu_lib.default_runtime("v5litepod-16") == "v2-alpha-tpuv5-lite"
  assert tpu_lib.default_runtime("v5p-32") == "v2-alpha-tpuv5"
  assert tpu_lib.default_runtime("v6e-8") == "v2-alpha-tpuv6e"
  assert (
    tpu_lib.default_runtime("v4-32") == tpu_lib.default_runtime("v3-8") == "tpu-ubuntu2204-base"
  )
  assert tpu_lib.remote_path("~/a b") == "~/'a b'" and tpu_lib.remote_path("/x") == "/x"


def test_tpu_setup_command_is_idempotent_shell(fake):
  result = tpu(fake, *CASES["setup"][0], "--pip=datasets", "--dry-run")
  [command] = lines(result.stdout)
  script = command[-1]
  assert "[ -d ~/md4jax/.git ] || git clone -q https://example.com/md4jax.git ~/md4jax" in script
  assert "git fetch -q --tags origin" in script and "checkout -q --detach origin/main" in script
  assert "[ -x .venv/bin/python ] || " in script and "-m venv .venv" in script
  assert 'pip install -q -e . "jax[tpu]" datasets' in script
  assert "'" not in script  # So the dry-run line stays one plain '...' word.


def test_tpu_setup_runs_twice_clone_then_update(fake):
  """Runs setup's script for real (fake python/pip): clone + venv once, then fetch + checkout."""
  origin = fake.tmp / "origin"
  git = lambda *a, cwd=origin: subprocess.run(
    ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
    cwd=cwd,
    check=True,
    capture_output=True,
  )
  origin.mkdir()
  git("init", "-q", "-b", "main")
  (origin / "version.txt").write_text("one")
  git("add", ".")
  git("commit", "-qm", "one")
  setup = ["setup", *COMMON, f"--repo={origin}", "--ref=main", "--python=fakepy"]
  first = tpu(fake, *setup, FAKE_EXEC="1")
  assert first.returncode == 0, first.stderr
  checkout = fake.home / "md4jax"
  assert (checkout / "version.txt").read_text() == "one"
  assert "0.0.fake in" in first.stdout  # The closing check ran the venv's python.
  (origin / "version.txt").write_text("two")
  git("commit", "-qam", "two")
  second = tpu(fake, *setup, FAKE_EXEC="1")
  assert second.returncode == 0, second.stderr
  assert (checkout / "version.txt").read_text() == "two"  # Updated, not re-cloned.
  assert len(fake.calls("fakepy")) == 1  # The venv was made once.
  assert fake.calls("pip").count(["pip", "install", "-q", "-e", ".", "jax[tpu]"]) == 2


def _repo_with_tpu_py(fake):
  """A fresh git checkout holding a copy of launch/tpu.py (its ROOT, for --copy and defaults)."""
  repo = fake.tmp / "repo"
  (repo / "launch").mkdir(parents=True)
  shutil.copy(TPU, repo / "launch" / "tpu.py")
  (repo / ".gitignore").write_text(".venv/\n")
  (repo / "setup.py").write_text("# tracked\n")
  (repo / ".venv").mkdir()
  (repo / ".venv" / "big").write_text("ignored")
  run = lambda *a: subprocess.run(
    ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
    cwd=repo,
    check=True,
    capture_output=True,
    text=True,
  )
  run("init", "-q", "-b", "main")
  run("add", ".")
  run("commit", "-qm", "init")
  return repo, run


def test_tpu_setup_defaults_to_origin_and_head(fake):
  repo, git = _repo_with_tpu_py(fake)
  script = repo / "launch" / "tpu.py"
  missing = tpu(fake, "setup", *COMMON, "--dry-run", script=script)
  assert missing.returncode == 2 and "--repo" in missing.stderr and "--copy" in missing.stderr
  git("remote", "add", "origin", "https://example.com/me/md4jax.git")
  head = git("rev-parse", "HEAD").stdout.strip()
  result = tpu(fake, "setup", *COMMON, "--dry-run", script=script)
  assert result.returncode == 0, result.stderr
  script_text = lines(result.stdout)[0][-1]
  assert "git clone -q https://example.com/me/md4jax.git" in script_text
  assert f"git checkout -q --detach {head}" in script_text
  assert "on no remote branch" in result.stderr  # Never pushed: the workers could not fetch it.


def test_tpu_setup_copy_ships_the_working_tree_without_ignored_files(fake):
  repo, _ = _repo_with_tpu_py(fake)
  (repo / "untracked.py").write_text("# new, not ignored\n")
  result = tpu(
    fake,
    "setup",
    *COMMON,
    "--copy",
    "--python=fakepy",
    script=repo / "launch" / "tpu.py",
    FAKE_EXEC="1",
  )
  assert result.returncode == 0, result.stderr
  scp, ssh = fake.calls("gcloud")
  tarball = fake.tmp / "md4jax-src-md4.tar.gz"
  assert scp == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "scp",
    str(tarball),
    "md4:md4jax-src.tar.gz",
    "--worker=all",
    "--zone=us-west4-a",
  ]
  with tarfile.open(tarball) as tar:
    assert sorted(tar.getnames()) == [".gitignore", "launch/tpu.py", "setup.py", "untracked.py"]
  assert ssh[: len(SSH) + 2] == [*SSH, "--worker=all", "--zone=us-west4-a"]
  assert (fake.home / "md4jax" / "untracked.py").exists()  # Unpacked on the "worker".
  assert not (fake.home / "md4jax" / ".venv" / "big").exists()
  assert ["pip", "install", "-q", "-e", ".", "jax[tpu]"] in fake.calls("pip")


def _wait_for(predicate, seconds=10.0):
  deadline = time.time() + seconds
  while not predicate():
    assert time.time() < deadline, "timed out"
    time.sleep(0.05)


def test_tpu_run_starts_the_trainer_in_the_background_and_stop_ends_it(fake):
  checkout = fake.home / "md4jax"
  make_venv(checkout)
  run = ["run", *COMMON, "--run-name=owt", "--", *TRAINER]
  started = tpu(fake, *run, FAKE_EXEC="1", FAKE_PY_SLEEP="30")
  pid_file = fake.home / "md4jax_logs" / "latest.pid"
  try:
    assert started.returncode == 0, started.stderr
    assert "started pid" in started.stdout
    assert "logs --name=md4 --zone=us-west4-a --follow" in started.stderr  # How to tail.
    _wait_for(lambda: fake.trainer_calls())
    [call] = fake.trainer_calls()
    assert call["argv"] == ["-m", "md4jax.main", *TRAINER]  # Spaces survive the quoting.
    assert call["cwd"] == str(checkout)
    logs = fake.home / "md4jax_logs"
    assert os.readlink(logs / "latest.log") == "owt.log"
    _wait_for(lambda: "fake md4jax training" in (logs / "owt.log").read_text())
    again = tpu(fake, *run, FAKE_EXEC="1")  # A TPU takes one process: refused while running.
    assert again.returncode == 1 and "still going" in again.stderr
    stopped = tpu(fake, "stop", *COMMON, FAKE_EXEC="1")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    pid = int(pid_file.read_text())
    _wait_for(lambda: _gone(pid))
  finally:
    if pid_file.exists() and not _gone(int(pid_file.read_text())):
      os.kill(int(pid_file.read_text()), 9)


def _gone(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  # A zombie (exited, not yet reaped by init) counts as gone.
  stat = pathlib.Path(f"/proc/{pid}/stat")
  return stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize(
  "args,message",
  [
    (["create", "--name=md4", "--zone=z"], "--accelerator-type"),
    (["create", "--zone=z", "--accelerator-type=v4-8"], "--name"),
    (["logs", "--name=md4"], "--zone"),
    (["run", *COMMON], "after --"),
    (["delete", *COMMON, "--", "x"], "no arguments after --"),
    (["launch", *COMMON], "invalid choice"),
    ([], "COMMAND"),
  ],
)
def test_tpu_usage_errors(fake, args, message):
  result = tpu(fake, *args)
  assert result.returncode == 2 and message in result.stderr, result.stderr
  assert not fake.calls()


def test_tpu_gcloud_failure_is_the_exit_status(fake):
  fake.tmp.joinpath("bin", "gcloud").write_text("#!/bin/sh\nexit 7\n")
  assert tpu(fake, *CASES["delete"][0]).returncode == 7


def multinode(fake, *args, **env):
  return subprocess.run(
    ["bash", str(MULTINODE), *args],
    cwd=fake.tmp,
    capture_output=True,
    text=True,
    env=dict(fake.env, **env),
    timeout=60,
  )


def _remote(ssh_argv):
  assert ssh_argv[:3] == ["ssh", "-o", "BatchMode=yes"]
  return ssh_argv[3], shlex.split(ssh_argv[4])


def test_multinode_dry_run_prints_one_ssh_per_host(fake):
  hosts = fake.tmp / "hosts.txt"
  hosts.write_text("# the coordinator first\nalice@gpu-a  # process 0\n\ngpu-b\ngpu-c\n")
  result = multinode(fake, "--dry-run", str(hosts), "--", *TRAINER, PORT="23456")
  assert result.returncode == 0, result.stderr
  printed = lines(result.stdout)
  assert [p[3] for p in printed] == ["alice@gpu-a", "gpu-b", "gpu-c"]
  for i, ssh in enumerate(printed):
    _, remote = _remote(ssh)
    assert remote[:6] == ["cd", "md4jax", "&&", ".", ".venv/bin/activate", "&&"]
    assert remote[6:9] == ["exec", "python", "-m"] and remote[9] == "md4jax.main"
    assert remote[10:] == [
      *TRAINER,
      "--coordinator_address=gpu-a:23456",
      "--num_processes=3",
      f"--process_id={i}",
    ]
  assert not fake.calls()
  env_form = multinode(fake, "--", "--config=c.py", HOSTS="h1 h2", DRY_RUN="1")
  assert [_remote(p)[1][-3:] for p in lines(env_form.stdout)] == [
    ["--coordinator_address=h1:12355", "--num_processes=2", f"--process_id={i}"] for i in (0, 1)
  ]


def test_multinode_runs_every_host_and_logs_each(fake):
  make_venv(fake.home / "md4jax")
  log_dir = fake.tmp / "logs"
  result = multinode(fake, "--", *TRAINER, HOSTS="gpu-a gpu-b", LOG_DIR=str(log_dir), FAKE_EXEC="1")
  assert result.returncode == 0, result.stderr
  assert sorted(c[3] for c in fake.calls("ssh")) == ["gpu-a", "gpu-b"]
  calls = sorted(fake.trainer_calls(), key=lambda c: c["argv"][-1])
  assert [c["argv"] for c in calls] == [
    [
      "-m",
      "md4jax.main",
      *TRAINER,
      "--coordinator_address=gpu-a:12355",
      "--num_processes=2",
      f"--process_id={i}",
    ]
    for i in (0, 1)
  ]
  for i, host in enumerate(["gpu-a", "gpu-b"]):
    assert "fake md4jax training" in (log_dir / f"process-{i}-{host}.log").read_text()


def test_multinode_fails_when_a_host_fails(fake):
  result = multinode(
    fake,
    "--",
    "--config=c.py",
    HOSTS="gpu-a gpu-b",
    FAKE_FAIL_HOST="gpu-b",
    LOG_DIR=str(fake.tmp / "logs"),
  )
  assert result.returncode == 1 and "process 1 on gpu-b failed" in result.stderr
  assert len(fake.calls("ssh")) == 2


@pytest.mark.parametrize(
  "args,env",
  [
    ([], {"HOSTS": "h1"}),
    (["--", "--x=1"], {}),
    (["no-such-file", "--", "--x=1"], {}),
    (["--config=c.py"], {"HOSTS": "h1"}),
  ],
)
def test_multinode_usage_errors(fake, args, env):
  result = multinode(fake, *args, **env)
  assert result.returncode == 2 and "multinode.sh:" in result.stderr
  assert not fake.calls()


def test_slurm_gives_every_task_its_process_id_and_all_its_gpus(fake):
  checkout = fake.tmp / "checkout"
  make_venv(checkout)
  env = {
    "SLURM_JOB_NODELIST": "node[07-08]",
    "FAKE_NODES": "node07 node08",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_ID": "1234",
    "MD4JAX_DIR": str(checkout),
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
  }
  result = subprocess.run(
    ["bash", str(SLURM), *TRAINER],
    capture_output=True,
    text=True,
    env=dict(fake.env, **env),
    timeout=60,
  )
  assert result.returncode == 0, result.stderr
  assert fake.calls("scontrol") == [["scontrol", "show", "hostnames", "node[07-08]"]]
  calls = sorted(fake.trainer_calls(), key=lambda c: c["argv"][-1])
  assert [c["argv"] for c in calls] == [
    [
      "-m",
      "md4jax.main",
      *TRAINER,
      "--coordinator_address=node07:21234",
      "--num_processes=2",
      f"--process_id={i}",
    ]
    for i in (0, 1)
  ]
  assert {c["cwd"] for c in calls} == {str(checkout)}
  assert {c["local_device_ids"] for c in calls} == {"0,1,2,3"}
  without_flags = subprocess.run(
    ["bash", str(SLURM)], capture_output=True, text=True, env=dict(fake.env, **env), timeout=60
  )
  assert without_flags.returncode == 2 and "--config" in without_flags.stderr
