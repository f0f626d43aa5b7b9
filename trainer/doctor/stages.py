"""The doctor's stages (torch): each returns (status, detail); `run_stages` yields one result per
device and stage as it finishes, CUDA stages skipped by name where there is no CUDA device."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch

from trainer.doctor.plan import DoctorPlan, DrafterFacts
from trainer.doctor.report import StageResult, Status

Outcome = tuple[Status, str]
MIB = 1024**2
GIB = 1024**3


def _timed(device: str, stage: str, fn: Callable[[], Outcome]) -> StageResult:
    t0 = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as exc:  # a stage that raises is that stage's failure, the rest go on
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
        status, detail = "fail", f"{type(exc).__name__}: {first.strip()[:300]}"
    return StageResult(device, stage, status, detail, time.perf_counter() - t0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def alloc(name: str) -> Outcome:
    dev = torch.device(name)
    where = ""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "fail", (
                f"torch.cuda.is_available() is false (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda or 'none: a CPU build'}): `dflashctl doctor HOST` checks "
                "the device nodes, cgroup rules and driver versions"
            )
        count = torch.cuda.device_count()
        index = dev.index or 0
        if index >= count:
            return "fail", f"{name}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})"
        p = torch.cuda.get_device_properties(index)
        where = f"; {p.name}, sm_{p.major}{p.minor}, {p.total_memory / GIB:.1f} GiB"
    block = torch.empty(256 * MIB, dtype=torch.uint8, device=dev)
    block.fill_(1)
    n = 4096 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    (a @ b).float().sum().item()  # warm up (cuBLAS handle, kernels)
    reps = 10
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        c = a @ b
    _sync(dev)
    took = time.perf_counter() - t0
    if not torch.isfinite(c.float()).all():
        return "fail", "the bf16 matmul produced non-finite values"
    rate = 2 * n**3 * reps / took / 1e12
    return "ok", f"256 MiB allocated; bf16 matmul {n}x{n}: {rate:.2f} TFLOP/s{where}"


def attention(name: str, facts: DrafterFacts) -> Outcome:
    from trainer.model.attention import disable_flex
    from trainer.model.flex_probe import AttentionShape, probe

    dev = torch.device(name)
    shape = AttentionShape(facts.heads, facts.kv_heads, facts.head_dim, facts.block_size)
    what = (
        f"flex_attention forward+backward, {facts.heads} heads / {facts.kv_heads} KV heads, "
        f"head_dim {facts.head_dim}, block {facts.block_size}"
    )
    failure = probe(shape, dev, torch.bfloat16)
    if failure is not None:
        disable_flex(failure.line())
        return "warn", (
            f"{what}: {failure.line()}; the trainer falls back to SDPA (slower, more memory)"
        )
    return "ok", f"{what}: {_tiles(dev, facts)}"


def _tiles(dev: torch.device, facts: DrafterFacts) -> str:
    from trainer.kernels.devices import DeviceProps
    from trainer.kernels.flex_options import NoFittingTiles, choose

    props = DeviceProps.of(torch.cuda.get_device_properties(dev))
    try:
        limit = props.shared_memory_per_block_optin
        return choose(props.arch, limit, facts.head_dim, facts.head_dim, 2).describe()
    except NoFittingTiles as exc:
        return f"inductor's own tiles ({exc})"


def cross_entropy(name: str) -> Outcome:
    from trainer.kernels import lm_head_cross_entropy

    dev = torch.device(name)
    gen = torch.Generator().manual_seed(0)
    n, d, v = 512, 1024, 8192
    hidden0 = (torch.randn(n, d, generator=gen) * 0.5).to(dev, torch.bfloat16)
    weight = (torch.randn(v, d, generator=gen) * 0.05).to(dev, torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=gen).to(dev)
    losses, grads = {}, {}
    for backend in ("triton", "dense"):
        hidden = hidden0.clone().requires_grad_(True)
        out = lm_head_cross_entropy(hidden, weight, labels, backend=backend)
        torch.autograd.backward(out.loss.sum())
        losses[backend] = out.loss.detach().float()
        assert hidden.grad is not None
        grads[backend] = hidden.grad.float()
    _sync(dev)
    loss_err = float((losses["triton"] - losses["dense"]).abs().max())
    grad_err = float((grads["triton"] - grads["dense"]).abs().max())
    if not (loss_err < 5e-2 and grad_err < 5e-2):
        return "fail", f"Triton CE differs from dense: loss {loss_err:.3g}, grad {grad_err:.3g}"
    return "ok", f"Triton CE forward+backward at {n}x{d}, V {v}: max |diff| vs dense {loss_err:.2g}"


def drafter_step(name: str, facts: DrafterFacts) -> Outcome:
    """One forward+backward of a 1-layer drafter 128 wide at the config's attention shape."""
    from trainer.model.drafter import DFlashDrafter, DrafterConfig
    from trainer.model.split_step import bounded_objective_backward

    dev = torch.device(name)
    torch.manual_seed(0)
    hidden, vocab, rows, seq = 128, 512, 2, 8 * facts.block_size + 16
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=1,
        num_attention_heads=facts.heads,
        num_key_value_heads=facts.kv_heads,
        head_dim=facts.head_dim,
        vocab_size=vocab,
        block_size=facts.block_size,
        mask_token_id=vocab - 1,
        target_layer_ids=[0, 1],
        num_target_layers=4,
    )
    embed = torch.nn.Embedding(vocab, hidden).to(dev).requires_grad_(False)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dev).requires_grad_(False)
    drafter = DFlashDrafter(cfg, embed, head).to(dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (rows, seq), generator=gen).to(dev)
    mask = torch.ones(rows, seq, dtype=torch.long, device=dev)
    feats = torch.randn(rows, seq, 2 * hidden, generator=gen).to(dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None
    res = bounded_objective_backward(
        drafter,
        ids,
        mask,
        mask,
        feats,
        max_query_rows=None,
        num_anchors=min(facts.num_anchors, 8),
        generator=torch.Generator().manual_seed(1),
        autocast=autocast,
        attn_backend=facts.attention,
    )
    _sync(dev)
    loss = float(res.loss_sum) / max(float(res.weight_sum), 1.0)
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    if not math.isfinite(loss) or not grads or not all(torch.isfinite(g).all() for g in grads):
        return "fail", f"one drafter step gave loss {loss} or non-finite gradients"
    from trainer.model.attention import resolve_backend

    backend = resolve_backend(facts.attention, dev)
    return "ok", f"one drafter step (1 layer, width {hidden}, {backend}): loss {loss:.3f}"


def copy(src: str, dst: str) -> Outcome:
    s, d = torch.device(src), torch.device(dst)
    peer = torch.cuda.can_device_access_peer(d.index or 0, s.index or 0)
    data = torch.empty(256 * MIB // 2, dtype=torch.bfloat16, device=s).normal_()
    out = torch.empty_like(data, device=d)
    out.copy_(data)  # warm up
    _sync(d)
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        out.copy_(data, non_blocking=True)
    _sync(d)
    _sync(s)
    rate = reps * data.numel() * 2 / (time.perf_counter() - t0) / 1e9
    if not torch.equal(out.cpu(), data.cpu()):
        return "fail", "the copied features differ from the source"
    how = "peer-to-peer" if peer else "through the host (no peer access)"
    return "ok", f"target->drafter features, 256 MiB: {rate:.1f} GB/s {how}"


def nccl(devices: tuple[str, ...]) -> Outcome:
    from torch.cuda import nccl as cuda_nccl

    tensors = [torch.full((64 * MIB // 4,), float(i + 1), device=d) for i, d in enumerate(devices)]
    if not cuda_nccl.is_available(tensors):  # type: ignore[no-untyped-call]
        return "fail", "NCCL is not available for these tensors (torch built without NCCL?)"
    cuda_nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]  # warm up: communicators
    for i, t in enumerate(tensors):
        t.fill_(float(i + 1))
    for d in devices:
        _sync(torch.device(d))
    t0 = time.perf_counter()
    cuda_nccl.all_reduce(tensors)  # type: ignore[no-untyped-call]  # torch.cuda.nccl: unannotated
    for d in devices:
        _sync(torch.device(d))
    took = time.perf_counter() - t0
    want = sum(range(1, len(devices) + 1))
    if not all(bool((t == want).all()) for t in tensors):
        return "fail", f"all-reduce result is not {want} on every rank"
    n = len(devices)
    busbw = 2 * (n - 1) / n * tensors[0].numel() * 4 / took / 1e9
    return "ok", f"all-reduce of 64 MiB among {n} drafter ranks: {busbw:.1f} GB/s bus bandwidth"


def run_stages(plan: DoctorPlan) -> Iterator[StageResult]:
    """Every device's stages in order, then the cross-device ones."""
    usable: set[str] = set()
    for dev in plan.devices:
        res = _timed(dev, "alloc", lambda dev=dev: alloc(dev))  # type: ignore[misc]
        yield res
        if res.status != "fail":
            usable.add(dev)
        if dev not in plan.drafter_devices:
            continue
        cuda = dev.startswith("cuda")
        for stage in ("attention", "ce", "step"):
            if dev not in usable:
                yield StageResult(dev, stage, "skipped", f"{dev} alloc failed")
            elif not cuda and stage != "step":
                yield StageResult(dev, stage, "skipped", _CPU_SKIP[stage])
            elif stage == "attention" and plan.drafter.attention == "sdpa":
                yield StageResult(dev, stage, "skipped", "model.attention = sdpa: flex not used")
            else:
                yield _timed(dev, stage, _STAGE[stage](dev, plan.drafter))
    yield from _copies(plan, usable)
    drafters = plan.cuda_drafters
    if len(drafters) < 2:
        yield StageResult("-", "nccl", "skipped", "CUDA stage: fewer than two CUDA drafter ranks")
    elif not set(drafters) <= usable:
        yield StageResult("-", "nccl", "skipped", "a drafter device failed alloc")
    else:
        yield _timed(",".join(drafters), "nccl", lambda: nccl(drafters))


_CPU_SKIP = {
    "attention": "CUDA stage: flex_attention is compiled on CUDA only (the CPU trains with SDPA)",
    "ce": "CUDA stage: the Triton CE kernels run on CUDA only (the CPU uses the chunked path)",
}
_STAGE: dict[str, Callable[[str, DrafterFacts], Callable[[], Outcome]]] = {
    "attention": lambda dev, facts: lambda: attention(dev, facts),
    "ce": lambda dev, facts: lambda: cross_entropy(dev),
    "step": lambda dev, facts: lambda: drafter_step(dev, facts),
}


def _copies(plan: DoctorPlan, usable: set[str]) -> Iterator[StageResult]:
    pairs = [
        (t, d)
        for d in plan.cuda_drafters
        for t in plan.target_devices
        if t.startswith("cuda") and t != d
    ]
    if not pairs:
        yield StageResult(
            "-", "copy", "skipped", "CUDA stage: no target and drafter on different CUDA devices"
        )
    for t, d in pairs:
        if {t, d} <= usable:
            yield _timed(f"{t}->{d}", "copy", lambda t=t, d=d: copy(t, d))  # type: ignore[misc]
        else:
            yield StageResult(f"{t}->{d}", "copy", "skipped", "a device failed alloc")
