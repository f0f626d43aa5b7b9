"""The python probes deploy runs in the container, as source text sent to its python (stdlib
only): the preflight facts and the release's memory estimate. Each prints one JSON object;
judging it is dflashctl.releases.preflight's. Pure builders: no I/O here.

The probes take the workdir as an argument and find the layout's paths under it: the script
texts are rendered once from dflashctl.remote.layout's names (releases/<id>/.complete, current,
run/, run/checkpoints/step-*.pt, the release's trainer/memory), so no name is spelled twice.
"""

from __future__ import annotations

import json
import posixpath
from string import Template

from dflashctl.remote import layout as L


def py_names(rel: str, under: str = "") -> str:
    """A layout name as os.path.join arguments: `run/checkpoints` under `run` -> `"checkpoints"`."""
    inner = posixpath.relpath(rel, under) if under else rel
    return ", ".join(json.dumps(part) for part in inner.split("/"))


def _render(template: str) -> str:
    """Fill a script's `$name` slots with the layout's names (os.path.join arguments)."""
    return Template(template).substitute(
        releases=py_names(L.RELEASES),
        release_complete=py_names(L.RELEASE_COMPLETE),
        current=py_names(L.CURRENT),
        run_dir=py_names(L.RUN_DIR),
        memory_source=py_names(L.MEMORY_SOURCE),
        memory_config=py_names(L.MEMORY_CHECK_CONFIG, under=L.RUN_DIR),
        checkpoint_files=py_names(f"{L.CHECKPOINTS}/{L.CHECKPOINT_FILES}", under=L.RUN_DIR),
        checkpoints=py_names(L.CHECKPOINTS, under=L.RUN_DIR),
    )


# argv: WORKDIR RELEASE_ID MODE. Prints one JSON object. Never raises for a missing module.
# MODE "import" really imports the modules (catches broken CUDA/ABI installs; torch takes
# seconds); "metadata" only reads installed versions (fast; for repeated deploys in tests).
PROBE_SCRIPT = _render(r"""
import importlib, importlib.metadata, json, os, shutil, subprocess, sys
workdir, release, mode = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"python": sys.version.split()[0], "modules": {}, "errors": {}}
for name in ("numpy", "pydantic", "torch"):
    try:
        if mode == "import":
            mod = importlib.import_module(name)
            out["modules"][name] = getattr(mod, "__version__", "?")
        else:
            out["modules"][name] = importlib.metadata.version(name)
    except Exception as exc:
        out["errors"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
os.makedirs(workdir, exist_ok=True)
st = os.statvfs(workdir)
out["free_bytes"] = st.f_bavail * st.f_frsize
out["complete"] = os.path.isfile(os.path.join(workdir, $releases, release, $release_complete))
cur = os.path.join(workdir, $current)
out["current"] = os.path.basename(os.readlink(cur)) if os.path.islink(cur) else None
smi = shutil.which("nvidia-smi")
out["nvidia_smi"] = bool(smi)
out["gpus"] = []
if smi:
    try:
        res = subprocess.run([smi, "--query-gpu=index,name,memory.total",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if res.returncode == 0:
            out["gpus"] = [l.strip() for l in res.stdout.splitlines() if l.strip()]
        else:
            out["smi_error"] = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["failed"]
    except Exception as exc:
        out["smi_error"] = [str(exc)]
    if "torch" in out["modules"] and mode == "import":
        import torch
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["torch_cuda"] = torch.version.cuda
print(json.dumps(out))
""")


def probe_argv(python: str, workdir: str, release: str, *, import_check: bool = True) -> list[str]:
    """The preflight probe: importing the modules (`import_check`) or reading their metadata."""
    mode = "import" if import_check else "metadata"
    return [python, "-c", PROBE_SCRIPT, workdir, release, mode]


# argv: WORKDIR RELEASE_ID DEVICE_MEMORY ("-": the estimator's default). The run config comes on
# stdin and is written next to run/config.toml (its relative paths resolve the same), removed
# after. Runs the release's `python -m trainer.memory --json` and prints one JSON object: the
# estimator's exit status, its report, its last stderr line, free bytes of the run dir and the
# bytes of the checkpoints already there (retention replaces them).
MEMORY_SCRIPT = _render(r"""
import glob, json, os, subprocess, sys
workdir, release, device = sys.argv[1], sys.argv[2], sys.argv[3]
rel = os.path.join(workdir, $releases, release)
run = os.path.join(workdir, $run_dir)
os.makedirs(run, exist_ok=True)
out = {"tmp": None}
if not os.path.isfile(os.path.join(rel, $memory_source)):
    out["absent"] = True
else:
    tmp = os.path.join(run, $memory_config % os.getpid())
    out["tmp"] = tmp
    with open(tmp, "wb") as fh:
        fh.write(sys.stdin.buffer.read())
    argv = [sys.executable, "-m", "trainer.memory", "--config", tmp, "--json"]
    if device != "-":
        argv += ["--device-memory", device]
    env = dict(os.environ, PYTHONPATH=rel)
    try:
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=workdir,
                             timeout=240)
        out["rc"] = res.returncode
        try:
            out["report"] = json.loads(res.stdout)
        except ValueError:
            out["report"] = None
        err = [l for l in res.stderr.splitlines() if l.strip()]
        out["error"] = err[-1][:300] if err else ""
    except subprocess.TimeoutExpired:
        out["rc"], out["report"], out["error"] = 124, None, "timed out after 240 s"
    finally:
        os.unlink(tmp)
ckpts = os.path.join(run, $checkpoints)  # often a volume of its own: measure where they go
st = os.statvfs(ckpts if os.path.isdir(ckpts) else run)
out["free_bytes"] = st.f_bavail * st.f_frsize
out["free_at"] = ckpts if os.path.isdir(ckpts) else run
out["existing_bytes"] = sum(
    os.path.getsize(p) for p in glob.glob(os.path.join(run, $checkpoint_files))
    if os.path.isfile(p) and not os.path.islink(p)
)
print(json.dumps(out))
""")


def memory_argv(
    python: str, workdir: str, release: str, device_memory_mib: int | None
) -> list[str]:
    """The memory probe (the run config on stdin); `device_memory_mib` None: the estimator's
    default device size."""
    device = f"{device_memory_mib}MiB" if device_memory_mib else "-"
    return [python, "-c", MEMORY_SCRIPT, workdir, release, device]
