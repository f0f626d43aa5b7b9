"""One host's GPUs read through its transport: utilisation samples and health (nvidia-smi)."""

from __future__ import annotations

from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.gpus.nvidia_smi import (
    LEGACY_REASONS_PREFIX,
    REASONS_PREFIX,
    GpuHealth,
    GpuSample,
    health_fields,
    health_query_argv,
    parse_gpu_csv,
    parse_health_csv,
    unknown_query_field,
)
from dflashctl.remote.run import gpu_query_argv
from dflashctl.remote.transport import CommandResult, Transport


class GpuReadError(DflashctlError):
    """nvidia-smi ran in the container and failed (one line naming the host)."""

    exit_code = ExitCode.FAILED


def _no_nvidia_smi(res: CommandResult) -> bool:
    return res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr


class GpuReader:
    """nvidia-smi in one host's container; [] where the container has none."""

    def __init__(self, transport: Transport, host: str) -> None:
        self.transport = transport
        self.host = host
        self._health_prefix = REASONS_PREFIX  # nvidia-smi's clock-event field names (535+)

    async def gpus(self) -> list[GpuSample]:
        """GPU samples from nvidia-smi in the container ([] when it has none)."""
        res = await self.transport.run(gpu_query_argv())
        if _no_nvidia_smi(res):
            return []
        if not res.ok:
            raise GpuReadError(f"{self.host}: nvidia-smi: {res.error_line()}")
        return parse_gpu_csv(res.stdout)

    async def gpu_health(self) -> list[GpuHealth]:
        """ECC counts and clock-event (throttle) reasons per GPU ([] without nvidia-smi). A
        pre-535 driver refuses the new field names: asked again with its own, remembered."""
        for _ in range(2):
            prefix = self._health_prefix
            res = await self.transport.run(health_query_argv(prefix))
            if _no_nvidia_smi(res):
                return []
            if unknown_query_field(res.stderr) and prefix == REASONS_PREFIX:
                self._health_prefix = LEGACY_REASONS_PREFIX
                continue
            if not res.ok:
                raise GpuReadError(f"{self.host}: nvidia-smi: {res.error_line()}")
            healths, errors = parse_health_csv(res.stdout, health_fields(prefix))
            if errors and not healths:
                raise GpuReadError(f"{self.host}: {errors[0]}")
            return healths
        return []
