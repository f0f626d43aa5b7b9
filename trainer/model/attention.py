"""Attention backends for the drafter: SDPA with a boolean mask, flex_attention with a BlockMask.

SDPA runs everywhere (CPU tests, any GPU). flex_attention is the CUDA training path: the
DFlash mask is block-sparse (each block sees a context prefix plus itself), which flex skips
tile by tile, and its BlockMask (built analytically from the anchors, trainer.model.masks)
never materialises a [Q, KV] mask. On CPU flex runs an unfused reference implementation:
correct (the tests compare it with SDPA) but slow. On CUDA a dense mask never meets SDPA's
enable_gqa (see `attend`).

On CUDA the flex kernels get `kernel_options` fitted to the device's shared memory
(`trainer.kernels.flex_options`). If flex still fails to compile (the first step's probe,
`trainer.model.flex_probe`), `disable_flex` turns every later "auto" or "flex" into SDPA for the
process, so the run goes on instead of crash-looping.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.model.key_widths import KEY_MULTIPLE
from trainer.model.masks import dense_dflash_mask, flex_dflash_block_mask

AttnBackend = Literal["auto", "sdpa", "flex"]
# A dense bool mask, a flex BlockMask, or None (no mask: inference, block sees all context).
AttnMask = object

# Why flex is off for this process (None: it is not): set once by `disable_flex`.
_flex_disabled: list[str] = []


def disable_flex(reason: str) -> None:
    """From now on "auto" and "flex" resolve to SDPA (flex did not compile on this device)."""
    if not _flex_disabled:
        _flex_disabled.append(reason)


def flex_disabled() -> str | None:
    return _flex_disabled[0] if _flex_disabled else None


def resolve_backend(backend: str, device: torch.device) -> Literal["sdpa", "flex"]:
    """ "auto" = flex on CUDA when this torch has it, SDPA otherwise; SDPA once flex is
    disabled (`disable_flex`)."""
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"attention backend must be auto, sdpa or flex, got {backend!r}")
    if backend != "sdpa" and _flex_disabled:
        return "sdpa"
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_available() else "sdpa"
    if backend == "flex" and not flex_available():
        raise ValueError("attention backend 'flex' needs torch.nn.attention.flex_attention")
    return backend  # type: ignore[return-value]


@functools.cache
def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def build_mask(
    anchors: Tensor,
    context_valid: Tensor,
    block_size: int,
    backend: str,
    context_start: Tensor | None = None,
) -> AttnMask:
    """The DFlash training mask in the representation `backend` consumes.

    `context_start` [R, N] int64 (None = 0): the first context position block n of row r may
    see; packed rows pass the start of each anchor's document (see trainer.model.masks).
    """
    chosen = resolve_backend(backend, anchors.device)
    if chosen == "flex":
        return flex_dflash_block_mask(anchors, context_valid, block_size, context_start)
    return pad_keys(dense_dflash_mask(anchors, context_valid, block_size, context_start))


def pad_keys(mask: Tensor, multiple: int = KEY_MULTIPLE) -> Tensor:
    """`mask` [..., KV] with False columns appended up to a multiple of `multiple` keys."""
    extra = -mask.shape[-1] % multiple
    return F.pad(mask, (0, extra), value=False) if extra else mask


def mask_keys(mask: AttnMask) -> int | None:
    """Keys a dense mask expects (None: no mask or a flex BlockMask, which pads nothing)."""
    return mask.shape[-1] if isinstance(mask, Tensor) else None


def flex_kernel_options(q: Tensor, v: Tensor) -> dict[str, int] | None:
    """Tiles that fit q's device (CUDA, not ROCm); None elsewhere or when none fits (inductor
    then picks; the first step's probe catches a failure)."""
    if q.device.type != "cuda" or torch.version.hip is not None:
        return None
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    chosen = _cuda_flex_options(index, q.shape[-1], v.shape[-1], q.element_size())
    return dict(chosen) if chosen is not None else None


@functools.cache
def _cuda_flex_options(index: int, qk_dim: int, v_dim: int, nbytes: int) -> dict[str, int] | None:
    try:
        from trainer.kernels.devices import DeviceProps
        from trainer.kernels.flex_options import NoFittingTiles, choose
    except ImportError:  # an export's dflash.py runs without the trainer: inductor picks
        return None
    props = DeviceProps.of(torch.cuda.get_device_properties(index))
    try:
        chosen = choose(props.arch, props.shared_memory_per_block_optin, qk_dim, v_dim, nbytes)
    except NoFittingTiles:
        return None
    return chosen.kernel_options()


@functools.cache
def _flex_fn(device_type: str) -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    flex: Callable[..., Tensor] = flex_attention  # without return_lse it returns one Tensor
    # Compiled on CUDA (the fused kernel); eager elsewhere (reference path, tests only).
    return torch.compile(flex, dynamic=True) if device_type == "cuda" else flex


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttnMask,
    scale: float,
    device_type: str | None = None,
) -> Tensor:
    """Attention of q [B, Hq, Q, D] over k, v [B, Hkv, KV, D] (GQA by head groups).

    `device_type` is the device the kernel choice is made for (None = q's; tests pass "cuda"
    on CPU to run the CUDA path). On CUDA, SDPA with both a mask and `enable_gqa` has no fused
    kernel and falls to the math one, which materialises fp32 scores per head; there K/V are
    repeated to the query heads instead (query head h reads KV head h // (Hq / Hkv), as
    enable_gqa does), so the memory-efficient kernel takes the mask.
    """
    gqa = q.shape[1] != k.shape[1]
    if mask is None or isinstance(mask, Tensor):
        kind = q.device.type if device_type is None else device_type
        if gqa and mask is not None and kind == "cuda":
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():
        # Eager flex on CPU warns that it is unfused; that path exists for tests only.
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        return _flex_fn(q.device.type)(
            q,
            k,
            v,
            block_mask=mask,
            scale=scale,
            enable_gqa=gqa,
            kernel_options=flex_kernel_options(q, v),
        )
