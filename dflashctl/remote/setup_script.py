"""The script `dflashctl setup` runs in the container (stdlib only, under the container's base
python), and the argv builders around it. Pure: no I/O here.

    python setup_env.py WORKDIR SPEC_DIR WHEELHOUSE|-

SPEC_DIR holds what setup pushed: the checkout's `requirements.lock`, `tools/torch_build.py`
(the one rule for the torch build: imported here, so the container decides CPU or CUDA from its
own `nvidia-smi` exactly as the Makefile does) and `requirements.txt` (the trainer's `train`
extra). The env's key hashes those files, the build and the driver version: WORKDIR/env links
to WORKDIR/envs/<key>, so the same lock on the same driver is a no-op. A new env is built in a
directory of its own and switched in with one rename of the link: a failure leaves the previous
env in place (the one before it is kept too, older ones are removed). Progress lines start with `setup: `; the last line is `setup-result: ...`.
"""

from __future__ import annotations

from dflashctl.remote.layout import RemoteLayout

SETUP_ENV = r"""
import hashlib, json, os, shutil, subprocess, sys, time

workdir, spec, wheels = sys.argv[1], sys.argv[2], sys.argv[3]


def say(msg):
    print(f"setup: {msg}", flush=True)


def result(kind, key, code):
    print(f"setup-result: {kind} {key}", flush=True)
    sys.exit(code)


sys.path.insert(0, spec)
import torch_build as tb  # noqa: E402  (the checkout's tools/torch_build.py, pushed)

with open(os.path.join(spec, "requirements.lock"), encoding="utf-8") as fh:
    lock = fh.read()
with open(os.path.join(spec, "torch_build.py"), encoding="utf-8") as fh:
    rule = fh.read()
with open(os.path.join(spec, "requirements.txt"), encoding="utf-8") as fh:
    reqs = [ln.strip() for ln in fh if ln.strip()]
drv = tb.driver()
build = "cuda" if drv is not None else "cpu"
h = hashlib.sha256()
for part in (lock, rule, "\n".join(reqs), build, drv.version if drv else "no-gpu"):
    h.update(part.encode() + b"\0")
key = h.hexdigest()[:12]
lock_sha = hashlib.sha256(lock.encode()).hexdigest()[:12]
envs = os.path.join(workdir, "envs")
link = os.path.join(workdir, "env")
os.makedirs(envs, exist_ok=True)
what = f"torch {tb.TORCH_VERSION} {build} build" + (
    f" for driver {drv.version} (CUDA {drv.cuda[0]}.{drv.cuda[1]})" if drv else " (no GPU listed)"
)
current = os.path.basename(os.readlink(link)) if os.path.islink(link) else None
if current == key and os.path.isfile(os.path.join(envs, key, ".complete")):
    say(f"up to date: env {key} ({what}) is already built from this lock")
    result("unchanged", key, 0)

# Built where it will live (venvs hold absolute paths): the link still names the previous env,
# so a failure anywhere leaves that one in use.
tmp = os.path.join(envs, key)
shutil.rmtree(tmp, ignore_errors=True)
t0 = time.monotonic()
try:
    say(f"building env {key}: {what}, {len(reqs)} requirements from requirements.lock {lock_sha}")
    subprocess.run([sys.executable, "-m", "venv", tmp], check=True, capture_output=True, text=True)
    py = os.path.join(tmp, "bin", "python")
    constraints = os.path.join(tmp, "constraints.txt")
    with open(constraints, "w", encoding="utf-8") as fh:
        fh.write(tb.constraints(lock, build))
    argv = [py, "-m", "pip", "install", "--isolated", "--progress-bar", "off",
            "--disable-pip-version-check", "-c", constraints, tb.requirement(build), *reqs]
    if wheels != "-":
        argv += ["--no-index", "--find-links", wheels]
        say(f"installing from the wheelhouse {wheels} (no package index)")
    elif build == "cpu":
        argv += ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    why = []  # pip's own account of a failure: its ERROR lines and what was requested
    for line in proc.stdout:
        line = line.rstrip()
        if line.startswith(("Collecting ", "Processing ", "Installing collected", "Successfully")):
            say(line if len(line) < 200 else line[:197] + "...")
        elif line.startswith("ERROR: ") or "requested" in line or "conflict is caused" in line:
            why.append(line.strip())
    if proc.wait() != 0:
        raise RuntimeError("pip install failed: " + " | ".join(why[:6])[:600])
    probe = ("import json, numpy, pydantic, torch, transformers; "
             "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda}))")
    got = subprocess.run([py, "-c", probe], capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError("the new env does not import the trainer's modules: "
                           + (got.stderr.strip().splitlines() or ["?"])[-1])
    info = json.loads(got.stdout.strip().splitlines()[-1])
    if build == "cuda":
        chk = subprocess.run([py, os.path.join(spec, "torch_build.py"), "check"],
                             capture_output=True, text=True)
        if chk.returncode != 0:
            raise RuntimeError((chk.stderr.strip().splitlines() or ["torch_build check"])[-1])
    with open(os.path.join(tmp, ".complete"), "w", encoding="utf-8") as fh:
        json.dump({"key": key, "build": build, "driver": drv.version if drv else None,
                   "lock": lock_sha, "torch": info["torch"], "torch_cuda": info["cuda"],
                   "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, fh)
except Exception as exc:
    shutil.rmtree(tmp, ignore_errors=True)
    kept = f"the previous env ({current}) is kept" if current else "no env was there before"
    say(f"failed: {str(exc).strip()[:600]}; {kept}")
    result("failed", key, 1)

new_link = os.path.join(workdir, f".env.tmp.{os.getpid()}")
os.symlink(os.path.join("envs", key), new_link)
os.replace(new_link, link)
for old in os.listdir(envs):
    if old not in (key, current) and not old.startswith(".spec-"):
        shutil.rmtree(os.path.join(envs, old), ignore_errors=True)
say(f"env {key} ready in {time.monotonic() - t0:.0f} s: torch {info['torch']}; python: "
    f"{os.path.join(link, 'bin', 'python')}" + (f" (replaced {current}, kept)" if current else ""))
result("built", key, 0)
"""


def spec_dir(workdir: str, digest: str) -> str:
    return RemoteLayout(workdir).path(f"envs/.spec-{digest}")


def unpack_argv(dest: str) -> list[str]:
    """Untar stdin into `dest` (made first)."""
    return ["sh", "-c", 'mkdir -p "$1" && tar -x -C "$1"', "setup-unpack", dest]


def setup_argv(base_python: str, workdir: str, spec: str, wheelhouse: str | None) -> list[str]:
    return [base_python, f"{spec}/setup_env.py", workdir, spec, wheelhouse or "-"]


def wheel_list_argv(dest: str) -> list[str]:
    """`SIZE NAME` of each wheel already in `dest` (made if missing)."""
    script = (
        'mkdir -p "$1" && cd "$1" && for f in *.whl; do [ -f "$f" ] && '
        'echo "$(stat -c %s "$f") $f"; done; exit 0'
    )
    return ["sh", "-c", script, "setup-wheels", dest]


def wheel_unpack_argv(dest: str) -> list[str]:
    """Untar stdin into `dest`/.incoming, then move each wheel in by rename (whole files only)."""
    script = (
        'mkdir -p "$1/.incoming" && tar -x -C "$1/.incoming" && '
        'for f in "$1"/.incoming/*.whl; do [ -f "$f" ] && mv -f "$f" "$1/"; done; '
        'rmdir "$1/.incoming"'
    )
    return ["sh", "-c", script, "setup-wheels", dest]


def env_info_argv(workdir: str) -> list[str]:
    """The current env's .complete record (empty: no env set up)."""
    return ["sh", "-c", 'cat "$1/env/.complete" 2>/dev/null; exit 0', "setup-env", workdir]
