"""What a CUDA device offers a kernel: the fields of `torch.cuda.get_device_properties` we use.

Torch-free, so the kernel-option choice and its tests run from captured values (tests/kernels/
fixtures/device_properties.json, each with its source) on a machine without a GPU.

`SHARED_MEMORY_OPTIN` is the most shared memory one block may opt into, per compute capability
(CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 163 KB on 8.0,
99 KB on 8.6, 8.9 and 12.0, 227 KB on 9.0 and 10.0; the same numbers as XLA's captured device
specs, openxla/xla xla/backends/gpu/target_config/specs/*.txtpb). A live device's own
`shared_memory_per_block_optin` always wins; the table serves `compile_check` and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARED_MEMORY_OPTIN: dict[int, int] = {
    80: 166_912,  # A100
    86: 101_376,  # RTX A6000, RTX 30xx
    89: 101_376,  # L40S, RTX 6000 Ada, RTX 40xx
    90: 232_448,  # H100, H200
    100: 232_448,  # B200
    120: 101_376,  # RTX PRO 6000 Blackwell, RTX 50xx
}


@dataclass(frozen=True)
class DeviceProps:
    name: str
    major: int
    minor: int
    total_memory: int  # bytes
    multi_processor_count: int
    shared_memory_per_block_optin: int  # bytes one block may use

    @property
    def arch(self) -> int:
        """Compute capability x10 (Triton's and nvcc's sm_NN): 9.0 -> 90, 12.0 -> 120."""
        return self.major * 10 + self.minor

    @classmethod
    def of(cls, props: object) -> DeviceProps:
        """From `torch.cuda.get_device_properties(i)` (or anything with its attributes; torch's
        stubs lack `shared_memory_per_block_optin`, hence the getattr)."""
        return cls(**{f: getattr(props, f) for f in FIELDS})


FIELDS = tuple(DeviceProps.__dataclass_fields__)


def shared_limit(arch: int) -> int:
    """`SHARED_MEMORY_OPTIN[arch]`, or a ValueError naming the architectures it knows."""
    try:
        return SHARED_MEMORY_OPTIN[arch]
    except KeyError:
        known = ", ".join(f"sm_{a}" for a in sorted(SHARED_MEMORY_OPTIN))
        raise ValueError(
            f"no shared-memory limit recorded for sm_{arch} (known: {known})"
        ) from None
