"""SkyPilot for the tests, with no cloud: its venv, a small catalog of its own on disk, and the fake SDK boundary.

SkyPilot reads its catalog from ``$SKY_RUNTIME_DIR/.sky/catalogs/v8/<cloud>/vms.csv`` and downloads a
missing file from GitHub (unreachable here); a file it did not download (no ``.meta/*.md5``) is never
refreshed. ``write_catalog`` writes the rows the tests rent from, in the columns SkyPilot's fetchers
write (``sky/catalog/data_fetchers/fetch_{runpod,vast,lambda_cloud,aws}.py``): RunPod, Vast.ai,
Lambda and AWS, plus ``common/accelerators.csv`` and ``common/metadata.csv``, which canonicalize
accelerator names. ``sky_env`` points SkyPilot at it, with its home and a local API server port of the
test's own (nothing here starts a server: the SDK calls that would are ``fake_skypilot``'s).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ft_assets.providers import sdk_venv
from ft_assets_tests import fake_skypilot


def _gpu(name: str, mib: int) -> str:
    return f"\"{{'Gpus': [{{'Name': '{name}', 'Manufacturer': 'NVIDIA', 'Count': 1.0, 'MemoryInfo': {{'SizeInMiB': {mib}}}}}], 'TotalGpuMemoryInMiB': {mib}}}\""


RTX4090, H100, A10G, T4 = _gpu("RTX4090", 24576), _gpu("H100", 81920), _gpu("A10G", 24576), _gpu("T4", 16384)
CATALOG = {
    "common/accelerators.csv": [
        "AcceleratorName,Clouds",
        "A10G,\"['AWS']\"",
        "H100,\"['AWS', 'Lambda', 'RunPod', 'Vast', 'Kubernetes']\"",
        "RTX4090,\"['RunPod', 'Vast']\"",
        "T4,\"['AWS']\"",
    ],
    "common/metadata.csv": [
        "GPU,MemoryGB,Manufacturer",
        "A10G,24,NVIDIA",
        "H100,80,NVIDIA",
        "RTX4090,24,NVIDIA",
        "T4,16,NVIDIA",
    ],
    "runpod/vms.csv": [
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Region,SpotPrice,Price,AvailabilityZone,GpuInfo",
        f"1x_RTX4090_SECURE,RTX4090,1.0,6.0,41.0,CA,0.29,0.59,CA-MTL-1,{RTX4090}",
        f"1x_RTX4090_SECURE,RTX4090,1.0,6.0,41.0,US,0.34,0.69,US-GA-1,{RTX4090}",
        f"2x_RTX4090_SECURE,RTX4090,2.0,12.0,82.0,US,0.68,1.38,US-GA-1,{RTX4090}",
        f"1x_H100_SECURE,H100,1.0,16.0,188.0,US,1.25,2.39,US-GA-1,{H100}",
    ],
    "vast/vms.csv": [
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,HostingType",
        f'1x-RTX4090-6-32768,RTX4090,1,6.0,32.0,{RTX4090},0.40,0.25,"Quebec, CA",0',
    ],
    "lambda/vms.csv": [
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice",
        f"gpu_1x_h100_pcie,H100,1.0,26.0,200.0,2.49,us-east-1,{H100},",
    ],
    "aws/vms.csv": [
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone,Arch",
        f"g5.xlarge,A10G,1.0,4.0,16.0,{A10G},1.006,0.4024,us-east-1,us-east-1a,x86_64",
        f"g4dn.xlarge,T4,1.0,4.0,16.0,{T4},0.526,0.2104,us-east-1,us-east-1a,x86_64",
    ],
}


def write_catalog(runtime_dir: Path) -> Path:
    root = runtime_dir / ".sky" / "catalogs" / "v8"
    for name, lines in CATALOG.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("\n".join(lines) + "\n")
    return root


def sky_python() -> str:
    try:
        return sdk_venv.sdk_python()
    except sdk_venv.SdkError as exc:
        pytest.fail(f"{exc} (these tests need SkyPilot's venv: `make install`)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sky_env(tmp_path_factory):
    """SkyPilot's home, runtime dir (the catalog) and local API server port in a temp folder; the fake SDK's state
    and wrapper. Yields {"python": the wrapper, "real_python", "state", "env"}; the environment is set meanwhile."""
    root = tmp_path_factory.mktemp("sky")
    write_catalog(root)
    env = {
        "HOME": str(root), "SKY_RUNTIME_DIR": str(root), "SKYPILOT_API_SERVER_LOCAL_PORT": str(free_port()),
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", fake_skypilot.STATE_ENV: str(root / "state.json"),
    }  # fmt: skip
    real = sky_python()
    fake_skypilot.new_state(root / "state.json")
    wrapper = fake_skypilot.wrapper(root / "sky-python", real, root / "state.json")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield {"python": str(wrapper), "real_python": real, "state": root / "state.json", "env": env, "root": root}
