"""Preflight verdicts: one actionable line per failure, naming the host."""

from __future__ import annotations

from dflashctl.releases.preflight import GIB, Preflight, judge_probe, parse_probe_output

OK = {
    "python": "3.11.7",
    "modules": {"torch": "2.13.0", "numpy": "2.4.6", "pydantic": "2.14.4"},
    "errors": {},
    "free_bytes": 50 * GIB,
    "complete": False,
    "current": None,
    "nvidia_smi": False,
    "gpus": [],
}


def judge(**over: object) -> Preflight:
    return judge_probe(
        "pve-a", "/usr/bin/python3", "/opt/dflash", {**OK, **over}, min_free_bytes=GIB
    )


def test_healthy_cpu_container_passes_with_a_note() -> None:
    pre = judge()
    assert pre.ok and "torch=2.13.0" in pre.summary()
    assert pre.notes == ["pve-a: no nvidia-smi in the container: the trainer will run on CPU"]


def test_each_failure_is_one_line() -> None:
    pre = judge(
        modules={"numpy": "2.4.6"},
        errors={
            "torch": "ModuleNotFoundError: No module named 'torch'",
            "pydantic": "ImportError: x",
        },
        free_bytes=GIB // 10,
    )
    assert len(pre.failures) == 3
    assert all(f.startswith("pve-a: ") and "\n" not in f for f in pre.failures)
    assert any("cannot import torch" in f for f in pre.failures)
    assert any("0.10 GiB free under /opt/dflash" in f for f in pre.failures)


def test_gpu_rules() -> None:
    assert "lists no GPUs" in judge(nvidia_smi=True, gpus=[]).failures[0]
    assert "driver" in judge(nvidia_smi=True, smi_error=["NVML mismatch"]).failures[0]
    cpu_torch = judge(
        nvidia_smi=True, gpus=["0, RTX, 97887"], cuda_available=False, torch_cuda=None
    )
    assert "torch.cuda.is_available() is False" in cpu_torch.failures[0]
    assert judge(nvidia_smi=True, gpus=["0, RTX, 97887"] * 8, cuda_available=True).ok


def test_probe_output_tolerates_noise_before_json() -> None:
    assert parse_probe_output('banner\n{"python": "3.11"}\n') == {"python": "3.11"}
    assert parse_probe_output("Traceback ...\n") is None
