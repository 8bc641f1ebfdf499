"""One check's result and the verdict over all of them."""
from __future__ import annotations

from dataclasses import asdict, dataclass

PASS, WARN, FAIL = "pass", "warn", "fail"
ORDER = {FAIL: 0, WARN: 1, PASS: 2}


@dataclass(frozen=True)
class CheckResult:
    id: str          # stable: scripts match on it (cpu.count, disk.store.odirect, …)
    status: str      # pass | warn | fail
    detail: str      # one line naming the thing and the limit

    def __post_init__(self):
        assert self.status in ORDER, self.status
        assert "\n" not in self.detail, self.detail

    def as_dict(self) -> dict:
        return asdict(self)


def passed(id: str, detail: str) -> CheckResult:
    return CheckResult(id, PASS, detail)


def warned(id: str, detail: str) -> CheckResult:
    return CheckResult(id, WARN, detail)


def failed(id: str, detail: str) -> CheckResult:
    return CheckResult(id, FAIL, detail)


def verdict(results: list[CheckResult]) -> str:
    """go only when nothing fails: a warning is worth reading, not a reason to stop."""
    return "no-go" if any(r.status == FAIL for r in results) else "go"


def fails_first(results: list[CheckResult]) -> list[CheckResult]:
    return sorted(results, key=lambda r: ORDER[r.status])  # stable: probe order within a status


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"
