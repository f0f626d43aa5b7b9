"""`python -m trainer --config C --run-dir R [--resume auto|never] [--fresh]` (stand-in)."""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--run-dir", required=True)
p.add_argument("--resume", default="auto")
p.add_argument("--fresh", action="store_true")
a = p.parse_args()
with open(a.config, "rb") as cfg_file:
    cfg = cfg_file.read()
if b"crash" in cfg:
    print("ERROR: config asked for a crash", flush=True)
    sys.exit(3)
os.makedirs(os.path.join(a.run_dir, "checkpoints"), exist_ok=True)
ckdir = os.path.join(a.run_dir, "checkpoints")
if a.fresh and os.listdir(ckdir):
    os.rename(ckdir, os.path.join(a.run_dir, f"checkpoints.old-{int(time.time() * 1000)}"))
    os.makedirs(ckdir)
done = sorted(os.listdir(ckdir))
step = int(done[-1][5:13]) if done and a.resume == "auto" else 0
state = {
    "pid": os.getpid(),
    "config_hash": hashlib.sha256(cfg).hexdigest()[:12],
    "release": os.environ.get("DFLASH_RELEASE"),
    "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # as the trainer writes it
    "last_step": step,
}
with open(os.path.join(a.run_dir, "run-state.json"), "w") as state_file:
    json.dump(state, state_file)
log = open(os.path.join(a.run_dir, "status.log"), "a", buffering=1)  # noqa: SIM115


def emit(line: str) -> None:
    print(line, flush=True)
    log.write(line + "\n")


stop = False


def on_int(signum: int, frame: object) -> None:
    global stop
    stop = True


signal.signal(signal.SIGINT, on_int)
emit("Starting pipeline...")
emit("Pipeline running. Monitoring...")
t0 = time.time()
period = float(os.environ.get("STANDIN_PERIOD", "0.2"))
while not stop:
    step += 1
    emit(
        f"[{int((time.time() - t0) // 60)}m] step={step} loss={2.0 / step:.4f} acc=0.500 "
        f"streak=1.0 lr=6.00e-04 noise=0.1000 | tgt=1.00b/s dft=1.00b/s (2.0Ktok/s) "
        f"| q_pre=[1, 2, 3] q_hs=[1] | epoch~0.01 ETA=17m"
    )
    time.sleep(period)
path = os.path.join(ckdir, f"step-{step:08d}.pt")
with open(path, "w") as ck:
    ck.write("ckpt")
emit(f"Checkpoint saved: step={step} path={path}")
