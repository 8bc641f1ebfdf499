"""GPU: count, model, VRAM, driver and compute capability, through NVML with nvidia-smi as fallback."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field

from tool.preflight.checks import CheckResult, failed, gib, passed, warned

MIB = 2**20
SMI_QUERY = "index,name,memory.total,memory.free,driver_version,compute_cap"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute: str | None   # "8.6"; None when the driver does not report it


@dataclass
class GpuReport:
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None
    source: str | None = None                         # "NVML" | "nvidia-smi"
    errors: list[str] = field(default_factory=list)   # why each source gave nothing

    @property
    def why_none(self) -> str:
        return "; ".join(self.errors) or "no NVIDIA GPU"


def version_tuple(v: str) -> tuple[int, ...]:
    """'610.57' → (610, 57); '580.65.06' → (580, 65, 6): compared numerically, never as strings."""
    return tuple(int(x) for x in v.strip().split(".") if x.isdigit())


def _nvml() -> GpuReport:
    import pynvml  # nvidia-ml-py: loads libnvidia-ml.so.1 at nvmlInit

    pynvml.nvmlInit()
    try:
        def text(x):
            return x.decode() if isinstance(x, bytes) else x
        report = GpuReport(driver=text(pynvml.nvmlSystemGetDriverVersion()), source="NVML")
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            except pynvml.NVMLError:
                cc = None
            report.gpus.append(Gpu(i, text(pynvml.nvmlDeviceGetName(h)), int(mem.total), int(mem.free), cc))
        return report
    finally:
        pynvml.nvmlShutdown()


def parse_smi(csv: str) -> GpuReport:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total,memory.free,driver_version,compute_cap
    --format=csv,noheader,nounits` (MiB)."""
    report = GpuReport(source="nvidia-smi")
    for line in csv.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 5:
            continue
        cc = f[5] if len(f) > 5 and f[5] not in ("", "[N/A]", "N/A") else None
        report.gpus.append(Gpu(int(f[0]), f[1], int(float(f[2]) * MIB), int(float(f[3]) * MIB), cc))
        report.driver = f[4]
    return report


def _smi() -> GpuReport:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi: not on PATH")
    run = subprocess.run([exe, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=15)
    if run.returncode != 0:
        raise RuntimeError(f"nvidia-smi: exit {run.returncode}: {(run.stderr or run.stdout).strip().splitlines()[-1:] or ''}")
    return parse_smi(run.stdout)


def probe(use_nvml: bool = True) -> GpuReport:
    errors = []
    for name, fn in ([("NVML", _nvml)] if use_nvml else []) + [("nvidia-smi", _smi)]:
        try:
            report = fn()
        except Exception as e:  # a missing library / binary / driver is an answer here, not a crash
            msg = str(e).strip() or type(e).__name__
            errors.append(msg if msg.startswith(name) else f"{name}: {msg}")
            continue
        if report.gpus:
            return report
        errors.append(f"{name}: no GPUs listed")
    return GpuReport(errors=errors)


def check(recipe: dict, report: GpuReport, fast: bool = False) -> list[CheckResult]:
    hw = recipe["hardware"]
    need = int(hw.get("gpu_count", 0))
    if need == 0:
        return [passed("gpu.count", "no GPU needed (a CPU recipe)")]
    card = hw.get("card_name", hw.get("card", "GPU"))
    min_vram = hw.get("min_vram_bytes", 0)
    gpus = report.gpus
    listing = "; ".join(f"GPU {g.index} {g.name} ({gib(g.total_bytes)}, {gib(g.free_bytes)} free)" for g in gpus)
    if len(gpus) < need:
        count = failed("gpu.count", f"{need} × {card} needed; found {len(gpus) or 'none'}" + (f": {listing}" if gpus else f" ({report.why_none})"))
    else:
        count = passed("gpu.count", f"{need} × {card} needed; {len(gpus)} via {report.source}: {listing}")
    out = [count, check_vram(need, min_vram, gpus)]
    if fast:
        return out
    return out + [check_driver(hw.get("min_driver"), report), check_compute(need, hw.get("min_compute_capability"), gpus)]


def check_vram(need: int, min_vram: int, gpus: list[Gpu]) -> CheckResult:
    if not gpus:
        return failed("gpu.vram", f"{gib(min_vram)} VRAM per GPU needed on {need} GPU(s); no GPU found")
    big = [g for g in gpus if g.total_bytes >= min_vram]
    if len(big) < need:
        small = ", ".join(f"GPU {g.index} has {gib(g.total_bytes)}" for g in gpus if g.total_bytes < min_vram)
        return failed("gpu.vram", f"{gib(min_vram)} VRAM per GPU needed on {need} GPU(s); {small}")
    short = [g for g in big[:need] if g.free_bytes < min_vram]
    if short:
        busy = ", ".join(f"GPU {g.index} has {gib(g.free_bytes)} free" for g in short)
        return warned("gpu.vram", f"{gib(min_vram)} VRAM per GPU needed; {len(big)} GPU(s) are large enough but {busy} (other processes hold VRAM)")
    return passed("gpu.vram", f"{gib(min_vram)} VRAM per GPU needed on {need} GPU(s); " + ", ".join(f"GPU {g.index} has {gib(g.total_bytes)}" for g in big[:need]))


def check_driver(min_driver: str | None, report: GpuReport) -> CheckResult:
    if not min_driver:
        return passed("gpu.driver", f"no minimum driver; driver {report.driver or 'none found'}")
    if report.driver is None:
        return failed("gpu.driver", f"NVIDIA driver ≥ {min_driver} needed; none found ({report.why_none})")
    ok = version_tuple(report.driver) >= version_tuple(min_driver)
    return (passed if ok else failed)("gpu.driver", f"NVIDIA driver ≥ {min_driver} needed; this host has {report.driver}")


def check_compute(need: int, min_cc: str | None, gpus: list[Gpu]) -> CheckResult:
    if not min_cc:
        return passed("gpu.compute", "no minimum compute capability")
    if not gpus:
        return failed("gpu.compute", f"compute capability ≥ {min_cc} needed; no GPU found")
    unknown = [g for g in gpus if g.compute is None]
    good = [g for g in gpus if g.compute and version_tuple(g.compute) >= version_tuple(min_cc)]
    have = ", ".join(f"GPU {g.index} {g.compute or 'unreported'}" for g in gpus)
    if len(good) >= need:
        return passed("gpu.compute", f"compute capability ≥ {min_cc} needed; {have}")
    if len(good) + len(unknown) >= need:
        return warned("gpu.compute", f"compute capability ≥ {min_cc} needed; the driver does not report it ({have})")
    return failed("gpu.compute", f"compute capability ≥ {min_cc} needed; {have}")
